"""Weight quantization for the CPU fast path.

Why int8 dynamic quantization: on CPU with stock fp32 kernels a forward over 2-16 tokens costs 2x
a forward over one (the BLAS repacks each weight matrix for every small matrix product), so checking
k draft tokens is far from free and speculation loses. fbgemm's dynamically quantized Linear keeps
its int8 weights prepacked once at load and quantizes the few activation rows on the fly, so a
forward over 8 tokens costs about what a forward over one does, and reads a quarter of the bytes.
Measured on Qwen2.5-Coder-1.5B here (2 threads, 120-token cache, ms for 1/2/4/8/16 new tokens):
fp32 414/880/820/850/1016, int8 72/76/71/82/119 (NOTES.md).

Weights are quantized per output channel (symmetric), activations per call. Every Linear is
converted, the LM head included (13% of the 1.5B's weights); embeddings and norms stay in float.
The target and the draft go through the same path, so greedy speculative output still equals
greedy plain output of the quantized model; the quality cost against fp32 is measured separately
(`verispec bench quality`).
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import nn

from verispec.errors import VerispecError

Quantization = Literal["auto", "none", "int8"]
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8")


def resolve_quantization(quantization: Quantization, device: str, dtype: str) -> Literal["none", "int8"]:
    """``auto`` means int8 for float32 models on CPU (the fast path), none otherwise.

    On CUDA the float kernels are fast already; a bfloat16/float16 request says the user wants
    that dtype's arithmetic, so auto leaves it alone.
    """
    if quantization == "auto":
        return "int8" if device == "cpu" and dtype == "float32" else "none"
    if quantization == "int8" and (device != "cpu" or dtype != "float32"):
        raise VerispecError(
            "--quantization int8 needs --device cpu and --dtype float32 (fbgemm kernels quantize "
            "float32 activations); use --quantization none otherwise"
        )
    return quantization


def _cpu_has_vnni() -> bool:
    """VNNI multiplies u8 x s8 straight into int32; without it (plain AVX2) pairs of products are
    summed in int16 and can saturate unless activations keep to 7 bits."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


_REDUCE_RANGE = not _cpu_has_vnni()
"""7-bit activations where the CPU needs them; 8 bits (closer to float32) where VNNI allows."""


class RowwiseInt8Linear(nn.Module):
    """An int8 Linear whose result for one token does not depend on the other tokens in the call.

    fbgemm's dynamic quantization picks one activation scale for the whole input matrix, so a
    token's output changes with the tokens verified beside it, and greedy speculative output would
    drift from greedy plain output. Here each row is first scaled to max |x| = 1 and two constant
    columns (+1, -1, with zero weights) pin the tensor's range to [-1, 1]: the quantization scale and
    zero point are then the same for every call, the int8 products accumulate exactly in int32, and
    each row is rescaled by its own factor afterwards. The effect is per-token activation
    quantization (more accurate than per-tensor), batch-invariant to the bit.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = nn.functional.pad(linear.weight.detach().float(), (0, 2))  # [out, in + 2]: zero pin weights
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # symmetric, per output channel
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        qweight = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm layout, packed once
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32
        row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)  # [..., 1]
        ones = torch.ones_like(row_scale)
        pinned = torch.cat([x / row_scale, ones, -ones], dim=-1)  # [..., in + 2], range exactly [-1, 1]
        y = torch.ops.quantized.linear_dynamic(pinned, self._packed, _REDUCE_RANGE) * row_scale  # [..., out]
        return y if self.bias is None else y + self.bias


def quantize_int8_dynamic(model: nn.Module) -> nn.Module:
    """Make ``model`` batch-invariant int8: every ``nn.Linear`` becomes a :class:`RowwiseInt8Linear`
    and a transformers model's attention becomes :mod:`verispec.models.attention`'s."""
    if hasattr(model, "set_attn_implementation"):
        from verispec.models.attention import register

        model.set_attn_implementation(register())
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86"
    with warnings.catch_warnings():
        # torch.ao's eager quantization modules are deprecated in favour of torchao, whose CPU int8
        # path is not faster here; the API is stable in the pinned torch 2.13.
        warnings.simplefilter("ignore")
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, RowwiseInt8Linear(child))
    return model
