"""Batch-invariant attention: a token's attention output does not depend on the tokens beside it.

Greedy speculative decoding is lossless only if the target scores a token the same way whether it
is decoded alone, verified together with k draft tokens, or batched with other users' sequences.
Stock attention kernels split queries and keys into blocks whose sizes depend on the sequence
lengths, so the result changes in the last bits; on the int8 path each activation row is rounded
to 7 bits, which turns those last-bit changes into whole quantization steps and greedy output
drifts (seen on SmolLM2 from the first token).

Here each query position is computed by itself, over exactly the keys it may see (its causal
prefix, cut to the sliding window on sliding layers, or its ancestors in a token tree), read from
its own sequence's :class:`~verispec.models.kv.KVBuffer`, with matrix products whose shapes depend
only on that position: the same operations run for position p in a plain decode step, a verify
step or a batch of many sequences, so the result is bit-identical. Query heads that share a
key/value head are computed together (a fixed group size), so the cost is one small product per
position and layer, small next to the Linears at decode lengths.

A long prefill would pay a Python loop over thousands of positions, so a row with more than
:data:`ROWWISE_MAX_QUERIES` new tokens uses SDPA. That is safe because the engine prefills every
prompt the same way whether it speculates or not (all prompt tokens but the last, in chunks fixed
by the prompt length alone), so only decode and verify steps, which stay under the limit, have to
agree with each other.

Registered with transformers' attention interface as ``verispec_rowwise``. A call without the
``verispec_rows`` keyword (someone running the decoder with a transformers cache) falls back to
transformers' SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from verispec.config import MAX_SPECULATIVE_TOKENS
from verispec.models.kv import RowBatch

NAME = "verispec_rowwise"
ROWWISE_MAX_QUERIES = MAX_SPECULATIVE_TOKENS + 2
"""Decode and verify steps feed at most k + 2 tokens (a pending token the draft lags by, the last
committed token and k drafts); longer rows are prefills and take SDPA."""


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, S, D]
    key: torch.Tensor,  # [B, Hkv, S, D] (our RowBatch returns only the new positions)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    rows = kwargs.get("verispec_rows")
    if not isinstance(rows, RowBatch):
        kwargs.pop("verispec_rows", None)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    layer = int(module.layer_idx)
    out = query.new_zeros(batch, width, kv_heads, groups, dim)  # padded queries stay zero
    for b in range(batch):
        keys, values = rows.caches[b].layer(layer)  # [Hkv, capacity, D]
        start, n = rows.starts[b], rows.lengths[b]
        tree = rows.tree_mask(b)
        if n > ROWWISE_MAX_QUERIES and tree is None:
            out[b, :n] = _prefill_row(query[b, :, :n], keys, values, start, scale, window).view(
                n, kv_heads, groups, dim
            )
            continue
        q = query[b].reshape(kv_heads, groups, width, dim)  # [Hkv, G, S, D]
        for s in range(n):
            if tree is None:
                seen = start + s + 1
                lo = max(0, seen - window) if window else 0
                k_s, v_s = keys[:, lo:seen], values[:, lo:seen]
            else:
                idx = torch.cat([torch.arange(start), start + tree[s, :n].nonzero().flatten()])
                k_s, v_s = keys.index_select(1, idx), values.index_select(1, idx)
            scores = torch.matmul(q[:, :, s], k_s.transpose(1, 2)) * scale  # [Hkv, G, seen]
            probs = scores.float().softmax(dim=-1).to(v_s.dtype)
            out[b, s] = torch.matmul(probs, v_s)  # [Hkv, G, D]
    return out.reshape(batch, width, heads, dim), None  # [B, S, H, D], as transformers expects


def _prefill_row(
    query: torch.Tensor,  # [H, n, D]
    keys: torch.Tensor,  # [Hkv, capacity, D]
    values: torch.Tensor,
    start: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """SDPA for one long row over its cached prefix plus its new tokens: [n, H, D]."""
    n = query.shape[1]
    total = start + n
    pos = torch.arange(start, total).unsqueeze(1)  # [n, 1] query positions
    key_pos = torch.arange(total).unsqueeze(0)  # [1, total]
    allowed = key_pos <= pos
    if window:
        allowed &= key_pos > pos - window
    out = F.scaled_dot_product_attention(
        query.unsqueeze(0),
        keys[:, :total].unsqueeze(0),
        values[:, :total].unsqueeze(0),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1)


def register() -> str:
    """Make the attention available to ``set_attn_implementation``; idempotent."""
    AttentionInterface.register(NAME, rowwise_attention)
    return NAME
