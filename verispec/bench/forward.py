"""The verify-cost curve: time of one forward pass that appends k tokens to a KV cache of a given length.

Speculation pays when checking k tokens in one pass costs little more than generating one; on a
memory-bound machine it nearly does, on a compute-bound one it costs k times as much. This curve,
measured on the user's own hardware, is what says which case holds (and what a later
``verispec plan`` combines with measured acceptance to pick a method and k).

Each measurement: a cache pre-filled with ``context`` tokens, one untimed forward of each k to warm
that shape up, then ``repeats`` rounds that time one forward of every k in turn, each rolled back
with ``cache.trim(k)`` so every repeat sees the same cache length. The median per k is reported
(robust to a noisy, shared machine); taking the ks in rounds rather than one after another keeps a
virtual machine's speed, which can drift by 20% within a minute, out of the ratios between them.
Token ids are a fixed pseudo-random sequence: a forward's cost does not depend on which tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

import torch

from verispec.errors import VerispecError
from verispec.models.base import CausalLM


@dataclass(frozen=True)
class CostPoint:
    k: int
    median_ms: float
    ms: list[float]
    """Every timed repeat, in order."""


@dataclass(frozen=True)
class CostCurve:
    role: str
    """'target' or 'draft'."""
    model: str
    context: int
    points: list[CostPoint]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_curve(
    model: CausalLM, role: str, ks: list[int], context: int, repeats: int, seed: int = 0
) -> CostCurve:
    """Median wall time of appending k tokens to a ``context``-token cache, for each k in ``ks``."""
    if context < 1 or repeats < 1 or not ks or min(ks) < 1:
        raise VerispecError(
            f"need context >= 1, repeats >= 1 and every k >= 1; got {context}, {repeats}, {ks}"
        )
    if context + max(ks) > model.max_context:
        raise VerispecError(
            f"context {context} + k {max(ks)} exceeds {model.name}'s context of {model.max_context}"
        )
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(
        0, model.vocab_size, (1, context + max(ks)), generator=generator
    )  # [1, context + k_max]
    cache = model.new_cache()
    model.forward(ids[:, :context], cache)  # prefill, untimed
    for k in ks:  # warm-up of each shape
        model.forward(ids[:, context : context + k], cache, logits_to_keep=k)
        cache.trim(k)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):  # rounds over every k: a drift in the machine's speed hits them alike
        for k in ks:
            _synchronize(model.device)
            started = time.perf_counter()
            model.forward(ids[:, context : context + k], cache, logits_to_keep=k)
            _synchronize(model.device)  # a GPU returns before the kernels finish
            times[k].append((time.perf_counter() - started) * 1000)
            cache.trim(k)
    points = [CostPoint(k=k, median_ms=median(times[k]), ms=times[k]) for k in ks]
    return CostCurve(role=role, model=model.name, context=context, points=points)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def curve_table(curves: list[CostCurve]) -> str:
    """Median ms per k, and relative to the smallest k (the price of checking k tokens at once)."""
    ks = [p.k for p in curves[0].points] if curves else []
    header = ("model", "", *(f"k={k}" for k in ks))
    rows = []
    for curve in curves:
        base = curve.points[0].median_ms
        rows.append((f"{curve.role}: {curve.model}", "ms", *(f"{p.median_ms:.1f}" for p in curve.points)))
        rows.append(
            ("", f"x k={ks[0]}", *(f"{p.median_ms / base:.2f}" if base else "-" for p in curve.points))
        )
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:  # labels left-aligned, numbers right-aligned
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join(line(cells) for cells in (header, tuple("-" * w for w in widths), *rows))
