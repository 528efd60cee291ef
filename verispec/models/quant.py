"""Weight quantization for the CPU fast path.

Why int8 dynamic quantization: on CPU with stock fp32 kernels a forward over 2-16 tokens costs 2x
a forward over one (the BLAS repacks each weight matrix for every small matrix product), so checking
k draft tokens is far from free and speculation loses. fbgemm's dynamically quantized Linear keeps
its int8 weights prepacked once at load and quantizes the few activation rows on the fly, so a
forward over 8 tokens costs about what a forward over one does, and reads a quarter of the bytes.
Measured on Qwen2.5-Coder-1.5B here (2 threads, 120-token cache, ms for 1/2/4/8/16 new tokens):
fp32 414/880/820/850/1016, int8 72/76/71/82/119.

Weights are quantized per output channel (symmetric), activations per call. Every Linear is
converted, the LM head included (13% of the 1.5B's weights); embeddings and norms stay in float.
The target and the draft go through the same path, so greedy speculative output still equals
greedy plain output of the quantized model; the quality cost against fp32 is measured separately
(`verispec bench quality`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from verispec.config import Quantization
from verispec.errors import VerispecError


def resolve_quantization(
    quantization: Quantization, device: str, dtype: str
) -> Literal["none", "int8", "int4", "gguf"]:
    """``auto`` means int8 for float32 models on CPU (the fast path), none otherwise. (For a GGUF
    source ``auto`` is decided before this: :func:`verispec.models.native_gguf_by_default`.)

    On CUDA the float kernels are fast already; a bfloat16/float16 request says the user wants
    that dtype's arithmetic, so auto leaves it alone.
    """
    if quantization == "auto":
        return "int8" if device == "cpu" and dtype == "float32" else "none"
    if quantization in ("int8", "int4", "gguf") and (device != "cpu" or dtype != "float32"):
        raise VerispecError(
            f"--quantization {quantization} needs --device cpu and --dtype float32 (its CPU kernels "
            "quantize float32 activations); use --quantization none otherwise"
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

    On CPUs with AMX-INT8 the layer runs verispec's tile kernel instead (``int8_linear_amx``, the
    same per-row symmetric 8-bit activations, exact int32 sums): on the 1.5B's LM head fbgemm takes
    8.5 ms for 1 row and 13.9 for 8, the tiles 8.5 and 8.1 (13.3 for 32), which is what makes
    verifying drafts cheap there.
    """

    def __init__(
        self,
        int8_weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        amx: bool | None = None,
    ) -> None:
        """int8_weight: [out, in + 2] int8 (the last two columns zero); scales: [out] float32.
        ``amx``: run verispec's AMX kernel instead of fbgemm (None: where it is available, see
        :func:`verispec.models.int4.uses_amx`); it quantizes each row symmetrically to 8 bits as
        the pinned range does here, and a verified row costs next to nothing there."""
        super().__init__()
        from verispec.models import int4

        self.out_features, padded_in = int8_weight.shape
        self.in_features = padded_in - 2
        self.amx = int4.uses_amx() if amx is None else amx
        if self.amx:
            if not int4.amx_available():
                raise VerispecError("the int8 AMX kernel is not available on this CPU or in this process")
            self._amx_weight, self._amx_scales = _to_amx_int8(int8_weight[:, : self.in_features], scales)
        else:
            zero_points = torch.zeros(self.out_features, dtype=torch.long)
            qweight = torch._make_per_channel_quantized_tensor(int8_weight, scales.double(), zero_points, 0)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm layout, packed once
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)

    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weight [out, in + 2] (the last two columns zero) and float32 scales [out]."""
        if self.amx:
            n, k = self.out_features, self.in_features
            tiles = self._amx_weight.shape[0]
            w = self._amx_weight.view(tiles, -1, 16, _AMX_COLS, 4).permute(0, 3, 1, 2, 4)
            w = w.reshape(tiles * _AMX_COLS, -1)[:n, :k]
            return nn.functional.pad(w, (0, 2)).contiguous(), self._amx_scales[:n].clone()
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float()

    @staticmethod
    def quantize_weight(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-output-channel int8 of ``linear``'s weight, padded with the two zero columns."""
        weight = nn.functional.pad(linear.weight.detach().float(), (0, 2))  # [out, in + 2]
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        int8 = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8).int_repr()
        return int8, scales

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> RowwiseInt8Linear:
        return cls(*cls.quantize_weight(linear), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32
        if self.amx:
            return torch.ops.verispec.int8_linear_amx(
                x, self._amx_weight, self._amx_scales, self.bias, self.out_features
            )
        row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)  # [..., 1]
        ones = torch.ones_like(row_scale)
        pinned = torch.cat([x / row_scale, ones, -ones], dim=-1)  # [..., in + 2], range exactly [-1, 1]
        y = torch.ops.quantized.linear_dynamic(pinned, self._packed, _REDUCE_RANGE) * row_scale  # [..., out]
        return y if self.bias is None else y + self.bias


_AMX_COLS = 16
"""Output channels per tile of the AMX int8 layout."""


def _to_amx_int8(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and scales [N] -> the AMX kernel's weight [N/16, Kp*16] (per tile of 16 channels:
    [64-input chunk][quad][channel][4 inputs], zero padded) and float32 scales [N padded to 16]."""
    n, k = weight.shape
    pad_n, pad_k = -n % _AMX_COLS, -k % 64
    w = nn.functional.pad(weight, (0, pad_k, 0, pad_n))
    tiles = (n + pad_n) // _AMX_COLS
    w = w.view(tiles, _AMX_COLS, -1, 16, 4).permute(0, 2, 3, 1, 4)  # [tile, chunk, quad, channel, 4]
    return w.reshape(tiles, -1).contiguous(), nn.functional.pad(scales.float(), (0, pad_n)).contiguous()


def lm_head_kind(model: Any) -> str:
    """``gguf``, ``int4``, ``int8`` or ``float``: the kind of ``model``'s LM head (on the int4 path it
    depends on the CPU, :func:`verispec.models.int4.int4_lm_head`); its argmax and its rows' cost
    follow it."""
    from verispec.models.gguf_linear import GGUFLinear
    from verispec.models.int4 import Int4Linear

    head = getattr(model, "lm_head", None)
    if isinstance(head, GGUFLinear):
        return "gguf"
    return (
        "int4" if isinstance(head, Int4Linear) else "int8" if isinstance(head, RowwiseInt8Linear) else "float"
    )


def quantize_int8_dynamic(model: nn.Module, cache_file: Path | None = None) -> nn.Module:
    """Make ``model`` batch-invariant int8: every ``nn.Linear`` becomes a :class:`RowwiseInt8Linear`
    and a transformers model's attention becomes :mod:`verispec.models.attention`'s.

    With ``cache_file``, the int8 weights are read from it when it exists (the float32 weights of
    the Linears, memory-mapped by transformers, are then never read: a faster start and a lower
    peak memory) and written to it otherwise.
    """
    return quantize_model(model, "int8", cache_file)


def quantize_model(
    model: nn.Module, scheme: Literal["int8", "int4"], cache_file: Path | None = None
) -> nn.Module:
    """Convert every ``nn.Linear`` of ``model`` to ``scheme`` (int4's LM head is int4 or int8 by
    the CPU, :func:`verispec.models.int4.int4_lm_head`) and use the batch-invariant attention; cache
    as :func:`quantize_int8_dynamic` says (a cache written without some of the layers needed now,
    such as the other kind of LM head, is rewritten with them added). Loaders then fuse the
    Linears that read the same input into one product (:func:`verispec.models.fused.fuse_projections`:
    bit-identical results, fewer calls)."""
    from safetensors.torch import load_file, save_file

    from verispec.models.int4 import int4_lm_head

    if hasattr(model, "set_attn_implementation"):
        from verispec.models.attention import register

        model.set_attn_implementation(register())
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    int4_head = scheme == "int4" and int4_lm_head()
    cached = load_file(cache_file) if cache_file is not None and cache_file.is_file() else {}
    fresh: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torch.ao's quantized ops are deprecated in favour of torchao, whose CPU int8 path is not
        # faster here; the ops are stable in the pinned torch 2.13.
        warnings.simplefilter("ignore")
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                key = f"{parent_name}.{name}" if parent_name else name
                if scheme == "int4" and (child is not head or int4_head):
                    setattr(parent, name, _int4_linear(child, key, cached, fresh))
                    continue
                if f"{key}.int8" in cached:
                    int8, scales = cached[f"{key}.int8"], cached[f"{key}.scales"]
                else:
                    int8, scales = RowwiseInt8Linear.quantize_weight(child)
                    fresh[f"{key}.int8"], fresh[f"{key}.scales"] = int8, scales
                setattr(parent, name, RowwiseInt8Linear(int8, scales, child.bias))
    if cache_file is not None and fresh:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        save_file({**cached, **fresh}, str(tmp))
        tmp.replace(cache_file)
    return model


def _int4_linear(
    child: nn.Linear, key: str, cached: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]
) -> nn.Module:
    from verispec.models.int4 import Int4Linear, quantize_weight

    names = (f"{key}.int4", f"{key}.int4_scales", f"{key}.int4_offsets")
    if names[0] in cached:
        parts = tuple(cached[n] for n in names)
    else:
        parts = quantize_weight(child.weight)
        fresh.update(zip(names, parts, strict=True))
    return Int4Linear(*parts, child.bias, (child.out_features, child.in_features))
