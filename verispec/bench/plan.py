"""``verispec plan``: expected tokens/s of each method at each depth k, from measured costs and acceptance.

Two files a user measures once feed it: the verify-cost curve of ``verispec bench forward`` (the
machine) and the acceptance counts of ``verispec bench`` (the text). This module reads them and
checks that they belong together (:func:`provenance_warnings`); the model that combines them is
:mod:`verispec.bench.plan_model`, and what is printed :mod:`verispec.bench.plan_report`. Their names
are importable from here too: this is the one module the command line uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verispec.bench.aggregate import OVERALL, pooled
from verispec.bench.plan_model import (
    Acceptance,
    CostCurve,
    Measured,
    Method,
    Plan,
    Prediction,
    check,
    expected_tau,
    make_plan,
    plain_prediction,
    predict,
)
from verispec.bench.plan_report import (
    COMPUTE_BOUND,
    MEMORY_BOUND,
    check_table,
    choice,
    explain,
    plan_dict,
    plan_table,
)
from verispec.bench.records import PromptRecord, SpecCounts
from verispec.bench.settings import PLAIN
from verispec.errors import VerispecError

__all__ = [
    "COMPUTE_BOUND",
    "FORWARD_SCHEMA",
    "MEMORY_BOUND",
    "RESULTS_SCHEMA",
    "Acceptance",
    "CostCurve",
    "Measured",
    "Method",
    "Plan",
    "Prediction",
    "check",
    "check_table",
    "choice",
    "curves_from_forward",
    "expected_tau",
    "explain",
    "group_records",
    "make_plan",
    "measured_from_results",
    "methods_from_results",
    "plain_prediction",
    "plan_dict",
    "plan_table",
    "pooled_counts",
    "predict",
    "provenance_warnings",
]

FORWARD_SCHEMA = "verispec-bench-forward/1"
RESULTS_SCHEMA = "verispec-bench/1"


def curves_from_forward(forward: dict[str, Any]) -> tuple[CostCurve, CostCurve | None]:
    """The target's cost curve and the draft's (None if none was measured) from a forward.json."""
    if forward.get("schema") != FORWARD_SCHEMA:
        raise VerispecError("not a forward.json written by `verispec bench forward`")
    curves = {}
    for curve in forward.get("curves", []):
        points = [(p["k"], p["median_ms"]) for p in curve["points"]]
        curves[curve["role"]] = CostCurve.from_points(points, curve.get("model", ""))
    if "target" not in curves:
        raise VerispecError("forward.json has no target curve")
    return curves["target"], curves.get("draft")


def group_records(results: dict[str, Any], group: str = OVERALL) -> list[PromptRecord]:
    """The successful records of ``group`` (``overall`` or ``dataset/category``) of a results.json."""
    if results.get("schema") != RESULTS_SCHEMA:
        raise VerispecError("not a results.json written by `verispec bench`")
    records = [PromptRecord.from_dict(r) for r in results.get("records", []) if not r.get("error")]
    chosen = [r for r in records if group in (OVERALL, r.group)]
    if not chosen:
        groups = ", ".join(sorted({r.group for r in records} | {OVERALL}))
        raise VerispecError(f"no records for group {group!r} in results.json; groups: {groups}")
    return chosen


def pooled_counts(records: Sequence[PromptRecord], method: str) -> SpecCounts | None:
    """Summed speculation counts of ``method``'s records; None if it has none (a baseline)."""
    return pooled([r.counts for r in records if r.method == method])


def methods_from_results(
    results: dict[str, Any] | None,
    group: str = OVERALL,
    draft_ms_per_token: float | None = None,
    alpha: float | None = None,
) -> tuple[list[Method], list[str]]:
    """The methods to plan and notes on what could not be planned.

    From a results.json: each verispec method it ran, with its measured acceptance (or ``alpha``)
    and proposal cost. Without one, ``alpha`` is required: ngram (free proposals that always find
    a draft) and, if the draft's cost is known, draft.
    """
    if results is None:
        if alpha is None:
            raise VerispecError(
                "give measured acceptance (--results results.json) or assume one (--acceptance)"
            )
        assumed = Acceptance.constant(alpha)
        methods = [Method("ngram", assumed, cost_source="n-gram lookup assumed free")]
        if draft_ms_per_token is not None:
            methods.append(
                Method("draft", assumed, draft_ms_per_token, cost_source="draft curve of forward.json")
            )
        missing = draft_ms_per_token is None
        return methods, ["draft: not planned, forward.json has no draft curve (--draft)"] if missing else []
    records = group_records(results, group)
    methods, notes = [], []
    for name in dict.fromkeys(r.method for r in records):
        counts = pooled_counts(records, name)
        if name == PLAIN or counts is None:
            continue  # plain is the reference; baselines don't expose acceptance counts
        kind = results.get("contenders", {}).get(name, {}).get("method", name)
        acceptance = (
            Acceptance.constant(alpha)
            if alpha is not None
            else Acceptance.from_counts(counts.drafted_at, counts.accepted_at, counts.target_forward_passes)
        )
        if kind != "draft":
            per_step = 1000 * counts.draft_seconds / max(counts.target_forward_passes, 1)
            methods.append(
                Method(name, acceptance, 0.0, per_step, "lookup time per step measured in results.json")
            )
        elif draft_ms_per_token is not None:
            methods.append(Method(name, acceptance, draft_ms_per_token, 0.0, "draft curve of forward.json"))
        elif counts.drafted:
            per_token = 1000 * counts.draft_seconds / counts.drafted
            methods.append(
                Method(name, acceptance, per_token, 0.0, "draft time per drafted token in results.json")
            )
        else:
            notes.append(f"{name}: no draft cost known (measure it: verispec bench forward --draft ...)")
    return methods, notes


def measured_from_results(results: dict[str, Any], group: str = OVERALL) -> list[Measured]:
    """Plain decoding and each verispec method of a results.json, at the k it ran with."""
    records = group_records(results, group)
    k_run = int(results.get("settings", {}).get("num_speculative_tokens", 0))
    out = []
    for name in dict.fromkeys(r.method for r in records):
        counts = pooled_counts(records, name)
        if counts is None or not counts.target_forward_passes:
            continue
        mine = [r for r in records if r.method == name]
        out.append(
            Measured(
                method=name,
                k=0 if name == PLAIN else k_run,
                tokens_per_second=sum(r.tokens_per_second for r in mine) / len(mine),
                tau=counts.to_stats().mean_accepted_length,
                ms_per_step=1000 * sum(r.seconds for r in mine) / counts.target_forward_passes,
            )
        )
    return out


def provenance_warnings(forward: dict[str, Any], results: dict[str, Any] | None) -> list[str]:
    """Differences between the run that measured the costs and the one that measured acceptance."""
    if results is None:
        return []
    warnings = []
    curve_model = next((c.get("model") for c in forward.get("curves", []) if c.get("role") == "target"), None)
    run_model = (results.get("models", {}).get("target") or {}).get("name")
    if curve_model and run_model and curve_model != run_model:
        warnings.append(f"the cost curve is of {curve_model} but results.json's target is {run_model}")
    load = results.get("settings", {}).get("load", {})
    for key, there in forward.get("settings", {}).items():
        if key in load and load[key] != there:
            warnings.append(f"{key}: {there} for the cost curve, {load[key]} for results.json")
    return warnings
