"""Batch-invariant attention: a token's attention output does not depend on the tokens beside it.

Greedy speculative decoding is lossless only if the target scores a token the same way whether it
is decoded alone or verified together with k draft tokens. Stock attention kernels split queries
and keys into blocks whose sizes depend on the sequence lengths, so the result changes in the last
bits; on the int8 path each activation row is rounded to 7 bits, which turns those last-bit changes
into whole quantization steps and greedy output drifts (seen on SmolLM2 from the first token).

Here each query position is computed by itself, over exactly the keys it may see (its causal
prefix), with matrix products whose shapes depend only on that position: the same operations run
for position p in a plain decode step or a verify step, so the result is bit-identical. Query heads
that share a key/value head are computed together (a fixed group size), so the cost is one small
product per position and layer, negligible next to the int8 Linears at decode lengths.

A long prefill would pay a Python loop over thousands of positions, so calls with more than
:data:`ROWWISE_MAX_QUERIES` new tokens use SDPA. That is safe because the engine prefills every
prompt the same way whether it speculates or not (all prompt tokens but the last, in one call), so
only decode and verify steps, which stay under the limit, have to agree with each other.

Registered with transformers' attention interface as ``verispec_rowwise``; layers with a sliding
window, and calls with a custom mask (token trees) fall back to transformers' SDPA.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from verispec.config import MAX_SPECULATIVE_TOKENS

NAME = "verispec_rowwise"
ROWWISE_MAX_QUERIES = MAX_SPECULATIVE_TOKENS + 2
"""Decode and verify steps feed at most k + 2 tokens (a pending token the draft lags by, the last
committed token and k drafts); longer calls are prefills and take SDPA."""


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, S, D]
    key: torch.Tensor,  # [B, Hkv, T, D], the cache plus the S new positions
    value: torch.Tensor,  # [B, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    batch, heads, new, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    custom_mask = attention_mask is not None and new > 1 and _is_custom(attention_mask, total - new)
    prefill = new > ROWWISE_MAX_QUERIES
    sliding = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if prefill or sliding or custom_mask or batch != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    past = total - new
    q = query[0].reshape(kv_heads, groups, new, dim)  # [Hkv, G, S, D]
    out = query.new_empty(new, kv_heads, groups, dim)  # [S, Hkv, G, D]
    for s in range(new):
        seen = past + s + 1  # causal prefix of position past + s
        scores = torch.matmul(q[:, :, s], key[0, :, :seen].transpose(1, 2)) * scale  # [Hkv, G, seen]
        probs = scores.float().softmax(dim=-1).to(value.dtype)
        out[s] = torch.matmul(probs, value[0, :, :seen])  # [Hkv, G, D]
    return out.reshape(1, new, heads, dim), None  # [B, S, H, D], as transformers expects


def _is_custom(mask: torch.Tensor, past: int) -> bool:
    """True for a mask other than the plain causal one (e.g. a token tree's)."""
    if mask.dtype != torch.bool:
        mask = mask == 0
    new, total = mask.shape[-2], mask.shape[-1]
    causal = torch.ones(new, total, dtype=torch.bool, device=mask.device).tril(diagonal=past)
    return not torch.equal(mask.reshape(-1, new, total)[0], causal)


def register() -> str:
    """Make the attention available to ``from_pretrained(attn_implementation=...)``; idempotent."""
    AttentionInterface.register(NAME, rowwise_attention)
    return NAME
