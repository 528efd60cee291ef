"""The building blocks of a drafter's incremental step (:meth:`~verispec.heads.eagle.EagleDrafter.step`
and :meth:`~verispec.heads.eagle3.Eagle3Drafter.step`): norms and the SiLU product through
``kernels/layer_ops.cpp`` where they build (``ops``; None keeps torch's operations), fused or separate
projections, attention of each sequence's rows over its own draft cache (row by row for catch-up
passes, where the row-wise kernel builds), and the attention-and-MLP tail both drafters' layers share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from verispec.models import native
from verispec.models.attention import NATIVE_SOURCE as ATTENTION_SOURCE
from verispec.models.fused import FusedLinear
from verispec.models.lean import NATIVE_SOURCE

if TYPE_CHECKING:
    from verispec.heads.eagle import DraftRows, RMSNorm


def attend_groups(qkv: torch.Tensor, groups: Sequence[DraftRows], config: Any, rowwise: bool) -> torch.Tensor:
    """Attention of each group over its cache, ``[N, heads * head_dim]``, from the rows' joint
    ``qkv [N, (heads + 2 kv) head_dim]`` (``config``: the drafter's, with ``num_attention_heads``,
    ``num_key_value_heads`` and ``head_dim``); each group's new keys and values are written to its
    cache first. The query heads that share a key/value head are stacked as extra query rows of that
    head, so one SDPA call per sequence reads the cache where it lies. With ``rowwise``, a catch-up
    group goes through verispec's row-wise kernel instead (each position over exactly its causal
    prefix), so its outputs do not depend on how the pairs were grouped into passes."""
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shared = heads // kv
    parts = qkv.view(qkv.shape[0], heads + 2 * kv, d)
    outs, row = [], 0
    for g in groups:
        n = g.count
        rows = parts[row : row + n]
        row += n
        new_keys, new_values = rows[:, heads : heads + kv], rows[:, heads + kv :]
        g.cache.write(g.slot, new_keys.transpose(0, 1), new_values.transpose(0, 1))
        if rowwise and g.catch_up:
            keys, values = g.cache.buffers()
            out = torch.ops.verispec_attention.rowwise_attention(
                rows[:, :heads].transpose(0, 1), keys, values, g.slot, 0, None, d**-0.5
            )  # [n, heads, d]
            outs.append(out.reshape(n, heads * d))
            continue
        keys, values = g.cache.visible(g.slot + n)
        query = rows[:, :heads].transpose(0, 1).reshape(kv, shared * n, d)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=g.mask.to(query.device).repeat(shared, 1)
        )
        outs.append(out.view(heads, n, d).transpose(0, 1).reshape(n, heads * d))
    if row != qkv.shape[0]:
        raise ValueError(f"draft rows cover {row} of {qkv.shape[0]} rows")
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attention_and_mlp(
    layer: nn.Module,
    residual: torch.Tensor,
    qkv: torch.Tensor,
    groups: Sequence[DraftRows],
    config: Any,
    rowwise: bool,
    ops: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a drafter's decoder layer once its rows' ``qkv`` are rotated (EAGLE's and
    EAGLE-3's layers alike): attention over each group's cache (:func:`attend_groups`), its output
    projection added to ``residual`` and normed, the SiLU-gated MLP on that. Returns the residual
    after attention and the MLP's output, for the caller's last add (and norm)."""
    attn, mlp = layer.self_attn, layer.mlp
    attended = attn.o_proj(attend_groups(qkv, groups, config, rowwise))
    x, h = add_norm(residual, attended, layer.post_attention_layernorm, ops)
    gate, up = joint(mlp, ("gate_proj", "up_proj"), "gate_up_proj", h).chunk(2, dim=-1)
    product = ops.silu_mul(gate, up) if ops is not None else F.silu(gate) * up
    return x, mlp.down_proj(product)


def native_ready(x: torch.Tensor) -> bool:
    """Whether :meth:`EagleDrafter.step` can run the C++ layer operations (float32 on CPU, built)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return False
    return native.ready(NATIVE_SOURCE, "EAGLE drafting keeps torch's operations")


def rowwise_ready() -> bool:
    """Whether catch-up passes can attend through verispec's row-wise kernel (built)."""
    return native.ready(ATTENTION_SOURCE, "EAGLE catch-up passes attend with SDPA")


def apply_norm(norm: RMSNorm, x: torch.Tensor, ops: Any) -> torch.Tensor:
    return ops.rms_norm(x.contiguous(), norm.weight, norm.eps) if ops is not None else norm(x)


def add_norm(
    x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm, ops: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))``, one C++ call when ``ops`` are there."""
    if ops is not None:
        return ops.add_rms_norm(x.contiguous(), delta.contiguous(), norm.weight, norm.eps)
    total = x + delta
    return total, norm(total)


def joint(module: nn.Module, names: tuple[str, ...], fused_name: str, x: torch.Tensor) -> torch.Tensor:
    """The outputs of ``module``'s Linears ``names`` side by side: one product where quantization
    fused them (:mod:`verispec.models.fused`), else one call each."""
    fused = getattr(module, fused_name, None)
    if isinstance(fused, FusedLinear):
        return fused.linear(x)
    return torch.cat([getattr(module, name)(x) for name in names], dim=-1)
