"""A lean forward over a Llama-family decoder stack: the same arithmetic, less Python per layer.

On the CPU fast path a decode step's own work is small (the 1.5B's Linears take ~40 ms on int4 at
one token), so the Python around it shows: transformers' decoder stack (module calls and hooks,
keyword plumbing, the fused projections' part dispatch, rotary embeddings applied to q and k
apart) cost ~23-29 ms of a 58-72 ms 1.5B int4 step on a 2-core AVX2 machine, measured with the
Linears stubbed out. This module runs the same layers with the same torch
operations in the same order on the same tensors, so every output is bit-identical to
transformers' forward (the tests check it), and skips only the plumbing:

- modules' ``__call__`` (hooks, tracing checks) and transformers' keyword and output wrappers;
- the fused q/k/v and gate/up products are called once and split, not asked for part by part;
- q and k are rotated in one pass: they are adjacent in the fused output, and the rotation is
  element by element, so one pass over both gives the bits of two.

Only decoder stacks whose layers are known to compute exactly this are taken (:func:`supports`);
anything else (other families, quirks such as q/k norms or scaled embeddings) keeps transformers'
forward.

In float32 on CPU the layers' small operations (RMSNorm with the residual add before it, the rotary
embedding, the SiLU-gated product) run as one C++ call each (``kernels/layer_ops.cpp``): ~25 torch
operations per layer become 4. Those round RMSNorm's sum and SiLU's exp differently from torch, so
that path matches transformers within rounding, not to the bit; it is row by row and so still
batch-invariant, and a model uses one path for every forward (its ``native_layers``, handed to
:func:`forward` as ``native``: the model's choice, not the process's, so a test can run the
reference path beside the fast one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from verispec.models import native
from verispec.models.attention import rowwise_attention
from verispec.models.fused import FusedLinear
from verispec.models.kv import RowBatch

NATIVE_SOURCE = "layer_ops.cpp"

_LAYERS = {
    "Qwen2Model": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "LlamaModel": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "MistralModel": ("MistralDecoderLayer", "MistralAttention", "MistralMLP", "MistralRMSNorm"),
}
"""Decoder stacks whose layers compute pre-norm attention and a SiLU-gated MLP exactly as
:func:`_layer` does (transformers 5.x), by the class names of the stack and its parts."""
_WINDOWS: dict[str, Callable[[nn.Module], int | None]] = {
    "Qwen2Model": lambda attn: attn.sliding_window,  # per layer type
    "LlamaModel": lambda attn: None,
    "MistralModel": lambda attn: getattr(attn.config, "sliding_window", None),
}
"""Each family's attention window as its attention module hands it to the attention function."""


def supports(decoder: nn.Module) -> bool:
    """Whether :func:`forward` computes exactly what ``decoder``'s own forward does."""
    names = _LAYERS.get(type(decoder).__name__)
    cfg = getattr(decoder, "config", None)
    if names is None or cfg is None or getattr(cfg, "hidden_act", None) != "silu":
        return False
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) != cfg.num_hidden_layers:
        return False
    for layer in layers:
        parts = (layer, layer.self_attn, layer.mlp, layer.input_layernorm)
        if tuple(type(p).__name__ for p in parts) != names:
            return False
        if type(layer.post_attention_layernorm) is not type(layer.input_layernorm):
            return False
    return type(decoder.norm).__name__ == names[3]


def forward(
    decoder: nn.Module,
    input_ids: torch.Tensor,  # [B, S]
    position_ids: torch.Tensor,  # [B, S]
    rows: RowBatch,
    taps: Sequence[int] = (),
    *,
    native: bool = True,
    raw_taps: bool = False,
) -> torch.Tensor:
    """The decoder's last hidden state after its final norm, [B, S, H], as its own forward gives.

    ``taps``: decoder layer indices whose *normed input* (what the layer's attention reads, after
    its ``input_layernorm``) is appended, giving ``[B, S, (1 + len(taps)) H]``: EAGLE-3's low and
    middle layer features, taken where the forward computes them anyway. ``raw_taps``: the layers'
    inputs before that norm instead (the residual stream, as transformers' ``output_hidden_states``
    gives it): what the ecosystem's EAGLE-3 drafters (:mod:`verispec.heads.eagle3`) read.

    ``native``: run the layers' small operations through ``kernels/layer_ops.cpp`` where it builds
    (float32 on CPU); False keeps the torch operations, transformers' bits (the reference the tests
    compare to)."""
    hidden = decoder.embed_tokens.forward(input_ids)
    cos, sin = decoder.rotary_emb.forward(hidden, position_ids)  # [B, S, D]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # over heads, for [B, S, heads, D]
    window = _WINDOWS[type(decoder).__name__]
    if native and _native_ready(hidden):
        return _native_forward(decoder, hidden, cos, sin, rows, window, taps, raw_taps)
    tapped: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(decoder.layers):
        if i in taps:
            tapped[i] = hidden if raw_taps else _rms_norm(layer.input_layernorm, hidden)
        hidden = _layer(layer, hidden, cos, sin, rows, window(layer.self_attn))
    return with_taps(_rms_norm(decoder.norm, hidden), tapped, taps)


def with_taps(last: torch.Tensor, tapped: dict[int, torch.Tensor], taps: Sequence[int]) -> torch.Tensor:
    """``last`` with the tapped layers' features after it, in ``taps`` order (the forwards' output)."""
    return torch.cat([last, *(tapped[i] for i in taps)], dim=-1) if taps else last


def _native_ready(hidden: torch.Tensor) -> bool:
    """Whether this forward can run the C++ layer operations (float32 on CPU, where they build)."""
    if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
        return False
    return native.ready(NATIVE_SOURCE, "the lean forward keeps torch's operations")


def _native_forward(
    decoder: nn.Module,
    hidden: torch.Tensor,  # [B, S, H], the embeddings
    cos: torch.Tensor,  # [B, S, 1, D]
    sin: torch.Tensor,
    rows: RowBatch,
    window: Callable[[nn.Module], int | None],
    taps: Sequence[int] = (),
    raw_taps: bool = False,
) -> torch.Tensor:
    """:func:`forward`'s layers with the C++ operations; each residual add is fused into the norm
    after it (the next layer's input norm, or the final norm), whose output is a tap's feature."""
    ops = torch.ops.verispec_layer
    layers = decoder.layers
    batch, width, _ = hidden.shape
    cos, sin = cos.reshape(batch * width, -1), sin.reshape(batch * width, -1)
    first = layers[0].input_layernorm
    x = ops.rms_norm(hidden, first.weight, first.variance_epsilon)
    tapped: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if i in taps:
            tapped[i] = hidden.clone() if raw_taps else x
        attn, mlp = layer.self_attn, layer.mlp
        delta = _native_attention(attn, x, cos, sin, rows, window(attn))
        norm = layer.post_attention_layernorm
        hidden, x = ops.add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)
        fused = getattr(mlp, "gate_up_proj", None)
        if isinstance(fused, FusedLinear):
            gate_up = fused.linear.forward(x).view(batch * width, -1)
            gate, up = gate_up.split(fused.sizes, dim=-1)
        else:
            gate = mlp.gate_proj.forward(x).view(batch * width, -1)
            up = mlp.up_proj.forward(x).view(batch * width, -1)
        delta = mlp.down_proj.forward(ops.silu_mul(gate, up).view(batch, width, -1))
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else decoder.norm
        hidden, x = ops.add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)
    return with_taps(x, tapped, taps)


def _native_attention(
    attn: nn.Module,
    x: torch.Tensor,  # [B, S, H], normed
    cos: torch.Tensor,  # [B * S, D]
    sin: torch.Tensor,
    rows: RowBatch,
    window: int | None,
) -> torch.Tensor:
    """The attention block's output projection, [B, S, H]: q/k/v, rotary in place, attention."""
    batch, width, _ = x.shape
    dim = attn.head_dim
    heads = attn.config.num_attention_heads
    kv_heads = attn.config.num_key_value_heads
    fused = getattr(attn, "qkv_proj", None)
    if isinstance(fused, FusedLinear):
        qkv = fused.linear.forward(x).reshape(batch * width, -1)
    else:
        qkv = torch.cat((attn.q_proj.forward(x), attn.k_proj.forward(x), attn.v_proj.forward(x)), dim=-1)
        qkv = qkv.reshape(batch * width, -1)
    torch.ops.verispec_layer.rotary_(qkv, cos, sin, heads + kv_heads)
    qkv = qkv.view(batch, width, heads + 2 * kv_heads, dim)
    query, key, value = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads], qkv[:, :, heads + kv_heads :]
    return attn.o_proj.forward(_attend(attn, query, key, value, rows, window))


def _layer(
    layer: nn.Module,
    hidden: torch.Tensor,  # [B, S, H]
    cos: torch.Tensor,  # [B, S, 1, D]
    sin: torch.Tensor,
    rows: RowBatch,
    window: int | None,
) -> torch.Tensor:
    attn = layer.self_attn
    batch, width, _ = hidden.shape
    dim = attn.head_dim
    heads = attn.config.num_attention_heads
    kv_heads = attn.config.num_key_value_heads
    x = _rms_norm(layer.input_layernorm, hidden)
    fused = getattr(attn, "qkv_proj", None)
    if isinstance(fused, FusedLinear):  # q and k are adjacent in each row of the one product
        qkv = fused.linear.forward(x)
        n_qk = fused.sizes[0] + fused.sizes[1]
        qk, v = qkv[..., :n_qk], qkv[..., n_qk:]
    else:
        qk = torch.cat((attn.q_proj.forward(x), attn.k_proj.forward(x)), dim=-1)
        v = attn.v_proj.forward(x)
    qk = qk.view(batch, width, heads + kv_heads, dim)
    qk = (qk * cos) + (_rotate_half(qk) * sin)  # transformers' apply_rotary_pos_emb, element by element
    query, key = qk[:, :, :heads], qk[:, :, heads:]
    value = v.view(batch, width, kv_heads, dim)
    hidden = hidden + attn.o_proj.forward(_attend(attn, query, key, value, rows, window))
    mlp = layer.mlp
    x = _rms_norm(layer.post_attention_layernorm, hidden)
    fused = getattr(mlp, "gate_up_proj", None)
    if isinstance(fused, FusedLinear):
        gate, up = fused.linear.forward(x).split(fused.sizes, dim=-1)
    else:
        gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
    return hidden + mlp.down_proj.forward(nn.functional.silu(gate) * up)


def _attend(
    attn: nn.Module,
    query: torch.Tensor,  # [B, S, heads, D]
    key: torch.Tensor,  # [B, S, kv_heads, D]
    value: torch.Tensor,
    rows: RowBatch,
    window: int | None,
) -> torch.Tensor:
    """Store the new keys and values, attend, and return the heads side by side, [B, S, heads * D]
    (in transformers' layout [B, heads, S, D] for the cache hook and the attention)."""
    batch, width = query.shape[:2]
    key_t, value_t = rows.update(key.transpose(1, 2), value.transpose(1, 2), attn.layer_idx)
    out, _ = rowwise_attention(
        attn,
        query.transpose(1, 2),
        key_t,
        value_t,
        None,
        scaling=attn.scaling,
        sliding_window=window,
        verispec_rows=rows,
    )
    return out.reshape(batch, width, -1).contiguous()


def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm, operation for operation."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
