"""Statistical exactness of the whole engine: speculative sampling reproduces the target's own sampling.

tests/verify/test_rejection.py proves the verifier on synthetic distributions. Here everything runs
for real on tiny random Llamas: the draft model proposer with its own KV cache and sampler, the
target's forward over the draft, verification, the rollback of both caches and the commit. The
reference, exact and computed without the engine, is :mod:`tests.distribution`'s. A deliberately
wrong verifier must fail the same check, so the check is known to have power.
"""

from __future__ import annotations

import pytest

from tests.conftest import make_engine, perturbed
from tests.distribution import (
    ALPHA,
    SEEDS,
    assert_follows_target,
    describe,
    distribution_checks,
    exact_joint,
    generate_all,
)
from tests.tree_proposer import TopTwoTree
from tests.wrong_verifiers import Mistake, on_logits, wrong_verifier
from verispec.config import SamplingConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.models.hf import HFCausalLM
from verispec.penalties import Penalties
from verispec.types import Draft

DRAFT_NOISE = 0.6  # the first draft token is accepted ~60-70% of the time, later ones less often

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small_vocab_draft(small_vocab_target: HFCausalLM) -> HFCausalLM:
    """The draft model proposer's model: the target with noise, so drafts are often but not always right."""
    return HFCausalLM(perturbed(small_vocab_target.model, DRAFT_NOISE, seed=1), name="tiny-draft-12")


SPECULATIVE_CASES = [
    pytest.param(SamplingConfig(temperature=1.0), 3, id="temperature-1-k3"),
    pytest.param(SamplingConfig(temperature=0.7, top_p=0.9), 3, id="temperature-0.7-top-p-0.9-k3"),
    # k = 2 with 5 tokens: after a step that accepts both drafts, the next step drafts again, so
    # the draft's lagging cache (it never fed its last draft token) is exercised within the window.
    pytest.param(SamplingConfig(temperature=1.0, top_k=4), 2, id="top-k-4-k2"),
]


@pytest.mark.parametrize(("sampling", "k"), SPECULATIVE_CASES)
def test_speculative_engine_samples_the_target_distribution(
    small_vocab_target, small_vocab_draft, prefix_logits, sampling, k
):
    tokens, totals = generate_all(
        make_engine(small_vocab_target, small_vocab_draft, "draft", k), sampling, SEEDS
    )

    # Not vacuous: drafts at every position up to k, each sometimes accepted and sometimes rejected.
    drafted_at, accepted_at = totals["drafted_at"][:k], totals["accepted_at"][:k]
    assert totals["drafted"] > 0 and 0 < totals["accepted"] < totals["drafted"], totals
    assert all(0 < a < d for a, d in zip(accepted_at, drafted_at, strict=True)), totals
    assert totals["drafted_at"][k] == 0
    assert_follows_target(tokens, prefix_logits, sampling)


def test_plain_decoding_samples_the_target_distribution(small_vocab_target, prefix_logits):
    """The reference's own sanity check: the engine without a proposer (k = 0 every step)."""
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(make_engine(small_vocab_target, None, None, 3), sampling, SEEDS)
    assert totals["drafted"] == 0
    assert_follows_target(tokens, prefix_logits, sampling)


@pytest.mark.parametrize(
    ("mistake", "runs"), [("keeps every draft", 300), ("recovers from the target", 1000)]
)
def test_a_wrong_verifier_fails_the_same_check(
    small_vocab_target, small_vocab_draft, prefix_logits, monkeypatch, mistake: Mistake, runs
):
    verifier = on_logits(wrong_verifier(mistake))
    monkeypatch.setattr("verispec.engine.core.make_verifier", lambda acceptance: verifier)
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(
        make_engine(small_vocab_target, small_vocab_draft, "draft", 3), sampling, SEEDS[:runs]
    )
    assert totals["drafted"] > 0
    # The first token is a draft token more often than not, so its marginal shows the bias best.
    checks = distribution_checks(tokens, exact_joint(prefix_logits, sampling))
    assert checks["tokens 0"][1] < ALPHA, describe(checks)


def test_token_tree_engine_samples_the_target_distribution(
    small_vocab_target, small_vocab_draft, prefix_logits
):
    """Two candidates per position (the draft's top two, then its greedy continuation of each),
    verified as a tree: sibling after sibling, each rejection removing its token from the target's
    distribution. The output must still be the target's own."""
    spec = SpecConfig(method="draft", num_speculative_tokens=2, depth="fixed")
    engine = SpecEngine(small_vocab_target, TopTwoTree(small_vocab_draft), spec)
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(engine, sampling, SEEDS)
    assert 0 < totals["accepted_at"][1] < totals["drafted_at"][1], totals  # both depths used, not always
    assert_follows_target(tokens, prefix_logits, sampling)


# Strong enough that a row adjusted for the wrong context is far off: token 2 is pushed up, and every
# repeat is pushed down (PROMPT's tokens by the repetition penalty from the start).
PENALTIES = Penalties(presence=0.5, frequency=1.0, repetition=1.5, logit_bias=((2, 1.5), (7, -3.0)))


def test_penalties_keep_speculation_exact(small_vocab_target, small_vocab_draft, prefix_logits):
    """Each verified row is penalised for its own context (committed tokens plus the drafts before it),
    so the output follows the penalised target, not the plain one."""
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(
        make_engine(small_vocab_target, small_vocab_draft, "draft", 3), sampling, SEEDS, PENALTIES
    )
    assert 0 < totals["accepted_at"][2] < totals["drafted_at"][2], totals
    assert_follows_target(tokens, prefix_logits, sampling, PENALTIES)
    plain = distribution_checks(tokens, exact_joint(prefix_logits, sampling))
    assert min(p for _, p in plain.values()) < ALPHA, describe(plain)  # the penalties did change it


def test_penalties_keep_token_trees_exact(small_vocab_target, small_vocab_draft, prefix_logits):
    spec = SpecConfig(method="draft", num_speculative_tokens=2, depth="fixed")
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(
        SpecEngine(small_vocab_target, TopTwoTree(small_vocab_draft), spec), sampling, SEEDS, PENALTIES
    )
    assert 0 < totals["accepted_at"][1] < totals["drafted_at"][1], totals
    assert_follows_target(tokens, prefix_logits, sampling, PENALTIES)


def test_penalties_for_the_wrong_context_fail_the_check(
    small_vocab_target, small_vocab_draft, prefix_logits, monkeypatch
):
    """Power: penalising every row as if no draft token came before it (the easy mistake) is caught."""
    monkeypatch.setattr(Draft, "row_paths", lambda draft: [[] for _ in range(draft.size + 1)])
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(
        make_engine(small_vocab_target, small_vocab_draft, "draft", 3), sampling, SEEDS[:300], PENALTIES
    )
    assert totals["accepted"] > 0
    checks = distribution_checks(tokens, exact_joint(prefix_logits, sampling, PENALTIES))
    assert min(p for _, p in checks.values()) < ALPHA, describe(checks)
