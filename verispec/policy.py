"""Speculation depth: how many draft tokens each sequence gets this step (0 = plain decoding).

Speculation spends compute that is idle at small batch sizes; as the batch grows, a verify token
competes with other users' tokens and a deep draft that is mostly rejected slows everyone down.
:class:`AdaptiveDepth` chooses, every step, one k per sequence to maximise the expected committed
tokens per second of the whole step:

    rate(k_1..k_n) = sum_i (1 + E[accepted_i | k_i]) / (T_target(sum_i (1 + k_i), sum_i (1 + k_i) c_i)
                                                        + T_draft(k_1..k_n))

where ``E[accepted | k] = sum_{j<=k} P(first j drafts accepted)`` comes from the sequence's own
per-position acceptance (:class:`AcceptanceEstimate`), ``T_target`` is the measured target forward
time for that many tokens in the batch, each attending to its sequence's ``c_i`` cached tokens, and
``T_draft`` the time of the draft model's batched
steps (zero for prompt lookup). See :mod:`verispec.costs` for the curves.

Token trees (Medusa, EAGLE) are sized the same way, after drafting: node j of a tree (best first)
adds ``P(node j accepted)`` to the expected committed tokens and one token to the forward, and the
drafter's own path probability, corrected by :class:`TreeCalibration`, estimates that probability
(the expected accepted length of a tree is the sum over its nodes). The same ascent then keeps, per
sequence, the best prefix of its tree that pays for its verify tokens (EAGLE-2's rerank with a
cost-aware budget instead of a fixed node count).

Exactness: the choice uses only what is known before this step's verification (past acceptance,
batch size, costs). A scheduler that looks at the realised target outcome (for example, verifying a
draft only when the target would accept it) biases the output; ``tests/test_policy.py`` shows
that counterexample (target (0.7, 0.3), draft (0.5, 0.5) becomes (0.85, 0.15)) next to the engine
staying exact with this policy.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from verispec.costs import CATCH_UP_HORIZON, StepCostModel

PRIOR_ACCEPTANCE = 0.8
"""Conditional acceptance assumed where nothing has been measured yet. Optimistic on purpose: a
pessimistic guess would keep a fresh engine from ever speculating, and so from ever measuring
(only verified drafts teach anything); measurements replace it within a few steps."""


class _Counts:
    """Discounted accept/try counts per draft position, shrunk toward a prior mean: recent steps
    weigh most, and a handful of outcomes cannot swing the estimate to 0 or 1."""

    def __init__(self, discount: float, strength: float) -> None:
        self.discount = discount
        self.strength = strength  # pseudo-observations the prior mean is worth
        self.hits: list[float] = []
        self.tries: list[float] = []

    def rate(self, position: int, prior: float) -> float:
        if position >= len(self.tries):
            return prior
        return (self.hits[position] + self.strength * prior) / (self.tries[position] + self.strength)

    def observe(self, drafted: int, accepted: int, forget_unreached: float = 1.0) -> None:
        """Count a verified draft; positions it did not reach forget by ``forget_unreached``."""
        outcomes = _outcomes(drafted, accepted)
        for j, hit in outcomes:
            while len(self.tries) <= j:
                self.hits.append(0.0)
                self.tries.append(0.0)
            self.hits[j] = self.discount * self.hits[j] + hit
            self.tries[j] = self.discount * self.tries[j] + 1.0
        if forget_unreached != 1.0:
            self.forget(forget_unreached, beyond=len(outcomes))

    def forget(self, factor: float, beyond: int = 0) -> None:
        """Scale down the counts of positions ``beyond`` and deeper (all by default)."""
        self.hits = [h * factor if j >= beyond else h for j, h in enumerate(self.hits)]
        self.tries = [t * factor if j >= beyond else t for j, t in enumerate(self.tries)]


class AcceptancePrior:
    """Engine-wide conditional acceptance per draft position, over every sequence.

    New sequences start from it, and a sequence whose speculation is paused drifts back to it, so
    a sequence that once drafted badly is tried again later rather than never. The prior itself
    drifts back to its mean (:data:`PRIOR_ACCEPTANCE`) over steps in which nothing drafted (:meth:`relax`):
    otherwise one rejected draft (0.8 -> 0.53 at strength 2) could price a draft model out for the
    rest of the process, since only verified drafts update it (on Spec-Bench one k = 2 rejection
    on the first prompt once meant no draft in 900 steps; docs/design.md#acceptance-prior).
    """

    def __init__(self, forget: float = 0.97, mean: float = PRIOR_ACCEPTANCE) -> None:
        self.counts = _Counts(discount=0.98, strength=2.0)
        self.forget_factor = forget
        self.mean = mean

    def at(self, position: int) -> float:
        return self.counts.rate(position, self.mean)

    def observe(self, drafted: int, accepted: int) -> None:
        self.counts.observe(drafted, accepted, forget_unreached=self.forget_factor)

    def relax(self) -> None:
        """A step in which no sequence drafted: forget a little (half-life ~23 such steps)."""
        self.counts.forget(self.forget_factor)


class AcceptanceEstimate:
    """One sequence's conditional acceptance per draft position: P(draft j accepted | j-1 were)."""

    def __init__(self, prior: AcceptancePrior, forget: float = 0.9) -> None:
        self.prior = prior
        self.forget_factor = forget
        self.counts = _Counts(discount=0.9, strength=2.0)

    def at(self, position: int) -> float:
        """P(draft ``position`` accepted | the ones before were). A position never drafted to yet,
        by this sequence or any other, takes the deepest measured position's rate rather than
        :data:`PRIOR_ACCEPTANCE`: conditional acceptance changes little with depth, and with the
        fixed prior behind a measured 0.95 a draft model costing half a target step was kept at
        k = 1, so the deeper positions that would have paid were never measured."""
        known = max(len(self.counts.tries), len(self.prior.counts.tries))
        position = min(position, known - 1) if known else position
        return self.counts.rate(position, self.prior.at(position))

    def observe(self, drafted: int, accepted: int) -> None:
        """Record a verified draft of ``drafted`` tokens of which the first ``accepted`` were kept.

        Positions this draft did not reach forget a little, as on a step without speculation: else
        one rejection at depth 2 kept a draft model at k = 1 for good (depth 2 then never measured
        again: on HumanEval 982 of 1012 steps at k = 1 with 91% accepted at depth 1)."""
        self.counts.observe(drafted, accepted, forget_unreached=self.forget_factor)

    def relax(self) -> None:
        """A step without speculation: forget a little, drifting toward the engine-wide prior."""
        self.counts.forget(self.forget_factor)

    def survival(self, k: int) -> list[float]:
        """P(the first j drafts are all accepted) for j = 1..k."""
        out, p = [], 1.0
        for j in range(k):
            p *= self.at(j)
            out.append(p)
        return out


class TreeCalibration:
    """How a drafter's path probabilities compare with what verification accepts.

    A drafter trained on little data is over- or under-confident; the ratio of accepted nodes to
    the probability mass it predicted for the trees it submitted (discounted, so it follows drift,
    and shrunk toward 1 by ``strength`` pseudo-observations) rescales its probabilities into the
    node gains the policy prices.
    """

    def __init__(self, decay: float = 0.98, strength: float = 4.0) -> None:
        self.decay = decay
        self.strength = strength
        self.accepted = 0.0
        self.predicted = 0.0

    @property
    def factor(self) -> float:
        return (self.accepted + self.strength) / (self.predicted + self.strength)

    def observe(self, predicted: float, accepted: int) -> None:
        """One verified tree: the summed path probabilities of its nodes and the nodes accepted."""
        self.accepted = self.accepted * self.decay + accepted
        self.predicted = self.predicted * self.decay + predicted

    def gains(self, scores: Sequence[float]) -> list[float]:
        """Expected accepted tokens each node adds: calibrated path probabilities, capped at 1."""
        factor = self.factor
        return [min(1.0, factor * math.exp(score)) for score in scores]


def _outcomes(drafted: int, accepted: int) -> list[tuple[int, float]]:
    """(position, 1.0 accepted / 0.0 rejected) for the positions verified conditional on the ones
    before being accepted: every accepted one and the first rejected one."""
    return [(j, 1.0) for j in range(accepted)] + ([(accepted, 0.0)] if accepted < drafted else [])


@dataclass(frozen=True)
class DepthQuery:
    """What the policy knows about one sequence before this step's verification."""

    cap: int
    """Most draft tokens allowed: the request's maximum, cut by the tokens it may still generate;
    0 when the request turned speculation off."""
    survival: Sequence[float]
    """P(the first j drafts are all accepted), j = 1..cap, from past steps only; for a drafted tree,
    the calibrated probability that its j-th best node is accepted."""
    context: int = 0
    """Tokens in the sequence's cache: what each of its query tokens attends to."""
    backlog: int = 0
    """Tokens the proposer must catch up on before drafting (a draft model that sat out steps, or
    was not given the prompt)."""
    remaining: int | None = None
    """Tokens the request may still generate: the catch-up is spread over the steps they take
    (None: over :data:`~verispec.costs.CATCH_UP_HORIZON` steps)."""

    def catch_up_horizon(self) -> float:
        """Steps left to win a catch-up back: the remaining tokens over the tokens a step commits
        when speculating at the cap (1 + the expected accepted drafts)."""
        if self.remaining is None:
            return CATCH_UP_HORIZON
        return max(1.0, self.remaining / (1.0 + sum(self.survival[: self.cap])))


class DepthPolicy(ABC):
    """Chooses k for every sequence of a step."""

    name: str

    def __init__(self, disable_by_batch_size: int | None = None) -> None:
        self.disable_by_batch_size = disable_by_batch_size

    def disabled(self, batch_size: int) -> bool:
        """Speculation is off for a batch this large (vLLM's --speculative-disable-by-batch-size)."""
        return self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size

    def choose(self, queries: Sequence[DepthQuery]) -> list[int]:
        if self.disabled(len(queries)):
            return [0] * len(queries)
        return self._choose(queries)

    @abstractmethod
    def _choose(self, queries: Sequence[DepthQuery]) -> list[int]: ...

    def node_gain_floor(self, contexts: Sequence[int], nodes: int) -> float:
        """A gain (expected accepted tokens) below which no draft node of this step can be worth
        verifying, for a batch of sequences with these cache lengths whose trees have at most
        ``nodes`` nodes each. A tree proposer need not expand a node below it (0: no floor)."""
        return 0.0


class FixedDepth(DepthPolicy):
    """Always the maximum k (the classic fixed-k speculative decoding)."""

    name = "fixed"

    def _choose(self, queries: Sequence[DepthQuery]) -> list[int]:
        return [q.cap for q in queries]


class AdaptiveDepth(DepthPolicy):
    """Per-sequence k maximising the step's expected committed tokens per second (module docstring)."""

    name = "adaptive"

    def __init__(self, costs: StepCostModel, disable_by_batch_size: int | None = None) -> None:
        super().__init__(disable_by_batch_size)
        self.costs = costs

    def _choose(self, queries: Sequence[DepthQuery]) -> list[int]:
        """Greedy ascent: repeatedly apply the single move "sequence i drafts m more tokens" that
        raises the rate most. Moves of several tokens at once get past a draft model's fixed
        per-step cost, which no one-token move pays back on its own."""
        ks = [0] * len(queries)
        tokens = len(queries)
        keys = float(sum(q.context for q in queries))  # query x key work of the plain step
        rows_at = [0] * (max((q.cap for q in queries), default=0) + 1)  # rows drafting at step j
        gain = float(len(queries))
        draft_s = 0.0
        rate = gain / (self.costs.target_seconds(tokens, keys) + draft_s)
        while True:
            best: tuple[float, int, int, float, float] | None = None
            for i, q in enumerate(queries):
                extra_gain, extra_draft = 0.0, 0.0
                if ks[i] == 0:  # speculating at all first means catching the draft model up
                    extra_draft += self.costs.draft_catch_up_seconds(q.backlog, q.catch_up_horizon())
                for m in range(1, q.cap - ks[i] + 1):
                    level = ks[i] + m  # the draft step this token needs
                    extra_gain += q.survival[level - 1]
                    extra_draft += self.costs.draft_step_seconds(rows_at[level] + 1) - (
                        self.costs.draft_step_seconds(rows_at[level]) if rows_at[level] else 0.0
                    )
                    extra_keys = m * q.context
                    seconds = self.costs.target_seconds(tokens + m, keys + extra_keys) + draft_s + extra_draft
                    candidate = (gain + extra_gain) / seconds
                    if candidate > rate * (1 + 1e-9) and (best is None or candidate > best[0]):
                        best = (candidate, i, m, extra_gain, extra_draft)
            if best is None:
                return ks
            rate, i, m, extra_gain, extra_draft = best
            for level in range(ks[i] + 1, ks[i] + m + 1):
                rows_at[level] += 1
            ks[i] += m
            tokens += m
            keys += m * queries[i].context
            gain += extra_gain
            draft_s += extra_draft

    def node_gain_floor(self, contexts: Sequence[int], nodes: int) -> float:
        """The least gain per verify token at which any move from plain decoding pays:
        ``min over m of B * (T(B + m) / T(B) - 1) / m`` for a batch of B sequences (each commits one
        token at plain cost T(B)), m up to every tree's nodes. A kept set of nodes must average at
        least this much; a node below it could only ride along with better ones where the cost curve
        is flat, so this is a heuristic bound, not an exact one. It only ever shrinks what is
        drafted, from costs and past steps, so it cannot bias the output (for one sequence on the
        1.5B int4 path it is about 0.2; docs/design.md#node-gain-floor)."""
        if not contexts or nodes < 1:
            return 0.0
        tokens, keys = len(contexts), float(sum(contexts))
        mean = keys / tokens
        plain = self.costs.target_seconds(tokens, keys)
        return min(
            tokens * (self.costs.target_seconds(tokens + m, keys + m * mean) / plain - 1.0) / m
            for m in range(1, len(contexts) * nodes + 1)
        )


def make_policy(
    name: str, costs: StepCostModel | None, disable_by_batch_size: int | None = None
) -> DepthPolicy:
    """The policy for ``--depth-policy``: 'adaptive' (needs measured costs) or 'fixed'."""
    if name == "fixed":
        return FixedDepth(disable_by_batch_size)
    if name == "adaptive":
        if costs is None:
            raise ValueError("the adaptive depth policy needs a cost model")
        return AdaptiveDepth(costs, disable_by_batch_size)
    raise ValueError(f"unknown depth policy {name!r}; choose adaptive or fixed")
