"""A Linear that runs a GGUF file's quantized blocks as they are: llama.cpp's weights, to the bit.

Why: converting a GGUF to float32 and re-quantizing it costs 4 bytes a parameter of disk and memory
on the way, minutes of start-up, and a second rounding of weights that were already rounded (the
re-quantized 4-bit path agreed with llama.cpp's top token 98.1% of the time on the 1.5B, against
the file's own blocks). Here every weight stays exactly what ``gguf``'s de-quantization says it is:
``w = S_g * c + O_g`` for an unsigned code ``c`` and a scale and offset per channel and group, which
each block type factors into exactly (:func:`unpack_blocks`; tested against ``gguf.quants`` per
type). :func:`pack` lays codes and scales out for verispec's kernel (``kernels/gguf_linear.cpp``,
compiled on first use like the int4 kernel); the kernel's own packer (:func:`pack_blocks`) writes
the same layout straight from the blocks, ~20x sooner, and :func:`pack` stays its readable reference.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (groups of 32 with float16 scale and offset) and Q4_K, Q5_K,
Q6_K (float16 super-block scales times int8 group scales), and Q3_K the same way with its 3-bit
codes in nibbles (w = d (s - 32) (c - 4) is (D sc) c - M mn with D = d, M = 4 d, sc = mn = s - 32,
all exact: ~4.6 bits a weight against the file's 3.4, so a decode step reads more than llama.cpp's).
Any other type is refused by name, never re-rounded into one of these.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K
from torch import nn

from verispec.errors import VerispecError
from verispec.models import native

TILE = 16
"""Output channels per tile of the kernel's layout (one per 32-bit lane of a 512-bit vector)."""
_PACK_ROWS = 256 * TILE
"""Output channels the numpy reference packs at a time (whole tiles, so the pieces concatenate)."""
_SOURCE = "gguf_linear.cpp"

# Kernel formats (kernels/gguf_linear.cpp's enum): group size, unit of activation scales, bit planes
# above the low nibble, whole-byte codes, "k" (super-block) scales.
_FORMATS = {
    "leg4": (0, 32, 32, 0, False, False),
    "leg5": (1, 32, 32, 1, False, False),
    "leg8": (2, 32, 32, 0, True, False),
    "k4": (3, 32, 256, 0, False, True),
    "k5": (4, 32, 256, 1, False, True),
    "k6": (5, 16, 256, 2, False, True),
    "k3": (6, 16, 256, 0, False, True),
}
_FORMAT_OF = {
    Q.Q4_0: "leg4",
    Q.Q4_1: "leg4",
    Q.Q5_0: "leg5",
    Q.Q5_1: "leg5",
    Q.Q8_0: "leg8",
    Q.Q4_K: "k4",
    Q.Q5_K: "k5",
    Q.Q6_K: "k6",
    Q.Q3_K: "k3",
}
_CODE_BIAS = {"k6": 32, "k3": 4}
"""Symmetric "k" formats (mn = sc): w = D sc (c - bias). Their AVX-512 tiles multiply the signed
``c - bias`` by the activations plus 128 and start each super-block's sums at ``kcorr``, -128 sum_g
sc_g sum_{i in g} (c_i - bias), instead of adding an offset term per row (the kernel's header)."""
_PARTS = ("codes", "fscales", "iscales", "kcorr")
"""The kernel's arrays of one weight, in the order its packer returns them."""
KERNEL_TYPES = frozenset(_FORMAT_OF)
"""The block types a :class:`GGUFLinear` runs natively."""


def check_type(qtype: Q, name: str) -> None:
    """Raise a VerispecError naming ``qtype`` and the tensor when no kernel runs it."""
    if qtype not in KERNEL_TYPES:
        names = ", ".join(sorted(t.name for t in KERNEL_TYPES))
        raise VerispecError(
            f"{name} is stored as {qtype.name}, which verispec cannot run natively (it runs {names}); "
            "re-quantize the file to one of those with llama.cpp's llama-quantize"
        )


def kernel_error() -> str | None:
    """Why the kernel cannot run here (no compiler, a failed build), or None when it can."""
    return native.load(_SOURCE)


@functools.cache
def vectorized() -> bool:
    """Whether the kernel runs its AVX-512 VNNI build here (else a correct but slow scalar one)."""
    return kernel_error() is None and bool(torch.ops.verispec_gguf.gguf_linear_vectorized())


def kernel_key() -> str:
    """Names this build of the kernel (part of measured step costs' key)."""
    return native.build_key(_SOURCE)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields [n, 2] (uint8) -> float32 [n, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """[n, bytes] packed nibbles -> [n, 2 * bytes] codes: per chunk of ``chunk`` bytes, the low
    nibbles then the high ones (the order of every GGUF 4-bit type)."""
    n = qs.shape[0]
    parts = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (parts & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """A 32-bit field of Q5_0/Q5_1 [n, 4] -> bit i of it for i < count, [n, count] uint8."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(count, dtype=np.uint32).reshape(1, count)
    return (bits & np.uint32(1)).astype(np.uint8)


def unpack_blocks(qtype: Q, blocks: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One tensor's blocks [rows, row_bytes] -> codes [rows, K] (uint8) and the factors of its
    weights: legacy types ``S``, ``O`` [rows, K / 32] (float32 values exact in float16) with
    w = S * c + O; "k" types ``D``, ``M`` [rows, K / 256] (float32) and ``sc``, ``mn`` [rows, groups]
    (int8) with w = (D * sc) * c - M * mn. Exact: the same products gguf de-quantizes with."""
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, _block_bytes(qtype))
    n = b.shape[0]
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        d = _f16(b[:, 0:2])
        has_min = qtype in (Q.Q4_1, Q.Q5_1)
        at = 4 if has_min else 2
        m = _f16(b[:, 2:4]) if has_min else None
        high = None
        if qtype in (Q.Q5_0, Q.Q5_1):
            high, at = _high_bits(b[:, at : at + 4], 32), at + 4
        codes = _nibbles(b[:, at : at + 16], 16)
        if high is not None:
            codes = codes | (high << np.uint8(4))
        centre = {Q.Q4_0: 8.0, Q.Q5_0: 16.0}.get(qtype, 0.0)
        offset = m if m is not None else -centre * d
        return codes.reshape(rows, -1), {"S": d.reshape(rows, -1), "O": offset.reshape(rows, -1)}
    if qtype == Q.Q8_0:
        d = _f16(b[:, 0:2])
        codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes.reshape(rows, -1), {"S": d.reshape(rows, -1), "O": (-128.0 * d).reshape(rows, -1)}
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        if qtype == Q.Q4_K:
            codes = _nibbles(b[:, 16:144], 32)
        else:
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = _nibbles(b[:, 48:176], 32) | (((qh & np.uint8(1)).reshape(n, -1)) << np.uint8(4))
        factors = {"D": d, "M": dmin, "sc": sc.astype(np.int8), "mn": mn.astype(np.int8)}
        return codes.reshape(rows, -1), {k: v.reshape(rows, -1) for k, v in factors.items()}
    if qtype == Q.Q3_K:
        hmask, qs, scales, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
        low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        high = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        codes = low.reshape(n, -1) | (high.reshape(n, -1) << np.uint8(2))  # q + 4: 0..7
        nib = scales[:, 0:8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        top = scales[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
        s = ((nib.reshape(n, 16) & 0x0F) | ((top.reshape(n, 16) & 3) << 4)).astype(np.int8) - np.int8(32)
        # w = d s (c - 4) = (D * sc) * c - M * mn with D = d, M = 4 d, sc = mn = s (all exact).
        factors = {"D": d, "M": 4.0 * d, "sc": s, "mn": s}
        return _by_row(rows, codes, factors)
    if qtype == Q.Q6_K:
        ql, qh, scales, d = b[:, 0:128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        low = _nibbles(ql, 64)
        high = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        codes = low | ((high & np.uint8(3)).reshape(n, -1) << np.uint8(4))
        sc = scales.view(np.int8)
        # w = d * sc * (c - 32) = (D * sc) * c - M * mn with D = d, M = 32 d, mn = sc (all exact).
        factors = {"D": d, "M": 32.0 * d, "sc": sc, "mn": sc}
        return _by_row(rows, codes, factors)
    check_type(qtype, "tensor")
    raise AssertionError("unreachable")


def _by_row(
    rows: int, codes: np.ndarray, factors: dict[str, np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per-block codes and factors -> per row ([rows, ...], contiguous)."""
    return codes.reshape(rows, -1), {k: np.ascontiguousarray(v).reshape(rows, -1) for k, v in factors.items()}


def _block_bytes(qtype: Q) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][1]


def dequantize_factors(qtype: Q, codes: np.ndarray, factors: dict[str, np.ndarray]) -> np.ndarray:
    """float32 weights [rows, K] from :func:`unpack_blocks`'s parts, in gguf's order of operations."""
    rows, k = codes.shape
    if "S" in factors:
        c = codes.reshape(rows, -1, 32).astype(np.float32)
        return (factors["S"][..., None] * c + factors["O"][..., None]).reshape(rows, k)
    group = _FORMATS[_FORMAT_OF[qtype]][1]
    c = codes.reshape(rows, k // 256, 256 // group, group).astype(np.float32)
    scale = factors["D"][..., None] * factors["sc"].reshape(rows, k // 256, -1).astype(np.float32)
    offset = factors["M"][..., None] * factors["mn"].reshape(rows, k // 256, -1).astype(np.float32)
    return (scale[..., None] * c - offset[..., None]).reshape(rows, k)


def pack(qtype: Q, codes: np.ndarray, factors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """:func:`unpack_blocks`'s parts -> the kernel's arrays (``codes``, with the high bits of 5- and
    6-bit codes after each group's nibbles, ``fscales``, ``iscales``, and ``kcorr`` for Q6_K and
    Q3_K), output channels padded with zero channels to whole tiles of :data:`TILE`; the layout is
    described in ``kernels/gguf_linear.cpp``."""
    _, group, unit, planes, whole_bytes, kq = _FORMATS[_FORMAT_OF[qtype]]
    rows, k = codes.shape
    tiles = -(-rows // TILE)
    pad = tiles * TILE - rows
    c = torch.from_numpy(np.ascontiguousarray(codes))
    c = nn.functional.pad(c, (0, 0, 0, pad)).view(tiles, TILE, k // group, group)
    if whole_bytes:  # byte 4c + j of vector v: channel c's input 4v + j
        packed = c.view(tiles, TILE, k // group, group // 4, 4).permute(0, 2, 3, 1, 4)
    else:  # byte 4c + j of vector t: input 8t + j (low nibble), 8t + 4 + j (high)
        low = (c & 0x0F).view(tiles, TILE, k // group, group // 8, 2, 4)
        packed = (low[..., 0, :] | (low[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    packed = packed.reshape(tiles, k // group, -1)
    if planes:  # after a group's nibbles, byte 4c + j: the high bits of input 4v + j at bits planes * v
        h = (c >> 4).to(torch.int32).view(tiles, TILE, k // group, group // 4, 4)
        shifts = (planes * torch.arange(group // 4, dtype=torch.int32)).view(1, 1, 1, -1, 1)
        high_bits = (h << shifts).sum(3).to(torch.uint8).permute(0, 2, 1, 3).reshape(tiles, k // group, -1)
        packed = torch.cat([packed, high_bits], dim=2)

    def per_tile(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:  # [rows, n] -> [tiles, n, 16]
        v = nn.functional.pad(torch.from_numpy(np.ascontiguousarray(values)), (0, 0, 0, pad))
        return v.view(tiles, TILE, -1).permute(0, 2, 1).to(dtype)

    if kq:  # D and M: the file's float16 values (Q6_K's M = 32 d, Q3_K's 4 d), kept in float16
        exact = torch.stack([per_tile(factors["D"], torch.float32), per_tile(factors["M"], torch.float32)], 2)
        fscales = exact.half()
        if not torch.equal(fscales.float(), exact):
            raise VerispecError(f"a {qtype.name} tensor's super-block scales do not fit float16 exactly")
        ints = [factors["sc"]] if group == 16 else [factors["sc"], factors["mn"]]  # Q6_K, Q3_K: mn = sc
        iscales = torch.stack([per_tile(v, torch.int8) for v in ints], 2)
    else:
        s, o = per_tile(factors["S"], torch.float16), per_tile(factors["O"], torch.float16)
        if not (
            torch.equal(s.float(), per_tile(factors["S"], torch.float32))
            and torch.equal(o.float(), per_tile(factors["O"], torch.float32))
        ):
            raise VerispecError(f"a {qtype.name} tensor's scales do not fit float16 exactly")
        fscales, iscales = torch.stack([s, o], 2), torch.empty(0, dtype=torch.int8)
    kcorr = torch.empty(0, dtype=torch.int32)
    bias = _CODE_BIAS.get(_FORMAT_OF[qtype])
    if bias is not None:
        sums = (codes.astype(np.int64) - bias).reshape(rows, k // group, group).sum(-1)  # [rows, groups]
        per_unit = (factors["sc"].astype(np.int64) * sums).reshape(rows, k // unit, -1).sum(-1)
        kcorr = per_tile(-128 * per_unit, torch.int32).reshape(tiles, -1).contiguous()
    return {
        "codes": packed.reshape(tiles, -1).contiguous(),
        "fscales": fscales.reshape(tiles, -1).contiguous(),
        "iscales": iscales.reshape(tiles, -1).contiguous() if kq else iscales,
        "kcorr": kcorr,
    }


def pack_blocks(
    qtype: Q, blocks: np.ndarray | Sequence[np.ndarray], in_features: int, order: np.ndarray | None = None
) -> dict[str, torch.Tensor]:
    """A tensor's blocks [rows, row_bytes] -> the kernel's arrays, by the kernel's own packer: the
    layout of :func:`pack` over :func:`unpack_blocks`, byte for byte (tested per type), in a single
    pass over the blocks (the 1.5B's LM head: ~0.25 s against ~5 s for the numpy reference).

    ``blocks`` may be several tensors' blocks (q, k and v), packed as their rows one after another
    (``order``: which of those rows each output channel is) with no copy of them on the way."""
    why = kernel_error()
    if why is not None:
        raise VerispecError(f"GGUF weights cannot run natively here: {why}")
    members = [blocks] if isinstance(blocks, np.ndarray) else list(blocks)
    data = [torch.from_numpy(np.ascontiguousarray(m, dtype=np.uint8)) for m in members]
    rows = None if order is None else torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
    try:
        packed = torch.ops.verispec_gguf.gguf_pack(data, int(qtype), in_features, rows)
    except RuntimeError as exc:
        if "float16 does not hold" in str(exc):
            raise VerispecError(f"a {qtype.name} tensor's scales do not fit float16 exactly") from None
        raise
    return dict(zip(_PARTS, packed, strict=True))


def pack_reference(qtype: Q, blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """:func:`pack` over :func:`unpack_blocks`, a slice of rows at a time (the codes are unpacked
    to a byte each, and wider on the way: a whole 128k-row LM head would be gigabytes of
    temporaries): the readable statement of the layout that :func:`pack_blocks` must equal."""
    chunks = [
        pack(qtype, *unpack_blocks(qtype, blocks[i : i + _PACK_ROWS]))
        for i in range(0, len(blocks), _PACK_ROWS)
    ]
    return {
        name: torch.cat([c[name] for c in chunks]) if len(chunks) > 1 else chunks[0][name]
        for name in chunks[0]
    }


def unpack(qtype: Q, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The float32 weights [out, in] that the kernel multiplies by, read back from its arrays."""
    _, group, _, planes, whole_bytes, kq = _FORMATS[_FORMAT_OF[qtype]]
    rows, k = shape
    tiles = parts["codes"].shape[0]
    if whole_bytes:
        c = parts["codes"].view(tiles, k // group, group // 4, TILE, 4).permute(0, 3, 1, 2, 4)
        c = c.reshape(tiles, TILE, k // group, group).to(torch.int32)
    else:
        record = parts["codes"].view(tiles, k // group, -1)  # a group's nibbles, then its high bits
        b = record[..., : group * TILE // 2].reshape(tiles, k // group, group // 8, TILE, 4)
        c = torch.stack([b & 0x0F, b >> 4], dim=3).permute(0, 4, 1, 2, 3, 5)  # [t, ch, g, v, half, j]
        c = c.reshape(tiles, TILE, k // group, group).to(torch.int32)
        if planes:
            h = record[..., group * TILE // 2 :].reshape(tiles, k // group, TILE, 1, 4).to(torch.int32)
            shifts = (planes * torch.arange(group // 4, dtype=torch.int32)).view(1, 1, 1, -1, 1)
            high = ((h >> shifts) & ((1 << planes) - 1)).permute(0, 2, 1, 3, 4).reshape(c.shape)
            c = c | (high << 4)
    c = c.float()
    if kq:
        f = parts["fscales"].view(tiles, k // 256, 2, TILE).permute(0, 3, 1, 2).float()  # [t, ch, u, 2]
        i = parts["iscales"].view(tiles, k // group, -1, TILE).permute(0, 3, 1, 2).float()
        per = 256 // group
        scale = f[..., 0].repeat_interleave(per, dim=2) * i[..., 0]
        offset = f[..., 1].repeat_interleave(per, dim=2) * i[..., -1]  # 16-input groups: mn = sc
        w = scale[..., None] * c - offset[..., None]
    else:
        f = parts["fscales"].view(tiles, k // group, 2, TILE).permute(0, 3, 1, 2).float()
        w = f[..., 0, None] * c + f[..., 1, None]
    return w.reshape(tiles * TILE, k)[:rows]


def _channels(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Output channels ``ids`` of one of the kernel's arrays [tiles, ...]: each is laid out as
    [tile, A, channel, B] (B bytes or values of a channel side by side), so channels are gathered
    as they are and regrouped into tiles, the last padded with zero channels."""
    tiles = values.shape[0]
    per_tile = values[0].numel()
    b = 4 if values.dtype == torch.uint8 else 1  # codes and high bits: 4 bytes a channel
    v = values.view(tiles, per_tile // (TILE * b), TILE, b).permute(0, 2, 1, 3).reshape(tiles * TILE, -1, b)
    picked = v[ids]
    pad = -len(ids) % TILE
    picked = nn.functional.pad(picked, (0, 0, 0, 0, 0, pad))
    return (
        picked.view(-1, TILE, per_tile // (TILE * b), b)
        .permute(0, 2, 1, 3)
        .reshape(-1, per_tile)
        .contiguous()
    )


class GGUFLinear(nn.Module):
    """``y = x @ W.T + b`` where W is a GGUF tensor's blocks of type ``qtype``, run by verispec's
    kernel. Each row's result is independent of the other rows in the call, to the bit (see the
    kernel's header), so greedy speculative output equals plain output on this path too."""

    def __init__(
        self,
        qtype: Q,
        blocks: np.ndarray | torch.Tensor | Sequence[np.ndarray],
        shape: tuple[int, int],
        bias: torch.Tensor | None = None,
        order: np.ndarray | None = None,
    ) -> None:
        """``blocks``: uint8 [out_features, row_bytes] as ``gguf.GGUFReader`` gives a quantized
        tensor's ``data``, or several such tensors whose rows are the outputs one after another (a
        fused q/k/v); ``order``: which of those rows each output is (default: as they come);
        ``shape``: (out_features, in_features)."""
        super().__init__()
        qtype = Q(qtype)
        check_type(qtype, "weight")
        why = kernel_error()
        if why is not None:
            raise VerispecError(f"GGUF weights cannot run natively here: {why}")
        out_features, in_features = shape
        unit = _FORMATS[_FORMAT_OF[qtype]][2]
        if in_features % unit:
            raise VerispecError(f"a {qtype.name} weight needs a multiple of {unit} inputs, not {in_features}")
        if isinstance(blocks, torch.Tensor | np.ndarray):
            blocks = [blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks]
        members = [np.asarray(b) for b in blocks]
        rows = len(order) if order is not None else sum(m.shape[0] for m in members)
        if rows != out_features:
            raise VerispecError(f"{rows} rows of blocks for {out_features} outputs")
        self._adopt(qtype, pack_blocks(qtype, members, in_features, order), shape, bias)

    @classmethod
    def from_parts(
        cls, qtype: Q, parts: dict[str, torch.Tensor], shape: tuple[int, int], bias: torch.Tensor | None
    ) -> GGUFLinear:
        """A layer over arrays already in the kernel's layout (a row cut builds these)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._adopt(qtype, parts, shape, bias)
        return layer

    def _adopt(
        self, qtype: Q, parts: dict[str, torch.Tensor], shape: tuple[int, int], bias: torch.Tensor | None
    ) -> None:
        """Take ``parts`` (the kernel's arrays) as this layer's weights: what both constructors end with."""
        self.qtype = qtype
        self.fmt = _FORMATS[_FORMAT_OF[qtype]][0]
        self.out_features, self.in_features = shape
        for name, value in parts.items():
            self.register_buffer(name, value.contiguous(), persistent=False)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach().float(), False))

    def parts(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _PARTS}

    def rows(self, ids: torch.Tensor) -> GGUFLinear:
        """A layer of the output channels ``ids`` only, their blocks as they are: its outputs equal
        this layer's for those channels, to the bit (a channel's sum reads only its own weights). A
        draft vocabulary's LM head is cut this way."""
        ids = ids.long()
        parts = {
            name: _channels(value, ids) if value.numel() else value for name, value in self.parts().items()
        }
        bias = None if self.bias is None else self.bias[ids]
        return GGUFLinear.from_parts(self.qtype, parts, (len(ids), self.in_features), bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights [out, in] this layer multiplies by."""
        return unpack(self.qtype, self.parts(), (self.out_features, self.in_features))

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts().values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32
        # The arrays straight from nn.Module's dicts: its __getattr__ per buffer, five a call and 141
        # calls a step of the 1.5B, cost 0.3-0.6 ms of a 19-23 ms decode step (Zen 5, paired runs).
        parts, bias = self._buffers, self._parameters["bias"]
        codes, fscales, iscales, kcorr = parts["codes"], parts["fscales"], parts["iscales"], parts["kcorr"]
        return torch.ops.verispec_gguf.gguf_linear(
            x, codes, fscales, iscales, kcorr, bias, self.fmt, self.out_features
        )

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qtype.name}"
