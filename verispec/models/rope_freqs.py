"""A GGUF's per-frequency RoPE divisors (``rope_freqs.weight``), applied as llama.cpp applies them.

llama.cpp's converter stores Llama 3.1's and 3.2's long-context RoPE scaling as a tensor rather
than as metadata: rotation angle ``i`` at position ``p`` is ``p * base**(-2i/d) / rope_freqs[i]``.
transformers' GGUF support reads no such tensor and builds the config without scaling, so a Llama 3
file loaded through it turns its low frequencies up to 8x (3.1) or 32x (3.2) too fast at every
position: another model than the one llama.cpp runs, further off the longer the context (on a
random-weight Llama 3.1-shaped file, agreement with llama.cpp's top token fell from 93% to 26% at
positions 1024-2000 without them).

Both loading paths state the divisors in the config as transformers' ``llama3`` RoPE parameters
(:func:`state_in_config`, checked to reproduce them), so that the converted folder's model rebuilds
them on every load and whatever reads the target's config (an EAGLE-3 drafter's own rotary
embedding, its speculators export) sees the scaling. The native path also sets the rotary
frequencies from the file's own divisors (:func:`set_frequencies`), as llama.cpp computes them,
and runs a file whose divisors follow no ``llama3`` parameters that way alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from verispec.errors import VerispecError
from verispec.models.base import head_dim_of

if TYPE_CHECKING:
    from torch import nn

    from verispec.models.gguf_file import GGUFFile

TENSOR = "rope_freqs.weight"

LLAMA_3_1: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""Llama 3.1's RoPE scaling (its config.json's ``rope_scaling``)."""

_RTOL = 1e-5
"""How close the ``llama3`` parameters must reproduce the file's divisors (float32 rounding is ~1e-7)."""


def file_divisors(file: GGUFFile) -> np.ndarray | None:
    """The file's ``rope_freqs`` as float32, or None where it has none."""
    from gguf import quants

    tensor = next((t for t in file.tensors if t.name == TENSOR), None)
    return None if tensor is None else quants.dequantize(tensor.data, tensor.qtype).astype(np.float32).ravel()


def state_in_config(config: Any, divisors: np.ndarray, *, required: bool) -> bool:
    """Write ``divisors`` into ``config`` as ``llama3`` RoPE parameters; whether it could.

    Where no such parameters reproduce them, raise VerispecError if ``required`` (the converted
    path has no other way to keep them), else leave ``config`` as it is."""
    if np.all(divisors == 1):
        return True  # no scaling to state
    text = config.get_text_config()
    rope = dict(text.rope_parameters or {})
    try:
        scaling = llama3_parameters(divisors, float(rope["rope_theta"]), head_dim_of(text))
    except VerispecError:
        if required:
            raise
        return False
    text.rope_parameters = {**rope, **scaling}
    return True


def set_frequencies(model: nn.Module, divisors: np.ndarray) -> None:
    """Set every rotary embedding's frequencies in ``model`` to ``base**(-2i/d) / divisors[i]`` in
    float32, as llama.cpp computes its angles. Raises VerispecError where the model has no rotary
    embedding or rotates another number of frequencies than there are divisors."""
    import torch  # the converted path and the synthetic file use the rest without torch

    rotaries = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not rotaries:
        raise VerispecError(f"the file holds {TENSOR}, but the model has no rotary embedding to apply it to")
    text = model.config.get_text_config()
    dim, theta = head_dim_of(text), float(text.rope_parameters["rope_theta"])
    divisors = torch.from_numpy(np.asarray(divisors, dtype=np.float32)).flatten()
    if divisors.numel() != dim // 2:
        raise VerispecError(
            f"{TENSOR} holds {divisors.numel()} divisors where the model rotates {dim // 2} frequencies"
        )
    unscaled = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    freqs = unscaled / divisors
    for rotary in rotaries:
        for name in ("inv_freq", "original_inv_freq"):
            if name in rotary._buffers:
                rotary._buffers[name] = freqs.clone()


def llama3_parameters(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """transformers' ``llama3`` RoPE parameters that give ``divisors`` for rotary base ``theta``.

    Llama 3's divisor is 1 for wavelengths under ``original / high``, ``factor`` above
    ``original / low``, and between them ``1 / ((1 - s) / factor + s)`` with
    ``s = (original / wavelength - low) / (high - low)``. ``factor`` is the largest divisor; the
    ramp fixes only ``original / (high - low)`` and ``low / (high - low)``, so ``low`` is taken as
    1 (Llama 3.1 and 3.2's value; every ``low`` with the same ramp gives the same divisors) and the
    other two are fitted to the ramp's divisors, rounded where that reproduces them too. Where the
    ramp has fewer than two frequencies, Llama 3.1's ``high`` = 4 and ``original`` = 8192 are
    tried. Raises VerispecError where no parameters reproduce the divisors."""
    divisors = np.asarray(divisors, dtype=np.float64).ravel()
    wavelength = wavelengths(theta, head_dim)
    if divisors.shape != wavelength.shape:
        raise VerispecError(f"{TENSOR} holds {divisors.size} divisors for a head of {head_dim} dimensions")
    factor = float(divisors.max())
    candidates: list[tuple[float, float]] = [
        (LLAMA_3_1["high_freq_factor"], LLAMA_3_1["original_max_position_embeddings"])
    ]
    ramp = (divisors > 1 + _RTOL) & (divisors < factor * (1 - _RTOL))
    if factor > 1 and ramp.sum() >= 2:
        # s * (high - 1) = original / wavelength - 1: linear in (original, high).
        s = (1 / divisors[ramp] - 1 / factor) / (1 - 1 / factor)
        lhs = np.stack([1 / wavelength[ramp], -s], axis=1)
        (original, high), *_ = np.linalg.lstsq(lhs, 1 - s, rcond=None)
        # The stated values where the fit is one to rounding (4, 8192 rather than 3.9999997, 8192.0001).
        candidates[:0] = [(round(float(high), 4), round(original)), (float(high), float(original))]
    for high, original in candidates:
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
        if high > 1 and np.allclose(llama3_divisors(params, wavelength), divisors, rtol=_RTOL, atol=0):
            return params
    raise VerispecError(
        f"the file's {TENSOR} are not Llama 3's RoPE scaling; run it with --quantization gguf, "
        "which applies them as they are"
    )


def wavelengths(theta: float, head_dim: int) -> np.ndarray:
    """The unscaled rotary wavelengths (positions per turn) of a head of ``head_dim`` dimensions."""
    return 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def llama3_divisors(params: dict[str, Any], wavelength: np.ndarray) -> np.ndarray:
    """The divisor Llama 3's RoPE scaling ``params`` gives each rotary ``wavelength``."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    s = (original / wavelength - low) / (high - low)
    ramp = 1 / ((1 - s) / factor + s)
    return np.where(wavelength < original / high, 1.0, np.where(wavelength > original / low, factor, ramp))
