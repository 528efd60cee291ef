"""Fill-in-the-middle prompts: the layout for each family's FIM tokens, the BOS a tokenizer adds, and
the refusal for a model without them (the real Qwen2.5-Coder end to end: tests/server/test_qwen_fim.py)."""

from __future__ import annotations

import copy

import pytest
from tokenizers import processors

from tests.server.harness import tiny_tokenizer
from verispec.errors import VerispecError
from verispec.fim import FIM_FORMATS, FimFormat, fim_prompt, leading_special_ids

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"


def with_fim_tokens(fmt: FimFormat, extra: tuple[str, ...] = ()):
    tok = copy.deepcopy(tiny_tokenizer())  # shared by other tests: add the tokens to a copy
    tok.add_special_tokens({"additional_special_tokens": [fmt.prefix, fmt.suffix, fmt.middle, *extra]})
    return tok


@pytest.mark.parametrize("fmt", FIM_FORMATS, ids=[f.family.split(",")[0] for f in FIM_FORMATS])
def test_prefix_and_suffix_go_between_the_fim_tokens(fmt: FimFormat) -> None:
    tok = with_fim_tokens(fmt, fmt.ends[-1:])
    start, hole, middle, end = tok.convert_tokens_to_ids([fmt.prefix, fmt.suffix, fmt.middle, fmt.ends[-1]])
    before = tok.encode(PREFIX, add_special_tokens=False)
    after = tok.encode(SUFFIX, add_special_tokens=False)
    fim = fim_prompt(tok, PREFIX, SUFFIX)
    assert fim.ids == [start, *before, hole, *after, middle] and fim.family == fmt.family
    assert fim.stop_token_ids == (end,)  # only the end-of-text tokens this vocabulary has
    assert fim_prompt(tok, "", "").ids == [start, hole, middle]
    # Built from parts, the prompt is what the whole FIM string tokenizes to (byte-level BPE).
    assert fim.ids == tok.encode(fmt.prefix + PREFIX + fmt.suffix + SUFFIX + fmt.middle)


def test_a_tokenizer_that_starts_text_with_bos_starts_the_fim_prompt_with_it() -> None:
    deepseek = next(f for f in FIM_FORMATS if f.family == "DeepSeek-Coder")
    tok = with_fim_tokens(deepseek, ("<｜begin▁of▁sentence｜>",))
    bos = tok.convert_tokens_to_ids("<｜begin▁of▁sentence｜>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<｜begin▁of▁sentence｜> $A", special_tokens=[("<｜begin▁of▁sentence｜>", bos)]
    )
    assert leading_special_ids(tok) == [bos] and leading_special_ids(tiny_tokenizer()) == []
    fim = fim_prompt(tok, PREFIX, SUFFIX)
    assert fim.ids[0] == bos and fim.ids[1] == tok.convert_tokens_to_ids(deepseek.prefix)
    assert fim.ids == tok.encode(deepseek.prefix + PREFIX + deepseek.suffix + SUFFIX + deepseek.middle)


def test_the_first_family_whose_three_tokens_are_all_there_is_used() -> None:
    qwen, starcoder = FIM_FORMATS[0], FIM_FORMATS[1]
    tok = with_fim_tokens(starcoder, (qwen.prefix,))  # one stray Qwen token does not make a Qwen model
    assert fim_prompt(tok, "a", "b").family == starcoder.family


def test_a_model_without_fim_tokens_is_refused() -> None:
    with pytest.raises(VerispecError, match=r"fill-in-the-middle.*<\|fim_prefix\|>, <fim_prefix>.*DeepSeek"):
        fim_prompt(tiny_tokenizer(), "def f():", "")
