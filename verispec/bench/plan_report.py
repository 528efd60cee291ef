"""What ``verispec plan`` prints: a paragraph in plain words, the tables, and the JSON object.

Every sentence is generated from the numbers (:mod:`verispec.bench.plan_model`), so the words say
what the plan says and never more: where the forward pass sits between memory- and compute-bound,
what each proposer costs, its best depth, and whether speculation pays at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from verispec.bench.plan_model import CostCurve, Measured, Method, Plan, Prediction

MEMORY_BOUND, COMPUTE_BOUND = 2.0, 5.0
"""cost(8) / cost(1) at or below which the target's forward counts as memory-bound, at or above
which as compute-bound (8 means checking 8 tokens costs 8 decode steps)."""


def explain(plan: Plan, target: CostCurve, methods: Sequence[Method]) -> str:
    """One paragraph, in plain words, generated from the numbers."""
    c1, c8 = target.ms(1), target.ms(8)
    ratio = c8 / c1
    if ratio <= MEMORY_BOUND:
        bound, meaning = "memory-bound", "checking several tokens in one pass costs little more than one"
    elif ratio >= COMPUTE_BOUND:
        bound, meaning = (
            "compute-bound",
            "checking k tokens costs nearly k decode steps, so rejected drafts cost",
        )
    else:
        bound, meaning = "between memory- and compute-bound", "checking more tokens per pass has a real price"
    extra = (c8 - c1) / 7 / c1
    words = [
        f"The target's forward pass is {bound} ({c1:.1f} ms for 1 token, {c8:.1f} ms for 8: {ratio:.1f}x): "
        f"{meaning}; each extra token checked costs about {extra:.0%} of a decode step."
    ]
    for m in methods:
        if m.draft_ms_per_token:
            words.append(
                f"The {m.name} proposer costs {m.draft_ms_per_token:.1f} ms per drafted token, "
                f"{m.draft_ms_per_token / c1:.0%} of a target decode step ({m.cost_source})."
            )
        else:
            words.append(
                f"The {m.name} proposer costs {m.propose_ms_per_step:.2f} ms per step "
                f"({m.propose_ms_per_step / c1:.1%} of a decode step; {m.cost_source})."
            )
        top = max(
            (p for p in plan.rows if p.method == m.name), key=lambda p: p.tokens_per_second, default=None
        )
        if top is not None:
            source = (
                "the measured" if m.acceptance.measured else f"an assumed {m.acceptance.conditional[0]:.0%}"
            )
            words.append(
                f"With {source} acceptance, its best depth is k={top.k}: tau {top.tau:.2f} tokens per "
                f"step of {top.step_ms:.1f} ms, {top.tokens_per_second:.2f} tok/s ({top.speedup:.2f}x plain)."
            )
    plain = plan.plain
    if plan.best is None:
        words.append(
            f"No method beats plain decoding ({plain.tokens_per_second:.2f} tok/s): a step's drafting and "
            "checking cost more than the extra tokens it commits. Use no speculation here."
        )
    else:
        b = plan.best
        margin = " (a small margin: measure before relying on it)" if b.speedup < 1.1 else ""
        words.append(
            f"Speculation pays: use {b.method} with k={b.k}, expected {b.tokens_per_second:.2f} tok/s "
            f"against {plain.tokens_per_second:.2f} plain, {b.speedup:.2f}x{margin}."
        )
        if b.extrapolated_acceptance or b.extrapolated_cost:
            guessed = "acceptance" if b.extrapolated_acceptance else "cost"
            words.append(
                f"At k={b.k} the {guessed} is extrapolated past what was measured: run it to confirm."
            )
    return " ".join(words)


def plan_table(plan: Plan) -> str:
    """method x k: expected tau, draft / verify / step ms, tok/s and speedup; the best row marked."""
    header = ("method", "k", "tau", "draft ms", "verify ms", "step ms", "tok/s", "speedup", "")
    rows = [_row(plan.plain, plan.best is None)]
    rows += [_row(p, p is plan.best) for p in plan.rows]
    out = _table(header, rows)
    if any(p.extrapolated_acceptance for p in plan.rows):
        out += "\n* acceptance assumed past the deepest measured position (its last measured value)"
    if any(p.extrapolated_cost for p in plan.rows):
        out += "\n~ cost extrapolated past the cost curve's largest k"
    return out


def check_table(pairs: Sequence[tuple[Prediction, Measured]]) -> str:
    header = ("method", "k", "tau pred", "tau meas", "ms/step pred", "ms/step meas",
              "tok/s pred", "tok/s meas", "meas/pred")  # fmt: skip
    rows = [
        (p.method, str(p.k) if p.k else "-", f"{p.tau:.2f}", f"{m.tau:.2f}", f"{p.step_ms:.1f}",
         f"{m.ms_per_step:.1f}", f"{p.tokens_per_second:.2f}", f"{m.tokens_per_second:.2f}",
         f"{m.tokens_per_second / p.tokens_per_second:.2f}")
        for p, m in pairs
    ]  # fmt: skip
    return _table(header, rows)


def _row(p: Prediction, best: bool) -> tuple[str, ...]:
    mark = "<- best" + (" (no speculation)" if p.k == 0 else "") if best else ""
    return (
        p.method,
        str(p.k) if p.k else "-",
        f"{p.tau:.2f}" + ("*" if p.extrapolated_acceptance else " "),
        f"{p.draft_ms:.1f}",
        f"{p.verify_ms:.1f}" + ("~" if p.extrapolated_cost else " "),
        f"{p.step_ms:.1f}",
        f"{p.tokens_per_second:.2f}",
        f"{p.speedup:.2f}x",
        mark,
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Text columns: numbers right-aligned, the first and last (labels) left-aligned."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in (0, len(widths) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )


def choice(plan: Plan) -> str:
    return "no speculation" if plan.best is None else f"{plan.best.method} with k={plan.best.k}"


def plan_dict(
    plan: Plan,
    methods: Sequence[Method],
    explanation: str,
    pairs: Sequence[tuple[Prediction, Measured]] = (),
    notes: Sequence[str] = (),
    warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """Everything ``verispec plan`` prints, for machines."""
    return {
        "schema": "verispec-plan/1",
        "choice": choice(plan),
        "best": plan.best.to_dict() if plan.best else None,
        "plain": plan.plain.to_dict(),
        "rows": [p.to_dict() for p in plan.rows],
        "methods": [asdict(m) for m in methods],
        "explanation": explanation,
        "check": [
            {
                "predicted": p.to_dict(),
                "measured": asdict(m),
                "measured_over_predicted": m.tokens_per_second / p.tokens_per_second,
            }
            for p, m in pairs
        ],
        "notes": list(notes),
        "warnings": list(warnings),
    }
