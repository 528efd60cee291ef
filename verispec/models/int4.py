"""4-bit weights for the CPU fast path: fewer bytes read per token than int8, same exactness.

Decoding one token reads every weight once, and on this project's 2-core machine the int8 path's
Linears run at about the memory bandwidth (1.55 GB for the 1.5B in 46 ms), which is why it decodes
at ~0.55x llama.cpp's Q4_K_M speed. 4-bit codes in groups of 64 inputs with a float16 scale and
offset read 4.5 bits per weight, as Q4_K does. torch's own CPU int4 kernels are compute-bound here
(see ``kernels/int4_linear.cpp``), so verispec compiles a small kernel of its own on first use (with
the g++ and ninja that ``torch.utils.cpp_extension`` needs), for the CPU it runs on: AVX-512 VNNI
where the CPU has it, else AVX2 (the same weights and format; llama.cpp's x86 paths split the same
way), and caches the build under verispec's cache folder.

Each group's scale and offset are chosen by a search over a few clippings of its range, then refit
by least squares to the codes (llama.cpp's k-quants do both). Groups of 64 rather than 128 halve
the squared error of the 1.5B's attention weights (e.g. q_proj 0.0124 -> 0.0069 of the weights'
mean square) for ~5-10% more time per forward. The LM head is int4 too where the kernel is the
AVX2 one and int8 (:class:`~verispec.models.quant.RowwiseInt8Linear`) elsewhere: its argmax is the
output (Q4_K_M keeps it at 6 bits for that reason), and which is better depends on the CPU
(:func:`int4_lm_head`). Quality against float32: ``verispec bench quality --quantization int4``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from verispec.errors import VerispecError
from verispec.models import native

GROUP = 64
"""Inputs per quantization group (the kernel's unit; inputs are zero-padded to a multiple)."""
COLS = 4
"""Output channels interleaved in one block of the kernel's layout (one per 128-bit lane)."""
AMX_COLS = 16
"""Output channels per tile of the AMX kernel's layout (:func:`to_amx_layout`)."""
AMX_ENV = "VERISPEC_INT4_AMX"
"""Set to 0 to run the VNNI kernels on a CPU with AMX (to compare the two)."""
HEAD_ENV = "VERISPEC_INT4_LM_HEAD"
"""1 or 0: an int4 or int8 LM head on the int4 path on any CPU (unset: :func:`int4_lm_head`)."""
LAYOUT = "int4-g64-f16-lane128-v1"
"""Names the packed format; part of the weight cache's key."""

_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
"""Shrink factors of each group's range tried at quantization time; the best per group is kept."""
_REFINE = 4
"""Rounds of refitting each group's scale and offset by least squares to its codes: on the 1.5B's
layers it cuts the squared error by 5-10% over the best clipping alone."""

_SOURCE = "int4_linear.cpp"
_PROMPT_ROWS: ContextVar[bool] = ContextVar("verispec_int4_prompt_rows", default=False)


def int4_lm_head() -> bool:
    """Whether the int4 path's LM head is int4 too (else a :class:`~verispec.models.quant.RowwiseInt8Linear`).

    Where the kernel is the AVX2 one, yes. There fbgemm's int8 head is the slowest product of a
    decode step and not the more accurate one: on the 1.5B (151936 x 1536, 2-core Zen 3) it takes
    12.0 ms of a ~47 ms 1-row step against 5.6 ms for the int4 kernel (4 rows 12.5 vs 8.5 ms), and
    without VNNI its activations are 7-bit (:data:`~verispec.models.quant._REDUCE_RANGE`), so on
    8192 of the target's own states it agreed with the float32 head's top token 96.24% of the time
    (mean KL 0.0101 nats) against the int4 head's 96.30% (0.0067). Where the
    kernel is the VNNI one the int8 head has 8-bit activations (and AMX tiles where there are some):
    it stays int8 there until measured. ``VERISPEC_INT4_LM_HEAD=1`` / ``0`` chooses either anywhere
    (to compare them); both live side by side in the conversion cache."""
    choice = os.environ.get(HEAD_ENV, "")
    if choice not in ("", "0", "1"):
        raise VerispecError(f"{HEAD_ENV} must be 0 or 1, not {choice!r}")
    return choice == "1" if choice else kernel_isa() == "avx2"


def kernel_isa() -> str | None:
    """The instruction set the kernel is built for on this CPU: ``avx512-vnni`` or ``avx2``, else
    None (no int4 here)."""
    return native.cpu_isa()


def cpu_supports_int4() -> bool:
    return kernel_isa() is not None


def kernel_key() -> str:
    """Names this build of the kernel (see :func:`verispec.models.native.build_key`)."""
    return native.build_key(_SOURCE)


def ensure_kernel() -> None:
    """Compile (first use, ~1 min) or load the cached kernel; raise a VerispecError saying why not."""
    if not cpu_supports_int4():
        why = "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C"
    else:
        why = native.load(_SOURCE)
    if why is not None:
        raise VerispecError(f"--quantization int4 is not available: {why}; use int8")


@functools.cache
def amx_available() -> bool:
    """Whether the kernels were built with AMX-INT8 (the CPU has it) and this process may use the
    tiles; False, never an error, where the build failed (callers then run their other kernel)."""
    if not native.cpu_has_amx() or native.load(_SOURCE) is not None:
        return False
    return bool(torch.ops.verispec.int4_amx_ready())


def uses_amx() -> bool:
    """Whether new :class:`Int4Linear` and :class:`~verispec.models.quant.RowwiseInt8Linear`
    layers run the AMX kernels: where they are available, unless ``VERISPEC_INT4_AMX=0``. On AMX a
    verified row costs a fraction of what it costs on VNNI or fbgemm (docs/design.md), so k
    drafted tokens cost little more than one."""
    return os.environ.get(AMX_ENV, "1") != "0" and amx_available()


@contextmanager
def prompt_rows() -> Iterator[None]:
    """Inside this block :class:`Int4Linear` runs the many-row kernel (``int4_linear_many``).

    A prompt feeds tens to hundreds of rows at once, where the decode kernel's per-row work makes
    the int4 path slow (~11 ms per prompt token on the 1.5B); the many-row kernel unpacks each
    weight tile once and is ~1.3-1.5x faster per row. (It exists for AVX-512 VNNI only: the AVX2
    build runs prompt rows through its decode kernel, bit-identical to decode rows.) Its rows are
    independent of each other, but its float order differs from the decode kernel's, so only
    tokens that are always fed this way may come here: the engine's prefill of prompt tokens,
    which is the same whether it speculates or not
    (:meth:`~verispec.models.hf.HFCausalLM.forward_batch` enters this block for passes that keep
    no logits). Decode and verify rows never do, so they stay bit-identical to each other.
    """
    token = _PROMPT_ROWS.set(True)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> the kernel's (packed uint8 [N/4, G*128], scales [N/4, G*4], offsets [N/4, G*4]).

    Asymmetric 4-bit per group of GROUP (64) inputs (w ~ s*q + o, q in 0..15); for each group the
    clipping of its range with the smallest squared error among :data:`_CLIPS` is kept, then refit.
    N is padded to a multiple of 4 with zero channels and K to a multiple of GROUP with zero inputs.
    """
    w = weight.detach().float()
    n, k = w.shape
    n_pad, k_pad = -(-n // COLS) * COLS, -(-k // GROUP) * GROUP
    w = nn.functional.pad(w, (0, k_pad - k, 0, n_pad - n)).view(n_pad, k_pad // GROUP, GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    best_err = torch.full(lo.shape, float("inf"))
    best_s, best_o = torch.ones_like(lo), lo.clone()
    for clip in _CLIPS:
        c_lo, c_hi = lo * clip, hi * clip
        s = ((c_hi - c_lo) / 15).clamp_min(1e-12)
        q = ((w - c_lo) / s).round().clamp(0, 15)
        err = ((q * s + c_lo - w) ** 2).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_o = torch.where(better, s, best_s), torch.where(better, c_lo, best_o)
    for _ in range(_REFINE):  # least-squares scale and offset for the current codes, kept if better
        q = ((w - best_o) / best_s).round().clamp(0, 15)
        q_c = q - q.mean(-1, keepdim=True)
        var = (q_c * q_c).sum(-1, keepdim=True)
        s = torch.where(var > 0, (q_c * w).sum(-1, keepdim=True) / var.clamp_min(1e-12), best_s).clamp_min(
            1e-12
        )
        o = w.mean(-1, keepdim=True) - s * q.mean(-1, keepdim=True)
        q = ((w - o) / s).round().clamp(0, 15)
        err = ((q * s + o - w) ** 2).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_o = torch.where(better, s, best_s), torch.where(better, o, best_o)
    best_s, best_o = best_s.half(), best_o.half()  # stored as float16: 4.5 bits per weight in all
    q = ((w - best_o.float()) / best_s.float()).round().clamp(0, 15).to(torch.uint8)  # [N, G, GROUP]
    return _pack(q, best_s.squeeze(-1), best_o.squeeze(-1))


def _pack(
    q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, G, GROUP] (uint8 0..15, N a multiple of COLS) and float16 scales and offsets [N, G]
    -> the kernel's layout (:func:`quantize_weight`'s result)."""
    n_pad, groups = scales.shape
    blocks = n_pad // COLS
    # Kernel layout: per block and group, GROUP / 32 vectors t of 64 bytes; 16-byte lane j of vector t holds
    # channel j's inputs 32t..32t+15 in its low nibbles and 32t+16..32t+31 in its high ones.
    q = q.view(blocks, COLS, groups, GROUP // 32, 2, 16)  # [block, j, g, t, half, i]
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [block, g, t, j, i]
    return packed.reshape(blocks, -1).contiguous(), _per_block(scales, COLS), _per_block(offsets, COLS)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """The float weights [N, K] the kernel multiplies by; for tests and quality checks."""
    n, k = shape
    q = _codes(packed).float()
    s, o = (_per_channel(p, COLS).float().unsqueeze(-1) for p in (scales, offsets))
    return (q * s + o).reshape(q.shape[0], -1)[:n, :k]


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes [blocks * COLS, groups, GROUP] (uint8, 0..15) of the VNNI layout."""
    blocks = packed.shape[0]
    groups = packed.shape[1] // (COLS * GROUP // 2)
    bytes_ = packed.view(blocks, groups, GROUP // 32, COLS, 16).permute(0, 3, 1, 2, 4)  # [block, j, g, t, i]
    return torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=-2).reshape(blocks * COLS, groups, GROUP)


def _per_channel(params: torch.Tensor, cols: int) -> torch.Tensor:
    """[blocks, groups * cols] (block, group, channel) -> [blocks * cols, groups]."""
    blocks = params.shape[0]
    return params.view(blocks, -1, cols).transpose(1, 2).reshape(blocks * cols, -1)


def _per_block(params: torch.Tensor, cols: int) -> torch.Tensor:
    """[channels, groups] -> [channels / cols, groups * cols] (block, group, channel)."""
    channels, groups = params.shape
    return (
        params.view(channels // cols, cols, groups).transpose(1, 2).reshape(channels // cols, -1).contiguous()
    )


def to_amx_layout(
    packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The VNNI layout of :func:`quantize_weight` -> the AMX kernel's (the same codes, scales and
    offsets): tiles of 16 channels (zero channels pad the last); per tile and group 8 vectors of 64
    bytes whose byte 4c + b holds channel c's input 4v + b (low nibble) and 4(v + 8) + b (high)."""
    q = _codes(packed)
    channels, groups, _ = q.shape
    pad = -channels % AMX_COLS
    q = nn.functional.pad(q, (0, 0, 0, 0, 0, pad))
    tiles = (channels + pad) // AMX_COLS
    q = q.view(tiles, AMX_COLS, groups, GROUP // 4, 4).permute(0, 2, 3, 1, 4)  # [tile, g, quad, c, b]
    amx = q[:, :, :8] | (q[:, :, 8:] << 4)
    params = [
        _per_block(nn.functional.pad(_per_channel(p, COLS), (0, 0, 0, pad)), AMX_COLS)
        for p in (scales, offsets)
    ]
    return amx.reshape(tiles, -1).contiguous(), params[0], params[1]


def from_amx_layout(
    packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, out_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_amx_layout` for a layer of ``out_features`` channels."""
    tiles = packed.shape[0]
    groups = packed.shape[1] // (AMX_COLS * GROUP // 2)
    bytes_ = packed.view(tiles, groups, 8, AMX_COLS, 4)
    q = torch.cat([bytes_ & 0x0F, bytes_ >> 4], dim=2)  # [tile, g, quad, c, b]
    channels = -(-out_features // COLS) * COLS
    q = q.permute(0, 3, 1, 2, 4).reshape(tiles * AMX_COLS, groups, GROUP)[:channels]
    q = q.view(channels // COLS, COLS, groups, GROUP // 32, 2, 16)  # [block, j, g, t, half, i]
    v1 = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(channels // COLS, -1)
    params = [_per_block(_per_channel(p, AMX_COLS)[:channels], COLS) for p in (scales, offsets)]
    return v1.contiguous(), params[0], params[1]


class Int4Linear(nn.Module):
    """A Linear with 4-bit weights run by verispec's kernel; each row's result is independent
    of the other rows in the call, to the bit (see the kernel's header)."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        bias: torch.Tensor | None,
        shape: tuple[int, int],
        amx: bool | None = None,
        *,
        repacked: bool = False,
    ) -> None:
        """``packed, scales, offsets``: :func:`quantize_weight`'s (VNNI) layout, kept as it is or
        repacked for the AMX kernel (``amx``; None: :func:`uses_amx`), or with ``repacked`` already
        in the AMX layout (fusion concatenates AMX layers as they are). ``shape``: the float
        weight's [out_features, in_features]."""
        super().__init__()
        ensure_kernel()
        self.amx = uses_amx() if amx is None else amx
        if self.amx and not amx_available():
            raise VerispecError("the int4 AMX kernel is not available on this CPU or in this process")
        if repacked and not self.amx:
            raise VerispecError("parts in the AMX layout need amx=True")
        self.out_features, self.in_features = shape
        parts = (packed.contiguous(), scales.half().contiguous(), offsets.half().contiguous())
        self.packed, self.scales, self.offsets = to_amx_layout(*parts) if self.amx and not repacked else parts
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, amx: bool | None = None) -> Int4Linear:
        return cls(
            *quantize_weight(linear.weight), linear.bias, (linear.out_features, linear.in_features), amx
        )

    @property
    def cols(self) -> int:
        """Output channels per row of :attr:`packed` (a VNNI block or an AMX tile)."""
        return AMX_COLS if self.amx else COLS

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed, scales, offsets) in :func:`quantize_weight`'s layout, whichever kernel runs."""
        if self.amx:
            return from_amx_layout(self.packed, self.scales, self.offsets, self.out_features)
        return self.packed, self.scales, self.offsets

    def dequantized(self) -> torch.Tensor:
        """The float32 weights [out, in] this layer multiplies by."""
        return dequantize(*self.parts(), (self.out_features, self.in_features))

    def rows(self, ids: torch.Tensor) -> Int4Linear:
        """A layer of the output channels ``ids`` only, with their codes, scales and offsets as they
        are (not re-quantized): its outputs equal this layer's for those channels, to the bit (each
        output channel's sum reads only its own weights; tested). Used for a draft vocabulary's head
        cut from an int4 LM head."""
        packed, scales, offsets = self.parts()
        ids = ids.long()
        q = _codes(packed)[ids]
        s, o = (_per_channel(p, COLS)[ids] for p in (scales, offsets))
        pad = -len(ids) % COLS
        q = nn.functional.pad(q, (0, 0, 0, 0, 0, pad))
        s, o = (nn.functional.pad(p, (0, 0, 0, pad)) for p in (s, o))
        bias = None if self.bias is None else self.bias[ids]
        return Int4Linear(*_pack(q, s, o), bias, (len(ids), self.in_features), self.amx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32
        if self.amx:  # one kernel for every row: decode, verify and prompt rows stay bit-identical
            op = torch.ops.verispec.int4_linear_amx
        elif _PROMPT_ROWS.get():
            op = torch.ops.verispec.int4_linear_many
        else:
            op = torch.ops.verispec.int4_linear
        return op(x, self.packed, self.scales, self.offsets, self.bias, self.out_features)
