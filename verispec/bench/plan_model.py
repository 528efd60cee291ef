"""The model behind ``verispec plan``: expected tokens/s of each method at each depth k.

Why a model: speculation pays only when the tokens a step commits outweigh what the step costs, and
both sides depend on things a user can measure once: the machine (the verify-cost curve of
``verispec bench forward``) and the text (acceptance from ``verispec bench``). Combining them
predicts every k without running every k, and comparing the prediction with a measured run says how
far to trust it. Everything here is pure arithmetic on those two files' contents (no I/O, no model);
reading the files is :mod:`verispec.bench.plan`'s, the words and tables :mod:`verispec.bench.plan_report`'s.

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

from verispec.bench.settings import PLAIN
from verispec.errors import VerispecError


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
