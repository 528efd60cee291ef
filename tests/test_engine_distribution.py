"""Statistical exactness of the whole engine: speculative sampling reproduces the target's own sampling.

tests/verify/test_rejection.py proves the verifier on synthetic distributions. Here everything runs
for real on tiny random Llamas: the draft model proposer with its own KV cache and sampler, the
target's forward over the draft, verification, the rollback of both caches and the commit. Each
seed's sequence is one independent sample; the reference is exact: the target's joint distribution
of all LENGTH generated tokens after a fixed prompt, enumerated over every prefix with the target
run without any cache and through the same ``logits_to_probs`` transform. A chi-square test compares
each position's marginal, each pair of neighbouring tokens and the first three tokens' joint with it.
A deliberately wrong verifier must fail the same check, so the check is known to have power.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import perturbed, tiny_llama
from tests.stats import chi_square
from tests.tree_proposer import TopTwoTree
from verispec.config import DraftModelConfig, SamplingConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.models.hf import HFCausalLM
from verispec.penalties import Penalties
from verispec.proposers.base import build_proposer
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft, VerifyResult
from verispec.verify import rejection_sample

VOCAB = 12  # small enough to enumerate every continuation; lm_head x 8 gives ~1.9 nats per token
PROMPT = [3, 1, 4, 1, 5]
LENGTH = 5  # max_new_tokens; every generated token is checked (12^4 prefixes to enumerate)
DRAFT_NOISE = 0.6  # the first draft token is accepted ~60-70% of the time, later ones less often
SEEDS = range(1000)  # one sequence per seed (~5-12 ms each); the draft's seeds (seed + 0x5EED) are apart
ALPHA = 1e-3
# Significance level of each chi-square check. The seeds are fixed, so each check either always
# passes or always fails; ALPHA is the chance that an exact engine fails one check through bad
# luck of the seeds. The correct-engine tests below make 40 checks (10 per case): a 4% chance in
# all that one would have needed reseeding (measured: every p-value above 0.04). A biased engine's
# statistic grows linearly with the number of sequences while the critical value stays put (31 for
# 11 degrees of freedom): with only 300 sequences the wrong verifier that keeps every draft scores
# chi-square ~200 (p ~ 1e-39) on the first token. The subtle one (a rejection recovers from the target
# instead of the residual) scores ~96 (p ~ 1e-16) on all 1000 sequences but 17.5, 44 and 43 on
# three slices of 300 of them (measured): at 300 it misses the critical value often enough to
# matter, so it gets all 1000.
# The reference runs the target without a cache, the engine with one: their logits differ by ~1e-6,
# which could move a token across a top-k/top-p boundary only in a row whose margin is that small
# (none of the few such rows is ever sampled here); a flip would show as a chi-square of inf.


def make_engine(target: HFCausalLM, draft: HFCausalLM | None, k: int) -> SpecEngine:
    method = "draft" if draft is not None else None
    spec = SpecConfig(
        method=method,
        num_speculative_tokens=k,
        draft=DraftModelConfig(model="tiny" if draft else None),
        depth="fixed",
    )
    return SpecEngine(target, build_proposer(spec, target, draft), spec, draft=draft)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> HFCausalLM:
    return HFCausalLM(tiny_llama(0, vocab=VOCAB), name="tiny-target-12")


@pytest.fixture(scope="module")
def draft(target: HFCausalLM) -> HFCausalLM:
    return HFCausalLM(perturbed(target.model, DRAFT_NOISE, seed=1), name="tiny-draft-12")


@pytest.fixture(scope="module")
def prefix_logits(target: HFCausalLM) -> list[torch.Tensor]:
    """logits[n]: [VOCAB**n, VOCAB], the target's logits after PROMPT + each n-token prefix.

    Prefixes are in lexicographic order, so row ``sum(t_i * VOCAB**(n-1-i))`` belongs to (t_1..t_n).
    Computed once, without a KV cache (a path independent of the engine's), for every sampling case.
    """
    logits = []
    with torch.inference_mode():
        for n in range(LENGTH):
            prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=n)), dtype=torch.long)
            prefixes = prefixes.reshape(VOCAB**n, n)  # [VOCAB**n, n]
            ids = torch.cat([torch.tensor(PROMPT).expand(VOCAB**n, -1), prefixes], dim=1)
            rows = [target.model(input_ids=part, logits_to_keep=1).logits[:, -1] for part in ids.split(4096)]
            logits.append(torch.cat(rows).float())
    return logits


def exact_joint(
    prefix_logits: list[torch.Tensor], sampling: SamplingConfig, penalties: Penalties | None = None
) -> torch.Tensor:
    """[VOCAB] * LENGTH: the probability that the target alone samples each sequence of LENGTH tokens,
    with ``penalties`` applied to each prefix's row as plain decoding would."""
    joint = torch.ones((), dtype=torch.float64)
    for n, logits in enumerate(prefix_logits):
        if penalties is not None:
            logits = penalized(logits, penalties, n)
        probs = logits_to_probs(logits, sampling).double()  # [VOCAB**n, VOCAB]
        joint = joint.unsqueeze(-1) * probs.reshape([VOCAB] * (n + 1))
    return joint


def penalized(logits: torch.Tensor, penalties: Penalties, n: int) -> torch.Tensor:
    """vLLM's rules written out for [VOCAB**n, VOCAB] rows after PROMPT and every n-token prefix:
    the reference, independent of :func:`verispec.penalties.adjust_logits` and its per-row paths."""
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=n)), dtype=torch.long)
    counts = torch.nn.functional.one_hot(prefixes.reshape(VOCAB**n, n), VOCAB).sum(dim=1).double()
    out = logits.double().clone()
    for token, bias in penalties.logit_bias:
        out[:, token] += bias
    seen = (counts > 0) | torch.isin(torch.arange(VOCAB), torch.tensor(PROMPT))
    rep = penalties.repetition
    out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    return out - penalties.frequency * counts - penalties.presence * (counts > 0).double()


def generate_all(
    engine: SpecEngine, sampling: SamplingConfig, seeds: range, penalties: Penalties | None = None
) -> tuple[torch.Tensor, dict]:
    """[len(seeds), LENGTH] generated tokens, one sequence per seed, and the summed acceptance stats."""
    extra = {}
    if penalties is not None:
        extra = {
            "presence_penalty": penalties.presence,
            "frequency_penalty": penalties.frequency,
            "repetition_penalty": penalties.repetition,
            "logit_bias": dict(penalties.logit_bias),
        }
    sequences = []
    totals = {"drafted": 0, "accepted": 0, "drafted_at": [0] * 8, "accepted_at": [0] * 8}
    for seed in seeds:
        gen = engine.generate(
            PROMPT,
            max_new_tokens=LENGTH,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
            **extra,
        )
        assert len(gen.token_ids) == LENGTH
        sequences.append(gen.token_ids)
        totals["drafted"] += gen.stats.num_drafted
        totals["accepted"] += gen.stats.num_accepted
        for i, (d, a) in enumerate(zip(gen.stats.drafted_at, gen.stats.accepted_at, strict=True)):
            totals["drafted_at"][i] += d
            totals["accepted_at"][i] += a
    return torch.tensor(sequences), totals


def distribution_checks(tokens: torch.Tensor, joint: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Chi-square (statistic, p-value) of each position's marginal, each pair of neighbouring tokens'
    joint and the first three tokens' joint, for [N, LENGTH] sampled ``tokens``."""
    checks = {}
    for group in [*((p,) for p in range(LENGTH)), *((p, p + 1) for p in range(LENGTH - 1)), (0, 1, 2)]:
        others = tuple(d for d in range(LENGTH) if d not in group)
        probs = joint.sum(dim=others) if others else joint  # [VOCAB] * len(group)
        cells = torch.zeros(len(tokens), dtype=torch.long)
        for position in group:
            cells = cells * VOCAB + tokens[:, position]
        counts = torch.bincount(cells, minlength=VOCAB ** len(group))
        checks["tokens " + ",".join(map(str, group))] = chi_square(counts, probs)
    return checks


def describe(checks: dict[str, tuple[float, float]]) -> str:
    return "; ".join(f"{name}: chi2 {stat:.1f} p {p:.2g}" for name, (stat, p) in checks.items())


def assert_follows_target(
    tokens: torch.Tensor,
    prefix_logits: list[torch.Tensor],
    sampling: SamplingConfig,
    penalties: Penalties | None = None,
) -> None:
    """Every chi-square check passes at ALPHA: the sampled ``tokens`` follow the target's own joint."""
    checks = distribution_checks(tokens, exact_joint(prefix_logits, sampling, penalties))
    failed = {name: result for name, result in checks.items() if result[1] <= ALPHA}
    assert not failed, describe(checks)


SPECULATIVE_CASES = [
    pytest.param(SamplingConfig(temperature=1.0), 3, id="temperature-1-k3"),
    pytest.param(SamplingConfig(temperature=0.7, top_p=0.9), 3, id="temperature-0.7-top-p-0.9-k3"),
    # k = 2 with 5 tokens: after a step that accepts both drafts, the next step drafts again, so
    # the draft's lagging cache (it never fed its last draft token) is exercised within the window.
    pytest.param(SamplingConfig(temperature=1.0, top_k=4), 2, id="top-k-4-k2"),
]


@pytest.mark.parametrize(("sampling", "k"), SPECULATIVE_CASES)
def test_speculative_engine_samples_the_target_distribution(target, draft, prefix_logits, sampling, k):
    tokens, totals = generate_all(make_engine(target, draft, k), sampling, SEEDS)

    # Not vacuous: drafts at every position up to k, each sometimes accepted and sometimes rejected.
    drafted_at, accepted_at = totals["drafted_at"][:k], totals["accepted_at"][:k]
    assert totals["drafted"] > 0 and 0 < totals["accepted"] < totals["drafted"], totals
    assert all(0 < a < d for a, d in zip(accepted_at, drafted_at, strict=True)), totals
    assert totals["drafted_at"][k] == 0
    assert_follows_target(tokens, prefix_logits, sampling)


def test_plain_decoding_samples_the_target_distribution(target, prefix_logits):
    """The reference's own sanity check: the engine without a proposer (k = 0 every step)."""
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(make_engine(target, None, 3), sampling, SEEDS)
    assert totals["drafted"] == 0
    assert_follows_target(tokens, prefix_logits, sampling)


def accept_every_draft(
    draft: Draft,
    target_logits: torch.Tensor,  # [k+1, V]
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> VerifyResult:
    """A wrong verifier: keeps every draft token and adds a bonus token sampled from the target."""
    bonus = int(sample(logits_to_probs(target_logits[draft.size], sampling), generator))
    return VerifyResult([*draft.tokens.tolist(), bonus], draft.size, draft.size)


def recover_from_the_target(
    draft: Draft,
    target_logits: torch.Tensor,  # [k+1, V]
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> VerifyResult:
    """A subtly wrong verifier: right acceptance test, but the recovered token ignores the residual."""
    target_probs = logits_to_probs(target_logits, sampling)  # [k+1, V]
    result = rejection_sample(draft.tokens, draft.probs, target_probs, generator)
    if result.bonus:
        return result
    recovered = int(sample(target_probs[result.num_accepted], generator))
    return VerifyResult([*result.tokens[:-1], recovered], result.num_accepted, result.num_drafted)


@pytest.mark.parametrize(
    ("wrong_verifier", "runs"), [(accept_every_draft, 300), (recover_from_the_target, 1000)]
)
def test_a_wrong_verifier_fails_the_same_check(
    target, draft, prefix_logits, monkeypatch, wrong_verifier, runs
):
    monkeypatch.setattr("verispec.engine.core.make_verifier", lambda acceptance: wrong_verifier)
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(make_engine(target, draft, 3), sampling, SEEDS[:runs])
    assert totals["drafted"] > 0
    # The first token is a draft token more often than not, so its marginal shows the bias best.
    checks = distribution_checks(tokens, exact_joint(prefix_logits, sampling))
    assert checks["tokens 0"][1] < ALPHA, describe(checks)


def test_token_tree_engine_samples_the_target_distribution(target, draft, prefix_logits):
    """Two candidates per position (the draft's top two, then its greedy continuation of each),
    verified as a tree: sibling after sibling, each rejection removing its token from the target's
    distribution. The output must still be the target's own."""
    spec = SpecConfig(method="draft", num_speculative_tokens=2, depth="fixed")
    engine = SpecEngine(target, TopTwoTree(draft), spec)
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(engine, sampling, SEEDS)
    assert 0 < totals["accepted_at"][1] < totals["drafted_at"][1], totals  # both depths used, not always
    assert_follows_target(tokens, prefix_logits, sampling)


# Strong enough that a row adjusted for the wrong context is far off: token 2 is pushed up, and every
# repeat is pushed down (PROMPT's tokens by the repetition penalty from the start).
PENALTIES = Penalties(presence=0.5, frequency=1.0, repetition=1.5, logit_bias=((2, 1.5), (7, -3.0)))


def test_penalties_keep_speculation_exact(target, draft, prefix_logits):
    """Each verified row is penalised for its own context (committed tokens plus the drafts before it),
    so the output follows the penalised target, not the plain one."""
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(make_engine(target, draft, 3), sampling, SEEDS, PENALTIES)
    assert 0 < totals["accepted_at"][2] < totals["drafted_at"][2], totals
    assert_follows_target(tokens, prefix_logits, sampling, PENALTIES)
    plain = distribution_checks(tokens, exact_joint(prefix_logits, sampling))
    assert min(p for _, p in plain.values()) < ALPHA, describe(plain)  # the penalties did change it


def test_penalties_keep_token_trees_exact(target, draft, prefix_logits):
    spec = SpecConfig(method="draft", num_speculative_tokens=2, depth="fixed")
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(SpecEngine(target, TopTwoTree(draft), spec), sampling, SEEDS, PENALTIES)
    assert 0 < totals["accepted_at"][1] < totals["drafted_at"][1], totals
    assert_follows_target(tokens, prefix_logits, sampling, PENALTIES)


def test_penalties_for_the_wrong_context_fail_the_check(target, draft, prefix_logits, monkeypatch):
    """Power: penalising every row as if no draft token came before it (the easy mistake) is caught."""
    monkeypatch.setattr(Draft, "row_paths", lambda draft: [[] for _ in range(draft.size + 1)])
    sampling = SamplingConfig(temperature=1.0)
    tokens, totals = generate_all(make_engine(target, draft, 3), sampling, SEEDS[:300], PENALTIES)
    assert totals["accepted"] > 0
    checks = distribution_checks(tokens, exact_joint(prefix_logits, sampling, PENALTIES))
    assert min(p for _, p in checks.values()) < ALPHA, describe(checks)
