"""Batch-invariant attention: a token's attention output does not depend on the tokens beside it.

Greedy speculative decoding is lossless only if the target scores a token the same way whether it
is decoded alone, verified together with k draft tokens, or batched with other users' sequences.
Stock attention kernels split queries and keys into blocks whose sizes depend on the sequence
lengths, so the result changes in the last bits; on the int8 path each activation row is rounded
to 7 bits, which turns those last-bit changes into whole quantization steps and greedy output
drifts (seen on SmolLM2 from the first token).

Here each query position is computed by itself, over exactly the keys it may see (its causal
prefix, cut to the sliding window on sliding layers, or its ancestors in a token tree, laid out
after the prefix like a chain for the time of its product), read from
its own sequence's :class:`~verispec.models.kv.KVBuffer`, with matrix products whose shapes depend
only on that position: the same operations run for position p in a plain decode step, a verify
step or a batch of many sequences, so the result is bit-identical. Query heads that share a
key/value head are computed together (a fixed group size), so the cost is one small product per
position and layer, small next to the Linears at decode lengths.

Decode and verify rows in float32 on CPU run all their positions in one C++ call per layer
(``kernels/rowwise_attention.cpp``, same rule: each position's loops depend on that position
alone), since the Python loop's ~10 small torch operations per position and layer cost more than
their arithmetic; elsewhere (other dtypes, CUDA, no compiler) the Python loop below runs. The two
round differently in the last bits, so a model uses one of them throughout (its
``native_attention``, which each forward's :class:`~verispec.models.kv.RowBatch` carries).

The C++ call takes prompt rows too, however long: a position's keys, values and hidden state are
then the same bits whether a prefill computed it or a decode step did, which is what lets the
prefix cache (:mod:`verispec.engine.prefix_cache`) hand one request's keys and values, prompt and
output alike, to a later request as if it had computed them itself (it is also no slower than SDPA
there: 1.74-1.89 s against 1.90-2.23 s for a 1536-token SmolLM2 prefill on a 2-core Zen 4). Where
the Python loop runs instead, a row with more than :data:`ROWWISE_MAX_QUERIES` new tokens uses SDPA
rather than a loop over thousands of positions: safe for speculation because the engine prefills
every prompt the same way whether it speculates or not, but such a model's prompt keys differ from
decoded ones in the last bits, so it keeps no prefix cache.

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
from verispec.models import native
from verispec.models.kv import RowBatch

NAME = "verispec_rowwise"
NATIVE_SOURCE = "rowwise_attention.cpp"
ROWWISE_MAX_QUERIES = MAX_SPECULATIVE_TOKENS + 2
"""Decode and verify steps feed at most k + 2 tokens (a pending token the draft lags by, the last
committed token and k drafts); longer rows are prefills, and take SDPA where the C++ call does not
run."""


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, N, D]: the rows packed (see RowBatch)
    key: torch.Tensor,  # [1, Hkv, N, D] (our RowBatch returns only the new positions)
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
    _, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    layer = int(module.layer_idx)
    out = query.new_empty(tokens, kv_heads, groups, dim)
    for b in range(len(rows.caches)):
        keys, values = rows.caches[b].layer(layer)  # [Hkv, capacity, D]
        start, n, span = rows.starts[b], rows.lengths[b], rows.span(b)
        row_query = query[0, :, span]  # [H, n, D]
        tree = rows.tree_mask(b)
        if tree is not None:  # built on the CPU by the engine; its paths index this row's buffers
            tree = tree.to(keys.device)
        if rows.native_attention and _native_ready(query, keys):
            out[span] = torch.ops.verispec_attention.rowwise_attention(
                row_query, keys, values, start, window or 0, tree, scale
            ).view(n, kv_heads, groups, dim)
            continue
        if n > ROWWISE_MAX_QUERIES and tree is None:
            out[span] = _prefill_row(row_query, keys, values, start, scale, window).view(
                n, kv_heads, groups, dim
            )
            continue
        q = row_query.reshape(kv_heads, groups, n, dim)  # [Hkv, G, n, D]
        row_out = out[span]
        tree_nodes = None  # the tree's own keys and values, in node order, and its mask
        if tree is not None:
            tree_nodes = (keys[:, start : start + n].clone(), values[:, start : start + n].clone(), tree)
        for s in range(n):
            path = s + 1 if tree_nodes is None else _lay_out_path(keys, values, tree_nodes, start, s)
            seen = start + path
            lo = max(0, seen - window) if window else 0
            k_s, v_s = keys[:, lo:seen], values[:, lo:seen]
            scores = torch.matmul(q[:, :, s], k_s.transpose(1, 2)) * scale  # [Hkv, G, seen]
            probs = scores.float().softmax(dim=-1).to(v_s.dtype)
            row_out[s] = torch.matmul(probs, v_s)  # [Hkv, G, D]
        if tree_nodes is not None:  # the tree's keys and values back in node order, for the rollback
            keys[:, start : start + n] = tree_nodes[0]
            values[:, start : start + n] = tree_nodes[1]
    return out.reshape(1, tokens, heads, dim), None  # [1, N, H, D], as transformers expects


def _native_ready(query: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether this row can run verispec's C++ attention (float32 on CPU, where it builds)."""
    if query.dtype != torch.float32 or keys.dtype != torch.float32 or query.device.type != "cpu":
        return False
    return native.ready(NATIVE_SOURCE, "decode rows use the Python attention loop")


def _lay_out_path(
    keys: torch.Tensor,  # [Hkv, capacity, D], the row's buffer
    values: torch.Tensor,
    tree_nodes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # keys, values [Hkv, n, D]; mask [n, n]
    start: int,
    query: int,  # the query's index in the tree row (0 = the root)
) -> int:
    """Write the query's path (root to itself) right after the cached prefix and return its length.

    Its keys are then one contiguous slice, exactly as in a chain: no copy of the prefix (gathering
    prefix and path cost ~60 ms per 1.5B forward at a 1500-token context), and the same products
    as when the path is decoded token by token, so the result stays bit-identical."""
    node_keys, node_values, mask = tree_nodes
    path = mask[query, : node_keys.shape[1]].nonzero().flatten()
    m = int(path.numel())
    keys[:, start : start + m] = node_keys.index_select(1, path)
    values[:, start : start + m] = node_values.index_select(1, path)
    return m


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
    pos = torch.arange(start, total, device=query.device).unsqueeze(1)  # [n, 1] query positions
    key_pos = torch.arange(total, device=query.device).unsqueeze(0)  # [1, total]
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
