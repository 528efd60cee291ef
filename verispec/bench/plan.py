"""``verispec plan``: expected tokens/s of each method at each depth k, from measured costs and acceptance.

Why a model: speculation pays only when the tokens a step commits outweigh what the step costs, and
both sides depend on things a user can measure once: the machine (the verify-cost curve of
``verispec bench forward``) and the text (acceptance from ``verispec bench``). Combining them
predicts every k without running every k, and comparing the prediction with a measured run says how
far to trust it. Everything here is pure arithmetic on those two files' contents (no I/O, no model).

The model, per target forward pass ("step"), drafting up to k tokens:

- a_i: probability that draft position i is accepted given that positions 1..i-1 were; r_i:
  probability that a step drafts at least i tokens (1 for a draft model, below 1 for n-gram lookup,
  which drafts nothing where the text has no match). Both come from the raw ``drafted_at`` /
  ``accepted_at`` counts; past the last measured position the last measured values are assumed;
- E[tau](k) = 1 + sum_{i<=k} r_i * prod_{j<=i} a_j: tokens committed, the bonus token included;
- verify ms = cost(1) + sum_{i<=k} r_i * (cost(i+1) - cost(i)), i.e. cost(k+1) when r = 1, where
  cost(n) is the target's measured time to append n tokens, piecewise linear between the measured
  points (never assumed monotone) and continued past the last one along the last segment's slope
  (never downwards);
- draft ms = sum_{i<=k} r_i * (ms per draft token) for a draft model (k forwards of one token), or a
  per-step lookup time for n-grams (measured, else 0);
- tok/s = 1000 * E[tau] / (draft ms + verify ms); plain decoding: 1000 / cost(1).

Left out: prefill, per-step overhead (sampling, detokenization, Python), the KV cache growing
during a generation. The check against a measured run prints how much they weigh.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from verispec.bench.aggregate import OVERALL, pooled
from verispec.bench.records import PromptRecord, SpecCounts
from verispec.bench.settings import PLAIN
from verispec.errors import VerispecError

FORWARD_SCHEMA = "verispec-bench-forward/1"
RESULTS_SCHEMA = "verispec-bench/1"
MEMORY_BOUND, COMPUTE_BOUND = 2.0, 5.0
"""cost(8) / cost(1) at or below which the target's forward counts as memory-bound, at or above
which as compute-bound (8 means checking 8 tokens costs 8 decode steps)."""


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds of one target forward that appends n tokens, from measured (k, ms) points."""

    points: tuple[tuple[int, float], ...]
    model: str = ""

    @classmethod
    def from_points(cls, points: Iterable[tuple[int, float]], model: str = "") -> CostCurve:
        ordered = tuple(sorted((int(k), float(ms)) for k, ms in points))
        ks = [k for k, _ in ordered]
        if len(ks) < 2 or ks[0] != 1 or len(set(ks)) != len(ks) or any(ms <= 0 for _, ms in ordered):
            raise VerispecError(
                "a cost curve needs k=1 and at least one larger k, each once, with positive times; "
                f"got {ordered} (run verispec bench forward with --ks 1,2,4,8,16)"
            )
        return cls(ordered, model)

    @property
    def max_k(self) -> int:
        return self.points[-1][0]

    def ms(self, n: float) -> float:
        """Interpolated cost of appending ``n`` tokens (n >= 1)."""
        for (k0, m0), (k1, m1) in zip(self.points, self.points[1:], strict=False):
            if n <= k1:
                return m0 + (m1 - m0) * (n - k0) / (k1 - k0)
        (k0, m0), (k1, m1) = self.points[-2:]
        return m1 + max(0.0, (m1 - m0) / (k1 - k0)) * (n - k1)


@dataclass(frozen=True)
class Acceptance:
    """Per-position conditional acceptance a_i and draft reach r_i, positions 1..len."""

    conditional: tuple[float, ...]
    reach: tuple[float, ...]
    measured: bool = True
    """False for an assumed constant rate, which holds at every position (nothing is extrapolated)."""

    @classmethod
    def constant(cls, alpha: float) -> Acceptance:
        if not 0.0 <= alpha <= 1.0:
            raise VerispecError(f"--acceptance must be between 0 and 1, got {alpha}")
        return cls((alpha,), (1.0,), measured=False)

    @classmethod
    def from_counts(cls, drafted_at: Sequence[int], accepted_at: Sequence[int], passes: int) -> Acceptance:
        """From raw counts: accepted_at[i] / drafted_at[i] is P(positions 1..i+1 all accepted | drafted).

        The conditional a_i is the ratio of consecutive such cumulative rates (exactly
        accepted_at[i] / accepted_at[i-1] when every step drafted as deep).
        """
        conditional: list[float] = []
        reach: list[float] = []
        previous = 1.0
        for drafted, accepted in zip(drafted_at, accepted_at, strict=False):
            if drafted <= 0 or passes <= 0:
                break
            cumulative = accepted / drafted
            conditional.append(min(1.0, cumulative / previous) if previous > 0 else 0.0)
            reach.append(min(1.0, drafted / passes))
            previous = cumulative
        return cls(tuple(conditional), tuple(reach))

    def at(self, i: int) -> tuple[float, float]:
        """(a_i, r_i) for 1-based position i; past the known positions, the last known ones."""
        if not self.conditional:
            return 0.0, 0.0
        j = min(i, len(self.conditional)) - 1
        return self.conditional[j], self.reach[j]

    def extrapolated(self, k: int) -> bool:
        return self.measured and k > len(self.conditional)


@dataclass(frozen=True)
class Method:
    """A speculation method as the model sees it: its acceptance and what its proposals cost."""

    name: str
    acceptance: Acceptance
    draft_ms_per_token: float = 0.0
    """Paid for each drafted token (a draft model runs one forward per token)."""
    propose_ms_per_step: float = 0.0
    """Paid once per step, whatever k (an n-gram lookup)."""
    cost_source: str = ""


@dataclass(frozen=True)
class Prediction:
    method: str
    k: int
    """Draft tokens per step; 0 for plain decoding."""
    tau: float
    draft_ms: float
    verify_ms: float
    tokens_per_second: float
    speedup: float
    """Over plain decoding's predicted tokens/s."""
    extrapolated_acceptance: bool = False
    """k is deeper than the positions the acceptance was measured at."""
    extrapolated_cost: bool = False
    """k + 1 is beyond the largest k of the cost curve."""

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_ms": self.step_ms}


@dataclass(frozen=True)
class Plan:
    plain: Prediction
    rows: list[Prediction]
    best: Prediction | None
    """The fastest (method, k); None when nothing beats plain decoding: no speculation."""


def expected_tau(acceptance: Acceptance, k: int) -> float:
    """E[tau](k) = 1 + sum_{i<=k} r_i * prod_{j<=i} a_j."""
    tau, accepted_so_far = 1.0, 1.0
    for i in range(1, k + 1):
        a, r = acceptance.at(i)
        accepted_so_far *= a
        tau += r * accepted_so_far
    return tau


def plain_prediction(target: CostCurve) -> Prediction:
    ms = target.ms(1)
    return Prediction(PLAIN, 0, 1.0, 0.0, ms, 1000.0 / ms, 1.0)


def predict(method: Method, k: int, target: CostCurve) -> Prediction:
    """Expected tau, step time and tokens/s of ``method`` drafting up to ``k`` tokens per step."""
    verify = target.ms(1)
    draft = method.propose_ms_per_step
    for i in range(1, k + 1):
        _, r = method.acceptance.at(i)
        verify += r * (target.ms(i + 1) - target.ms(i))
        draft += r * method.draft_ms_per_token
    tau = expected_tau(method.acceptance, k)
    tps = 1000.0 * tau / (draft + verify)
    return Prediction(
        method=method.name,
        k=k,
        tau=tau,
        draft_ms=draft,
        verify_ms=verify,
        tokens_per_second=tps,
        speedup=tps / plain_prediction(target).tokens_per_second,
        extrapolated_acceptance=method.acceptance.extrapolated(k),
        extrapolated_cost=k + 1 > target.max_k,
    )


def make_plan(methods: Sequence[Method], target: CostCurve, ks: Iterable[int]) -> Plan:
    """Every method at every k; the best is the fastest, if faster than plain decoding."""
    ks = list(ks)
    plain = plain_prediction(target)
    rows = [predict(m, k, target) for m in methods for k in ks]
    best = max(rows, key=lambda p: p.tokens_per_second, default=None)  # first (smallest k) of equals
    if best is not None and best.tokens_per_second <= plain.tokens_per_second:
        best = None
    return Plan(plain, rows, best)


# ------------------------------------------------------------------- reading the measured files


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


@dataclass(frozen=True)
class Measured:
    """What a method did in the measured run, over the chosen group."""

    method: str
    k: int
    tokens_per_second: float
    """Spec-Bench's: mean over prompts of each prompt's tokens / wall time (prefill included)."""
    tau: float
    ms_per_step: float
    """Wall time over target forward passes (prefill and every overhead included)."""


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


def check(
    methods: Sequence[Method], target: CostCurve, measured: Sequence[Measured]
) -> list[tuple[Prediction, Measured]]:
    """The prediction for each measured method at the k it ran with, beside the measurement."""
    by_name = {m.name: m for m in methods}
    out = []
    for m in measured:
        if m.method == PLAIN:
            out.append((plain_prediction(target), m))
        elif m.method in by_name:
            out.append((predict(by_name[m.method], m.k, target), m))
    return out


# ------------------------------------------------------------------------- words and tables


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
