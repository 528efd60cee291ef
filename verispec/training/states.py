"""The target's hidden states of one training sequence, computed as the engine computes them.

Heads learn from the target's last hidden state after each token and its greedy next token there.
Both are taken from the engine's own forward (int8 or int4 on the fast paths: what drafting will
see), and a distilled reply is fed as the engine fed it when the target wrote it, so that the
states the heads train on are the states they meet at inference.
"""

from __future__ import annotations

from typing import Any

import torch

from verispec.config import SchedulerConfig

DECODE_ROWS = 16
"""Tokens a store pass feeds per forward after the prompt: any count up to a verify step's limit
(``verispec.models.attention.ROWWISE_MAX_QUERIES``) scores each token as a decode step does."""


@torch.inference_mode()
def target_states(
    target: Any,
    ids: list[int],
    feature_layers: tuple[int, ...] = (),
    prompt_len: int = 0,
    *,
    raw_features: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden state after each token of ``ids`` ``[n, H]`` (``[n, (1 + F) H]`` with
    ``feature_layers``) and its argmax next token ``[n]``, with the engine's own forward (so, int8 on
    the fast path: what drafting will see).

    ``prompt_len`` (a distilled reply's prompt): fed as the engine fed it when the target wrote the
    reply, its prompt but the last token prefilled in the engine's chunks and the rest as decode
    rows. On the quantized paths that is not a detail: their activation rows are rounded to 7-8
    bits, so prefill's attention (SDPA, whose last bits depend on the row count) moves some rows by a
    quantization step. Prefilled whole, the 1.5B int4's states of its own replies had a median
    cosine of 0.998 to those it wrote them with and an argmax other than the token it wrote at 1.9%
    of reply positions; fed this way they are the same (``tests/training/test_keep.py``). 0 prefills
    ``ids`` whole (text nobody generated: a prompt's states are all there is).
    """
    if prompt_len <= 0:
        parts = [_fed(target, ids, feature_layers, raw_features, prefill=True)]
    else:
        chunk, cache = SchedulerConfig().prefill_chunk, target.new_cache()
        parts, pos = [], 0
        while pos < prompt_len - 1:  # as the engine's prefill (verispec.engine.step) cuts a prompt
            end = min(prompt_len - 1, (pos // chunk + 1) * chunk)
            parts.append(_fed(target, ids[pos:end], feature_layers, raw_features, prefill=True, cache=cache))
            pos = end
        for a in range(pos, len(ids), DECODE_ROWS):
            rows = ids[a : a + DECODE_ROWS]
            parts.append(_fed(target, rows, feature_layers, raw_features, prefill=False, cache=cache))
    return torch.cat([h for h, _ in parts]), torch.cat([t for _, t in parts]).int()


def _fed(
    target: Any,
    ids: list[int],
    feature_layers: tuple[int, ...],
    raw_features: bool,
    *,
    prefill: bool,
    cache: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``ids`` after ``cache``'s tokens: states and argmax, as a prefill (no logits:
    the many-row kernels) or as decode rows (logits kept: the decode kernels)."""
    n = len(ids)
    out = target.forward_batch(
        [cache if cache is not None else target.new_cache()],
        [ids],
        logits_to_keep=[0 if prefill else n],
        hidden_to_keep=[n],
        feature_layers=feature_layers,
        raw_features=raw_features,
    )
    hidden = out.hidden[0].float()
    if not prefill:
        return hidden, out.logits[0].argmax(dim=-1)
    return hidden, lm_head_argmax(target, hidden[:, : target.hidden_size])


def lm_head_argmax(target: Any, rows: torch.Tensor) -> torch.Tensor:
    """The target's greedy next token after each last-layer state ``[n, H]`` (256 rows of logits at a
    time): for prompt rows, whose prefill keeps no logits. One function for the store pass and for
    ``verispec distill --keep-hidden``, whose argmaxes must agree to the bit."""
    return torch.cat([target.lm_head(chunk).argmax(dim=-1) for chunk in rows.split(256)])
