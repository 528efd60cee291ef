"""The three PNG plots of a run: speedup per category, tau per category, acceptance by draft position.

Figures are built with matplotlib's object API and its Agg canvas, never ``pyplot``: no global
backend switch and no display is needed, so this works on a headless server and inside tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verispec.bench.aggregate import OVERALL, Summary
from verispec.bench.settings import PLAIN


def write_plots(summaries: Sequence[Summary], out_dir: Path, title: str = "") -> list[Path]:
    """Write ``speedup.png``, ``tau.png`` and ``acceptance_by_position.png``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _bars(summaries, lambda s: s.speedup, "speedup over plain decoding", out_dir / "speedup.png", title),
        _bars(
            summaries,
            lambda s: s.mean_accepted_length,
            "mean accepted length (tau)",
            out_dir / "tau.png",
            title,
        ),
        _positions(summaries, out_dir / "acceptance_by_position.png", title),
    ]


def _figure(width: float = 8.0, height: float = 4.5):  # -> matplotlib.figure.Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Any, ax: Any, path: Path, *, drawn: bool, empty: str | None = None) -> Path:
    """Finish and write a plot (a matplotlib ``Figure`` and its ``Axes``): its legend where anything
    was drawn (else the ``empty`` note, so that a blank plot says why), the layout, and the PNG at
    ``path``, which it returns."""
    if drawn:
        ax.legend(fontsize=8)
    elif empty is not None:
        ax.text(0.5, 0.5, empty, ha="center", transform=ax.transAxes)
    figure.tight_layout()
    figure.savefig(path)
    return path


def _bars(
    summaries: Sequence[Summary],
    value: Callable[[Summary], float | None],
    label: str,
    path: Path,
    title: str,
) -> Path:
    """Grouped bars: one group per category (overall last), one bar per method that has values."""
    groups = list(dict.fromkeys(s.group for s in summaries))
    values = {(s.method, s.group): value(s) for s in summaries}
    methods = [  # plain decoding is the dashed reference line, not a bar
        m
        for m in dict.fromkeys(s.method for s in summaries)
        if m != PLAIN and any(values.get((m, g)) is not None for g in groups)
    ]
    figure = _figure(max(6.0, 1.2 * len(groups) + 2), 4.5)
    ax = figure.add_subplot()
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ys = [values.get((method, group)) or 0.0 for group in groups]
        ax.bar(xs, ys, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")  # plain decoding: speedup 1, tau 1
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g if g == OVERALL else g.replace("/", "\n") for g in groups], fontsize=8)
    ax.set_ylabel(label)
    ax.set_title(title, fontsize=9)
    return save_figure(figure, ax, path, drawn=bool(methods), empty="no data for this plot in this run")


def _positions(summaries: Sequence[Summary], path: Path, title: str) -> Path:
    """Overall acceptance at draft position 1..k, one line per speculative method."""
    figure = _figure()
    ax = figure.add_subplot()
    drawn = 0
    for s in summaries:
        if s.group == OVERALL and s.per_position_acceptance:
            positions = range(1, len(s.per_position_acceptance) + 1)
            ax.plot(positions, s.per_position_acceptance, marker="o", label=s.method)
            drawn += 1
    ax.set_xlabel("draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("acceptance (of steps that drafted this position)")
    ax.set_ylim(0, 1.05)
    return save_figure(figure, ax, path, drawn=drawn > 0, empty="no speculative method in this run")
