"""Fill in the middle: code completion between a prefix and a suffix (OpenAI's ``suffix``).

Code models trained for fill-in-the-middle (FIM) read the text before and after the cursor between
special tokens and write what goes between. The layout is prefix-suffix-middle: ``<prefix-token>
PREFIX <suffix-token> SUFFIX <middle-token>``, the middle generated after it. The tokens are spelled
per model family (:data:`FIM_FORMATS`), and the format is found by looking the spellings up in the
tokenizer's vocabulary. A model with none of them is refused rather than handed a prompt it was
never trained on. Speculation works on the result like on any prompt; prompt lookup drafts well
here, since a middle often repeats names from both sides.

Only byte-level BPE families are listed: their parts tokenize the same alone as in one string (the
special tokens split the text before the BPE runs), so the prompt built from parts is the one the
model was trained on. CodeLlama (``<PRE> {prefix} <SUF>{suffix} <MID>``) and Codestral
(``[SUFFIX]suffix[PREFIX] prefix``) use SentencePiece vocabularies where the prefix keeps the
word-start space and the suffix drops it; getting that exactly right needs their tokenizers, which
cannot be installed here (no model hub), so they are refused like a model without FIM.

The middle ends with the end-of-text token, which is not always the chat model's EOS: Qwen2.5-Coder
Instruct ends chat turns with ``<|im_end|>`` and a middle with ``<|endoftext|>``, after which it
starts a new file if let go on (measured on the 0.5B). So a FIM request also stops at the
document-level tokens its vocabulary has, as llama.cpp's infill does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verispec.errors import VerispecError


@dataclass(frozen=True)
class FimFormat:
    """One family's FIM tokens, in prompt order, and the tokens after which its middle is over."""

    family: str
    prefix: str
    suffix: str
    middle: str
    ends: tuple[str, ...]
    """End-of-text and file-separator tokens (those in the model's vocabulary are used)."""


FIM_FORMATS = (
    FimFormat(
        "Qwen2.5-Coder, CodeGemma",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|file_separator|>"),
    ),
    FimFormat(
        "StarCoder, StarCoder2",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        ("<|endoftext|>", "<file_sep>"),
    ),
    FimFormat("SantaCoder", "<fim-prefix>", "<fim-suffix>", "<fim-middle>", ("<|endoftext|>",)),
    FimFormat(
        "DeepSeek-Coder",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        ("<｜end▁of▁sentence｜>", "<|EOT|>"),
    ),
)


@dataclass(frozen=True)
class FimPrompt:
    ids: list[int]
    """The prompt that asks for the middle."""
    stop_token_ids: tuple[int, ...]
    """The end-of-text tokens that end the middle (see the module docstring)."""
    family: str = ""
    """Whose FIM format the prompt is in."""


def fim_format(tokenizer: Any) -> FimFormat:
    """The FIM format whose three tokens are all in ``tokenizer``'s vocabulary."""
    vocab = tokenizer.get_vocab()
    for fmt in FIM_FORMATS:
        if all(name in vocab for name in (fmt.prefix, fmt.suffix, fmt.middle)):
            return fmt
    raise VerispecError(
        "suffix needs a model trained for fill-in-the-middle; this model's tokenizer has none of the "
        f"FIM tokens {', '.join(f.prefix for f in FIM_FORMATS)} (families: "
        f"{'; '.join(f.family for f in FIM_FORMATS)})"
    )


def leading_special_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before any text (a BOS for DeepSeek-Coder, none for Qwen).

    A FIM prompt is built from parts encoded without special tokens, so this is what encoding the
    whole prompt as one string would have started with; the model was trained with it there."""
    probe = "x"
    full = list(tokenizer.encode(probe))
    bare = list(tokenizer.encode(probe, add_special_tokens=False))
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start]
    return []


def fim_prompt(tokenizer: Any, prefix: str, suffix: str) -> FimPrompt:
    """The prompt that asks ``tokenizer``'s model for the middle between ``prefix`` and ``suffix``."""
    fmt = fim_format(tokenizer)
    vocab = tokenizer.get_vocab()
    start, hole, middle = (vocab[name] for name in (fmt.prefix, fmt.suffix, fmt.middle))
    before = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    after = tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
    ends = tuple(vocab[name] for name in fmt.ends if name in vocab)
    ids = [*leading_special_ids(tokenizer), start, *before, hole, *after, middle]
    return FimPrompt(ids, ends, fmt.family)
