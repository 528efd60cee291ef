"""Depth policy: what k it picks, how acceptance is learned, and that no choice biases the output."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

from tests.stats import chi_square
from verispec.config import SamplingConfig, SpecConfig
from verispec.costs import Curve, StepCostModel, load_costs_file
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.models.base import BatchOutput, ForwardOutput
from verispec.models.kv import KVBuffer
from verispec.policy import (
    PRIOR_ACCEPTANCE,
    AcceptanceEstimate,
    AcceptancePrior,
    AdaptiveDepth,
    DepthQuery,
    FixedDepth,
    TreeCalibration,
)
from verispec.proposers.base import Proposer
from verispec.types import Draft
from verispec.verify import verify

FLAT = StepCostModel(Curve((1, 64), (0.100, 0.110)))
"""Memory-bound: checking 64 tokens costs 10% more than one."""
LINEAR = StepCostModel(Curve((1, 64), (0.010, 0.640)))
"""Compute-bound: every token costs the same."""
SATURATING = StepCostModel(Curve((1, 8, 16, 128), (0.070, 0.085, 0.130, 1.0)))
"""Like the int8 1.5B here: flat up to ~8 tokens, then linear."""


def query(cap: int, rate: float) -> DepthQuery:
    return DepthQuery(cap=cap, survival=[rate ** (j + 1) for j in range(cap)])


def test_fixed_depth_and_the_batch_size_cut_off():
    assert FixedDepth().choose([query(5, 0.1), query(3, 0.9), query(0, 0.9)]) == [5, 3, 0]
    policy = FixedDepth(disable_by_batch_size=3)
    assert policy.choose([query(5, 0.9)] * 2) == [5, 5]
    assert policy.choose([query(5, 0.9)] * 3) == [0, 0, 0]


def test_adaptive_goes_deep_when_verifying_is_nearly_free_and_drafts_are_good():
    assert AdaptiveDepth(FLAT).choose([query(8, 0.9)]) == [8]


def test_adaptive_does_not_speculate_when_every_token_costs_the_same():
    # Each draft token costs a full token's time and is accepted less than always: never worth it.
    assert AdaptiveDepth(LINEAR).choose([query(8, 0.9), query(8, 0.5)]) == [0, 0]


def test_adaptive_gets_shallower_as_the_batch_grows_and_favours_good_sequences():
    policy = AdaptiveDepth(SATURATING)
    alone = policy.choose([query(8, 0.8)])[0]
    crowded = policy.choose([query(8, 0.8)] * 16)
    assert alone > 0
    assert max(crowded) < alone
    mixed = policy.choose([query(8, 0.95)] * 2 + [query(8, 0.3)] * 2)
    assert mixed[0] > mixed[2]


def test_adaptive_respects_each_cap_and_pays_for_a_draft_model():
    policy = AdaptiveDepth(FLAT)
    assert policy.choose([query(2, 0.99), query(0, 0.99)]) == [2, 0]
    # Free drafts (prompt lookup) pay even at 10% acceptance when verifying is nearly free; a draft
    # model whose step costs a fifth of a target forward does not, but pays at 99%.
    assert policy.choose([query(6, 0.1)])[0] > 0
    with_draft = StepCostModel(Curve((1, 64), (0.100, 0.110)), draft=Curve((1, 16), (0.020, 0.030)))
    assert AdaptiveDepth(with_draft).choose([query(6, 0.1)]) == [0]
    assert AdaptiveDepth(with_draft).choose([query(6, 0.99)]) == [6]


def test_node_gain_floor_is_the_least_average_gain_a_move_from_plain_needs():
    """One sequence on the saturating curve: one more token costs 0.070 -> ~0.072 s, so a node
    needs little gain; on the linear curve every token costs as much as a sequence's plain step, so
    a node must be certain (gain 1), alone or in a batch. The fixed policy has no floor. The
    adaptive policy keeps no node below it, here on trees of scored nodes."""
    assert FixedDepth().node_gain_floor([100], 8) == 0.0
    saturating = AdaptiveDepth(SATURATING).node_gain_floor([0], 8)
    averages = [(SATURATING.target_seconds(1 + m) / 0.070 - 1) / m for m in range(1, 9)]
    assert saturating == pytest.approx(min(averages))
    assert 0.0 < saturating < 0.05
    linear = AdaptiveDepth(LINEAR)
    assert linear.node_gain_floor([0], 8) == pytest.approx(1.0)
    assert linear.node_gain_floor([0, 0], 8) == pytest.approx(1.0)
    mixed = StepCostModel(Curve((1, 2, 4, 16), (0.040, 0.050, 0.062, 0.160)))
    policy = AdaptiveDepth(mixed)
    floor = policy.node_gain_floor([0], 6)
    for gains in ([0.9, 0.5, 0.3, 0.2, 0.1, 0.05], [0.3, 0.29, 0.2, 0.2, 0.15, 0.1], [0.6] * 6):
        (kept,) = policy.choose([DepthQuery(cap=6, survival=gains)])
        assert all(g >= floor for g in gains[:kept]), (gains, kept, floor)


def test_acceptance_estimate_learns_forgets_and_starts_from_the_prior():
    prior = AcceptancePrior()
    seq = AcceptanceEstimate(prior)
    assert seq.survival(2) == pytest.approx([PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE**2])
    for _ in range(20):
        seq.observe(drafted=4, accepted=0)  # always rejected at the first position
    assert seq.at(0) < 0.2
    assert seq.at(1) == seq.at(0)  # never reached by anyone: the deepest measured position's rate
    low = seq.at(0)
    for _ in range(30):
        seq.relax()
    assert low < seq.at(0) <= prior.at(0) + 1e-9  # drifts back, so it is tried again


def test_one_rejection_does_not_price_a_draft_model_out_for_good():
    """On Spec-Bench, one rejected k = 2 draft dropped the engine-wide prior to 0.53, below
    the int4 pair's break-even; nothing drafted again, so nothing could raise it. Steps without any
    draft now relax the prior back toward :data:`PRIOR_ACCEPTANCE`, so the pair is tried again."""
    int4_pair = StepCostModel(
        Curve((1, 2, 4, 8, 16), (0.0403, 0.0431, 0.0521, 0.0818, 0.1518)),
        draft=Curve((1, 2, 4, 8, 16), (0.0211, 0.0224, 0.0273, 0.0376, 0.0641)),
    )
    policy = AdaptiveDepth(int4_pair)
    prior = AcceptancePrior()

    def new_sequence_depth() -> int:
        survival = AcceptanceEstimate(prior).survival(5)
        return policy.choose([DepthQuery(cap=5, survival=survival, context=200)])[0]

    assert new_sequence_depth() > 0
    prior.observe(drafted=2, accepted=0)
    assert prior.at(0) < 0.55
    assert new_sequence_depth() == 0
    steps = 0
    while new_sequence_depth() == 0:
        prior.relax()
        steps += 1
        assert steps < 200, prior.at(0)
    assert steps >= 5  # not at once: a draft that keeps failing is retried rarely
    assert prior.at(0) <= PRIOR_ACCEPTANCE


def test_a_depth_the_policy_stopped_drafting_to_is_tried_again():
    """One rejection at depth 2 makes k = 1 look best; drafting at k = 1 never measures depth 2, so
    without forgetting it stayed at k = 1 for good. Unreached positions now drift back toward the
    prior, and the policy goes deeper again once depth 1 keeps being accepted."""
    costs = StepCostModel(Curve((1, 64), (0.100, 0.110)), draft=Curve((1, 16), (0.040, 0.070)))
    policy = AdaptiveDepth(costs)
    prior = AcceptancePrior()
    seq = AcceptanceEstimate(prior)
    for counts in (seq, prior):
        counts.observe(2, 1)  # the second draft token rejected
    assert policy.choose([DepthQuery(cap=3, survival=seq.survival(3))]) == [1]
    low = seq.at(1)
    for _ in range(30):  # k = 1, always accepted
        for counts in (seq, prior):
            counts.observe(1, 1)
    assert seq.at(1) > low + 0.2
    assert policy.choose([DepthQuery(cap=3, survival=seq.survival(3))])[0] >= 2


def test_a_well_predicted_sequence_is_drafted_deeper_than_it_was_ever_measured():
    """Measured only at depth 1 (0.95 accepted), a draft model costing half a target step must be
    taken past k = 1, or depth 2 would never be measured. With the fixed prior (0.8) assumed at the
    unmeasured depths, the policy stayed at k = 1 (int4 Qwen pair)."""
    int4_pair = StepCostModel(  # as measured by the engine for that pair
        Curve((1, 2, 4, 8, 16), (0.0403, 0.0431, 0.0521, 0.0818, 0.1518)),
        draft=Curve((1, 2, 4, 8, 16), (0.0211, 0.0224, 0.0273, 0.0376, 0.0641)),
    )
    seq = AcceptanceEstimate(AcceptancePrior())
    for _ in range(20):
        seq.observe(drafted=1, accepted=1)
    assert seq.at(0) > 0.9 and seq.at(2) == seq.at(0)
    ks = AdaptiveDepth(int4_pair).choose([DepthQuery(cap=5, survival=seq.survival(5), context=200)])
    assert ks[0] >= 3
    fixed_prior = [seq.at(0) * PRIOR_ACCEPTANCE**j for j in range(5)]  # the old assumption
    assert AdaptiveDepth(int4_pair).choose([DepthQuery(cap=5, survival=fixed_prior, context=200)]) == [1]


def test_cost_model_corrects_its_scale_from_observed_steps():
    costs = StepCostModel(Curve((1, 8), (0.1, 0.2)))
    assert costs.target_seconds(4) == pytest.approx(0.1 + 0.1 * 3 / 7)
    for _ in range(100):
        costs.observe_target(1, 0.2)  # the machine is twice as slow as measured
    assert costs.target_seconds(1) == pytest.approx(0.2, rel=0.01)
    assert costs.draft_step_seconds(3) == 0.0  # no draft model


def test_each_token_count_learns_its_own_cost_and_more_tokens_never_look_cheaper():
    """The start-up curve said 4 tokens cost 1.33x one; in the engine they cost 1.83x (AVX2 int4).
    One scale for every count cannot learn that; one per count does."""
    costs = StepCostModel(Curve((1, 2, 4, 8), (0.040, 0.046, 0.053, 0.090)))
    for _ in range(60):
        costs.observe_target(1, 0.040)
        costs.observe_target(4, 0.073)
    assert costs.target_seconds(1) == pytest.approx(0.040, rel=0.02)
    assert costs.target_seconds(4) == pytest.approx(0.073, rel=0.02)
    for _ in range(60):
        costs.observe_target(5, 0.050)  # a noisy count: measured cheaper than 4 tokens
    assert costs.target_seconds(5) >= costs.target_seconds(4)
    assert costs.target_seconds(6) >= costs.target_seconds(5)  # unobserved: global scale, floored
    # the depth policy then stops paying 1.83x for an expected 1.6 tokens
    survival = [0.4, 0.16, 0.064, 0.026, 0.01]
    assert AdaptiveDepth(costs).choose([DepthQuery(cap=5, survival=survival)]) in ([0], [1])


def test_start_up_curve_is_timed_round_robin_so_a_slow_spell_falls_on_every_point(monkeypatch):
    """A model slow for its first calls after loading (here: the first 10 forwards cost 30 ms more)
    must not make the first-measured count look dear, or a verify looks cheap next to it."""
    from verispec import costs as costs_module

    clock = [0.0]
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock[0])

    class SlowStart:
        vocab_size = 50
        max_context = 1 << 20
        calls = 0

        def new_cache(self) -> KVBuffer:
            return KVBuffer()

        def forward(self, input_ids: torch.Tensor, cache: KVBuffer, **_: object) -> None:
            cache.advance(input_ids.shape[1])

        def forward_batch(self, caches, tokens, **_: object) -> None:
            SlowStart.calls += 1
            clock[0] += 0.001 * sum(len(t) for t in tokens) + (0.030 if SlowStart.calls <= 10 else 0.0)
            for cache, row in zip(caches, tokens, strict=True):
                cache.advance(len(row))

    curve = costs_module.measure_target(SlowStart(), repeats=3)  # type: ignore[arg-type]
    assert curve.seconds == pytest.approx(tuple(0.001 * t for t in curve.xs))


# --------------------------------------------------------------------- exactness under any schedule

P_TARGET = torch.tensor([0.7, 0.3])
Q_DRAFT = torch.tensor([0.5, 0.5])


class ConstantModel:
    """A 'model' whose next-token distribution is always P_TARGET, whatever the context."""

    name = "constant"
    vocab_size = 2
    hidden_size = 1
    max_context = 1 << 20
    device = torch.device("cpu")
    eos_token_ids: frozenset[int] = frozenset()

    def new_cache(self) -> KVBuffer:
        return KVBuffer()

    def forward(self, input_ids: torch.Tensor, cache: KVBuffer, **_: object) -> ForwardOutput:
        out = self.forward_batch([cache], [input_ids[0].tolist()], logits_to_keep=[1])
        return ForwardOutput(logits=out.logits[0].unsqueeze(0))

    def forward_batch(
        self, caches: Sequence[KVBuffer], tokens: Sequence[Sequence[int]], *, logits_to_keep, **_: object
    ) -> BatchOutput:
        for cache, row in zip(caches, tokens, strict=True):
            cache.advance(len(row))
        return BatchOutput(logits=[P_TARGET.log().expand(k, 2).clone() for k in logits_to_keep])


class CoinProposer(Proposer):
    """Drafts from Q_DRAFT, with its probabilities (so rejection sampling applies)."""

    name = "coin"

    def new_state(self, prompt_ids, sampling):
        return torch.Generator().manual_seed(sampling.seed or 0)

    def propose(self, state, token_ids, k):
        tokens = torch.multinomial(Q_DRAFT, k, replacement=True, generator=state)
        return Draft.chain(tokens, Q_DRAFT.expand(k, 2).clone())

    def update(self, state, token_ids, num_accepted, hidden=None):
        pass


def test_a_look_ahead_scheduler_biases_the_output():
    """DSpark's counterexample: verifying a draft only when the target will surely accept it (a
    decision that reads the target's probabilities, i.e. the verification outcome) turns the target's
    (0.7, 0.3) into (0.85, 0.15). The test harness catches it, so the next test's pass means something."""
    sampling = SamplingConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(2)
    for _ in range(4000):
        x = int(torch.multinomial(Q_DRAFT, 1, generator=gen))
        anticipating = P_TARGET[x] >= Q_DRAFT[x]  # peeks at the target: not allowed
        draft = Draft.chain(torch.tensor([x]), Q_DRAFT.unsqueeze(0)) if anticipating else Draft.empty()
        result = verify(draft, P_TARGET.log().expand(draft.size + 1, 2), sampling, gen)
        counts[result.tokens[0]] += 1
    assert chi_square(counts, torch.tensor([0.85, 0.15]))[1] > 1e-3
    assert chi_square(counts, P_TARGET)[1] < 1e-9


class HistoryPolicy(FixedDepth):
    """Non-anticipating but history-driven: speculates only after a step that accepted a draft
    (so whether a position is verified depends on earlier outcomes, never on its own)."""

    def __init__(self, engine_ref: list[SpecEngine]) -> None:
        super().__init__()
        self.engine_ref = engine_ref

    def _choose(self, queries):
        seqs = self.engine_ref[0].running
        return [q.cap if s.stats.num_accepted % 2 == 0 else 0 for q, s in zip(queries, seqs, strict=True)]


@pytest.mark.parametrize("policy_name", ["adaptive", "history"])
def test_the_engine_stays_exact_whatever_the_depth_schedule(policy_name):
    """Target (0.7, 0.3), draft (0.5, 0.5): every committed token must follow (0.7, 0.3), with k
    changing from step to step (the adaptive policy on costs where k matters; a history-driven one)."""
    spec = SpecConfig(
        method="ngram", num_speculative_tokens=3, depth="adaptive" if policy_name == "adaptive" else "fixed"
    )
    engine = SpecEngine(ConstantModel(), CoinProposer(), spec, costs=SATURATING)  # type: ignore[arg-type]
    if policy_name == "history":
        engine.policy = HistoryPolicy([engine])
    for seed in range(8):
        engine.add(engine.make_request([0], max_new_tokens=500, temperature=1.0, seed=seed))
    tokens, stats = [], []
    while engine.has_work():
        for out in engine.step():
            tokens += [e.token_id for e in out.events]
            stats += [e.stats for e in out.events if e.stats is not None]
    assert len(tokens) == 8 * 500 and len(stats) == 8
    counts = torch.bincount(torch.tensor(tokens), minlength=2)
    drafted = sum(s.num_drafted for s in stats)
    steps = sum(s.num_steps for s in stats)
    accepted = sum(s.num_accepted for s in stats)
    assert drafted > 0 and accepted > 0  # speculation really happened...
    assert drafted < 3 * steps  # ...at varying depth
    assert chi_square(counts, P_TARGET)[1] > 1e-4


def test_costs_load_from_a_bench_forward_file_and_stay_monotone(tmp_path):
    def points(*pairs: tuple[int, float]) -> list[dict[str, float]]:
        return [{"k": k, "median_ms": ms} for k, ms in pairs]

    forward = {
        "schema": "verispec-bench-forward/1",
        "curves": [
            {"role": "target", "model": "t", "points": points((1, 70.0), (2, 60.0), (8, 85.0))},
            {"role": "draft", "model": "d", "points": points((1, 30.0), (4, 40.0))},
        ],
    }
    path = tmp_path / "forward.json"
    path.write_text(json.dumps(forward))
    costs = load_costs_file(path)
    assert costs.target_seconds(1) == pytest.approx(0.060)  # a slowed-down measurement is capped by
    assert costs.target_seconds(2) == pytest.approx(0.060)  # the cheaper one at a larger count
    assert costs.target_seconds(8) == pytest.approx(0.085)
    assert costs.draft_step_seconds(1) == pytest.approx(0.030)
    cached = tmp_path / "cached.json"
    cached.write_text(json.dumps(costs.to_dict()))
    assert load_costs_file(cached).target_seconds(8) == pytest.approx(0.085)
    path.write_text("{}")
    with pytest.raises(VerispecError, match="neither"):
        load_costs_file(path)


def test_long_contexts_make_extra_draft_tokens_dearer():
    """The same acceptance and batch, but 2000 cached tokens per sequence: attention makes each
    extra query token cost 2000 keys' work, so the policy drafts less."""
    costs = StepCostModel(Curve((1, 64), (0.020, 0.030)), per_key=2e-6)
    policy = AdaptiveDepth(costs)
    short = policy.choose([DepthQuery(cap=6, survival=[0.5 ** (j + 1) for j in range(6)], context=100)] * 4)
    long = policy.choose([DepthQuery(cap=6, survival=[0.5 ** (j + 1) for j in range(6)], context=2000)] * 4)
    assert sum(long) < sum(short)
    assert costs.target_seconds(2, key_queries=1000) == pytest.approx(0.020 + 0.010 / 63 + 0.002)


def test_a_draft_model_far_behind_must_pay_to_catch_up_first():
    """A sequence whose draft model sat out many steps must feed it the missed tokens before
    drafting: with 5000 of them, a draft that would otherwise pay does not."""
    costs = StepCostModel(Curve((1, 64), (0.100, 0.110)), draft=Curve((1, 16), (0.020, 0.060)))
    good = [0.9 ** (j + 1) for j in range(5)]
    policy = AdaptiveDepth(costs)
    assert policy.choose([DepthQuery(cap=5, survival=good, backlog=2)])[0] > 0
    assert policy.choose([DepthQuery(cap=5, survival=good, backlog=5000)]) == [0]
    assert costs.draft_catch_up_seconds(2) == 0.0


def test_a_catch_up_is_won_back_only_over_the_tokens_left():
    """The same 1500-token backlog and good acceptance: worth catching up on with 400 tokens left,
    not with 8; the one-time cost is priced with the measured prefill curve, spread over the steps
    the remaining tokens take at the sequence's expected accepted length."""
    costs = StepCostModel(
        Curve((1, 64), (0.100, 0.110)),
        draft=Curve((1, 16), (0.020, 0.060)),
        draft_prefill=Curve((1, 16, 512), (0.020, 0.030, 0.800)),
    )
    good = [0.8 ** (j + 1) for j in range(4)]
    policy = AdaptiveDepth(costs)
    assert policy.choose([DepthQuery(cap=4, survival=good, backlog=1500, remaining=400)])[0] > 0
    assert policy.choose([DepthQuery(cap=4, survival=good, backlog=1500, remaining=8)]) == [0]
    caught_up = DepthQuery(cap=4, survival=good, backlog=2, remaining=8)
    assert policy.choose([caught_up])[0] > 0
    query = DepthQuery(cap=2, survival=[0.8, 0.64, 0.5], remaining=244)
    assert query.catch_up_horizon() == pytest.approx(100.0)  # 244 tokens at 2.44 per step
    once = (0.800 + (1500 - 512) * 0.770 / 496) - (0.020 + 0.010 / 15)  # prefill(1500) - prefill(2)
    assert costs.draft_catch_up_seconds(1500, horizon=10) == pytest.approx(once / 10)
    rows_priced = StepCostModel(costs.target, draft=costs.draft)  # no prefill curve: one-token rows
    assert rows_priced.draft_catch_up_seconds(1500, 10) > costs.draft_catch_up_seconds(1500, 10)


def test_the_draft_prefill_curve_is_measured_and_cached(tiny_target, tiny_draft, tmp_path):
    from verispec.costs import PREFILL_TOKENS, load_or_measure

    measured = load_or_measure(tiny_target, tiny_draft, tmp_path, repeats=1)
    assert measured.draft_prefill is not None and measured.draft_prefill.xs == PREFILL_TOKENS
    assert measured.draft_prefill(512) >= measured.draft_prefill(1) > 0
    (cached,) = tmp_path.iterdir()
    assert load_or_measure(tiny_target, tiny_draft, tmp_path).draft_prefill == measured.draft_prefill
    assert cached.name.endswith("-v4.json")  # older files (no 17- and 33-token points) are measured again
    assert load_or_measure(tiny_target, None, tmp_path / "plain", repeats=1).draft_prefill is None


def test_tree_calibration_learns_how_confident_the_drafter_really_is():
    calibration = TreeCalibration()
    assert calibration.factor == 1.0 and calibration.gains([0.0, -0.7]) == pytest.approx(
        [1.0, 0.4966], abs=1e-3
    )
    for _ in range(200):  # the drafter predicts 4 accepted nodes per tree, verification keeps 1
        calibration.observe(predicted=4.0, accepted=1)
    steady = (1 / 0.02 + 4) / (4 / 0.02 + 4)  # discounted sums at decay 0.98, plus the prior's 4
    assert calibration.factor == pytest.approx(steady, rel=0.01) and 0.25 < steady < 0.27
    assert calibration.gains([0.0, -0.7]) == pytest.approx([steady, steady / 2], rel=0.01)


def test_tree_nodes_are_kept_while_their_gain_pays_for_their_verify_token():
    gains = [0.9, 0.6, 0.3, 0.1, 0.05, 0.02]
    query = DepthQuery(cap=len(gains), survival=gains, context=10)
    assert AdaptiveDepth(FLAT).choose([query]) == [6]  # memory-bound: every node is nearly free
    assert AdaptiveDepth(LINEAR).choose([query]) == [0]  # a node costs a token's forward, gains < 1
    costs = StepCostModel(Curve((1, 8), (0.1, 0.2)))  # each verify token costs 14% of a step
    kept = AdaptiveDepth(costs).choose([query])[0]
    rate = lambda m: (1 + sum(gains[:m])) / costs.target_seconds(1 + m, 10 * (1 + m))  # noqa: E731
    assert kept == max(range(7), key=rate) == 3  # the best prefix: nodes worth their token


def test_measured_costs_are_keyed_by_the_int4_kernel_build(tiny_target, monkeypatch):
    """Step costs are cached per model; a changed int4 kernel must be measured again, not priced
    with the old kernel's curve (the policy would pick depths for the wrong costs)."""
    from verispec import costs
    from verispec.models import int4

    monkeypatch.setattr(tiny_target, "quantization", "int4", raising=False)
    monkeypatch.setattr(int4, "kernel_key", lambda: "aaaaaaaaaaaaaaaa")
    before = costs._identity(tiny_target, None)
    monkeypatch.setattr(int4, "kernel_key", lambda: "bbbbbbbbbbbbbbbb")
    assert costs._identity(tiny_target, None) != before


def test_measured_costs_are_keyed_by_the_kind_of_lm_head(tiny_target, monkeypatch):
    """An int4 LM head (AVX2 CPUs, or ``VERISPEC_INT4_LM_HEAD``) prices rows other than an int8 one."""
    from verispec import costs
    from verispec.models import int4

    if not int4.cpu_supports_int4():
        pytest.skip("the int4 kernel needs AVX2 or AVX-512 VNNI")
    monkeypatch.setattr(tiny_target, "quantization", "int4", raising=False)
    before = costs._identity(tiny_target, None)
    head = int4.Int4Linear.from_linear(torch.nn.Linear(64, 96, bias=False))
    monkeypatch.setattr(tiny_target, "lm_head", head)
    assert costs._identity(tiny_target, None) != before
