"""Fill in the middle: code completion between a prefix and a suffix (OpenAI's ``suffix``).

Code models trained for fill-in-the-middle (FIM) read the text before and after the cursor between
special tokens and write what goes between. The layout is prefix-suffix-middle: ``<fim_prefix>
PREFIX <fim_suffix> SUFFIX <fim_middle>``, the middle generated after it. Two spellings of those
tokens are common: Qwen2.5-Coder's ``<|fim_prefix|>`` and StarCoder's and SantaCoder's
``<fim_prefix>``. A model with neither is refused rather than handed a prompt it was never trained
on. Speculation works on the result like on any prompt; prompt lookup drafts well here, since a
middle often repeats names from both sides.

The middle ends with the end-of-text token, which is not always the chat model's EOS: Qwen2.5-Coder
Instruct ends chat turns with ``<|im_end|>`` and a middle with ``<|endoftext|>``, after which it
starts a new file if let go on (measured on the 0.5B). So a FIM request also stops at the
document-level tokens its vocabulary has, as llama.cpp's infill does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verispec.errors import VerispecError

FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
)
END_OF_MIDDLE = ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<file_sep>")
"""Tokens after which a middle is over (those in the model's vocabulary are used)."""


@dataclass(frozen=True)
class FimPrompt:
    ids: list[int]
    """The prompt that asks for the middle."""
    stop_token_ids: tuple[int, ...]
    """The end-of-text tokens that end the middle (see the module docstring)."""


def fim_prompt(tokenizer: Any, prefix: str, suffix: str) -> FimPrompt:
    """The prompt that asks ``tokenizer``'s model for the middle between ``prefix`` and ``suffix``."""
    vocab = tokenizer.get_vocab()
    for names in FIM_SPELLINGS:
        if all(name in vocab for name in names):
            start, hole, middle = (vocab[name] for name in names)
            encode = tokenizer.encode
            before = encode(prefix, add_special_tokens=False) if prefix else []
            after = encode(suffix, add_special_tokens=False) if suffix else []
            ends = tuple(vocab[name] for name in END_OF_MIDDLE if name in vocab)
            return FimPrompt([start, *before, hole, *after, middle], ends)
    raise VerispecError(
        "suffix needs a model trained for fill-in-the-middle; this model's tokenizer has none of "
        f"the FIM tokens {', '.join(names[0] for names in FIM_SPELLINGS)}"
    )
