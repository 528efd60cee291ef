"""Fill-in-the-middle prompts: the layout for each spelling of the FIM tokens, and the refusal for a
model without them (the real Qwen2.5-Coder end to end: tests/server/test_qwen_fim.py)."""

from __future__ import annotations

import copy

import pytest

from tests.server.harness import tiny_tokenizer
from verispec.errors import VerispecError
from verispec.fim import FIM_SPELLINGS, fim_prompt


@pytest.mark.parametrize("names", FIM_SPELLINGS, ids=["qwen", "starcoder"])
def test_prefix_and_suffix_go_between_the_fim_tokens(names):
    tok = copy.deepcopy(tiny_tokenizer())  # shared by other tests: add the tokens to a copy
    tok.add_special_tokens({"additional_special_tokens": [*names, "<|file_sep|>"]})
    start, hole, middle, file_sep = tok.convert_tokens_to_ids([*names, "<|file_sep|>"])
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    before = tok.encode(prefix, add_special_tokens=False)
    after = tok.encode(suffix, add_special_tokens=False)
    fim = fim_prompt(tok, prefix, suffix)
    assert fim.ids == [start, *before, hole, *after, middle]
    assert fim.stop_token_ids == (file_sep,)  # the end-of-text tokens this vocabulary has
    assert fim_prompt(tok, "", "").ids == [start, hole, middle]


def test_a_model_without_fim_tokens_is_refused():
    with pytest.raises(VerispecError, match=r"fill-in-the-middle.*<\|fim_prefix\|>, <fim_prefix>"):
        fim_prompt(tiny_tokenizer(), "def f():", "")
