"""Tests of the verifier: greedy tables, certain outcomes, seeded determinism, and exactness.

The exactness tests run speculative sampling on a small synthetic language model and check, with a
chi-square test, that what comes out is distributed as the target alone would have sampled it;
deliberately wrong verifiers (a blatant one and a subtle one) must fail the same check, so the
check is known to have power.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from tests.stats import chi_square
from tests.wrong_verifiers import MISTAKES, ChainVerifier, Mistake, wrong_verifier
from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft, VerifyResult
from verispec.verify import greedy_verify, rejection_sample, verify

GREEDY = SamplingConfig(temperature=0.0)


def peaked_logits(argmax_tokens: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(argmax_tokens), vocab] logits whose row i has its maximum at argmax_tokens[i]."""
    logits = torch.linspace(-1.0, 0.0, vocab).repeat(len(argmax_tokens), 1)
    logits[torch.arange(len(argmax_tokens)), torch.tensor(argmax_tokens, dtype=torch.long)] = 5.0
    return logits


def as_tokens(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------
# Greedy: a table of cases, run through the greedy path and through the general path at temperature 0
# ---------------------------------------------------------------------------------------------------

# (draft tokens, the target's argmax at positions 0..k, committed tokens, number accepted)
GREEDY_CASES = [
    pytest.param([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3, id="perfect-match-plus-bonus"),
    pytest.param([1, 2, 3], [1, 5, 3, 4], [1, 5], 1, id="early-mismatch"),
    pytest.param([1, 2, 3], [0, 2, 3, 4], [0], 0, id="all-rejected"),
    pytest.param([7, 2], [7, 2, 9], [7, 2, 9], 2, id="bonus-is-argmax-at-k"),
    pytest.param([], [6], [6], 0, id="k=0-plain-decoding"),
]


@pytest.mark.parametrize(("draft", "target_argmax", "expected", "num_accepted"), GREEDY_CASES)
def test_greedy_verify(draft, target_argmax, expected, num_accepted):
    result = greedy_verify(as_tokens(draft), peaked_logits(target_argmax))
    assert result == VerifyResult(tokens=expected, num_accepted=num_accepted, num_drafted=len(draft))
    assert result.bonus == (num_accepted == len(draft))


@pytest.mark.parametrize(("draft", "target_argmax", "expected", "num_accepted"), GREEDY_CASES)
@pytest.mark.parametrize(
    "one_hot_draft_probs", [False, True], ids=["draft-probs-None", "one-hot-draft-probs"]
)
def test_rejection_sample_at_temperature_0_is_greedy(
    draft, target_argmax, expected, num_accepted, one_hot_draft_probs
):
    target_probs = logits_to_probs(peaked_logits(target_argmax), GREEDY)  # one-hot rows
    draft_probs = None
    if one_hot_draft_probs:
        draft_probs = torch.nn.functional.one_hot(as_tokens(draft), 10).float()
    for seed in range(5):
        result = rejection_sample(
            as_tokens(draft), draft_probs, target_probs, torch.Generator().manual_seed(seed)
        )
        assert result == VerifyResult(tokens=expected, num_accepted=num_accepted, num_drafted=len(draft))


@pytest.mark.parametrize(("draft", "target_argmax", "expected", "num_accepted"), GREEDY_CASES)
def test_verify_dispatches_greedy(draft, target_argmax, expected, num_accepted):
    result = verify(Draft.chain(as_tokens(draft)), peaked_logits(target_argmax), GREEDY, None)
    assert result.tokens == expected
    assert result.num_accepted == num_accepted


# ---------------------------------------------------------------------------------------------------
# Rejection sampling: cases whose outcome is certain
# ---------------------------------------------------------------------------------------------------


def random_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).softmax(dim=-1)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_target_equal_to_draft_accepts_everything(k):
    vocab = 12
    for seed in range(20):
        probs = random_probs(k + 1, vocab, seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        draft_tokens = sample(probs[:k], gen)
        result = rejection_sample(draft_tokens, probs[:k], probs, gen)
        assert result.num_accepted == k
        assert result.tokens[:k] == draft_tokens.tolist()
        assert len(result.tokens) == k + 1
        assert result.bonus


@pytest.mark.parametrize("reject_at", [0, 1, 3])
def test_zero_target_mass_rejects_and_recovers_another_token(reject_at):
    k, vocab = 4, 6
    for seed in range(30):
        probs = random_probs(k + 1, vocab, seed)
        draft_tokens = sample(probs[:k], torch.Generator().manual_seed(seed))
        target_probs = probs.clone()
        # The target puts no mass on the draft token at reject_at and agrees everywhere before it.
        target_probs[reject_at, draft_tokens[reject_at]] = 0.0
        target_probs[reject_at] /= target_probs[reject_at].sum()
        result = rejection_sample(
            draft_tokens, probs[:k], target_probs, torch.Generator().manual_seed(500 + seed)
        )
        assert result.num_accepted == reject_at
        assert result.tokens[:reject_at] == draft_tokens[:reject_at].tolist()
        assert len(result.tokens) == reject_at + 1
        recovered = result.tokens[-1]
        assert recovered != int(draft_tokens[reject_at])
        assert target_probs[reject_at, recovered] > 0


def test_deterministic_proposal_with_certain_target_is_accepted():
    draft_tokens = as_tokens([3, 0, 5])
    target_probs = torch.zeros(4, 6)
    target_probs[torch.arange(3), draft_tokens] = 1.0
    target_probs[3] = torch.full((6,), 1 / 6)
    for seed in range(10):
        result = rejection_sample(draft_tokens, None, target_probs, torch.Generator().manual_seed(seed))
        assert result.tokens[:3] == [3, 0, 5]
        assert result.num_accepted == 3
        assert result.bonus


def test_k0_samples_the_bonus_token_from_the_target():
    target_probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    result = rejection_sample(as_tokens([]), None, target_probs, torch.Generator().manual_seed(0))
    assert result == VerifyResult(tokens=[2], num_accepted=0, num_drafted=0)


def test_zero_residual_falls_back_to_the_target_row():
    # The residual is all zeros when the target's row is nowhere above the draft's; in real use only
    # rounding gets there. Force it with an unnormalised target row that also rejects token 0
    # for certain: the recovered token must then come from the target's row, i.e. be token 1.
    draft_probs = torch.tensor([[0.5, 0.5]])
    target_probs = torch.tensor([[0.0, 0.5], [1.0, 0.0]])
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        result = rejection_sample(as_tokens([0]), draft_probs, target_probs, gen)
        assert result == VerifyResult(tokens=[1], num_accepted=0, num_drafted=1)


def plain_samples(target_probs: torch.Tensor, seed: int) -> list[int]:
    """What plain decoding samples at each row with a generator seeded ``seed``: one draw per row."""
    gen = torch.Generator().manual_seed(seed)
    return [int(sample(row, gen)) for row in target_probs]


@pytest.mark.parametrize("agree", [0, 1, 3, 4])
def test_a_deterministic_proposal_commits_what_plain_decoding_samples(agree):
    """Sampling and matching: whatever the draft, the committed tokens are plain decoding's samples
    under the same seed, and the draft is kept exactly as far as it agrees with them."""
    k, vocab = 4, 12
    target_probs = random_probs(k + 1, vocab, 5)
    for seed in range(20):
        plain = plain_samples(target_probs, seed)
        draft = plain[:agree] + [(t + 1) % vocab for t in plain[agree:k]]
        result = rejection_sample(as_tokens(draft), None, target_probs, torch.Generator().manual_seed(seed))
        assert result == VerifyResult(tokens=plain[: agree + 1], num_accepted=agree, num_drafted=k)


# ---------------------------------------------------------------------------------------------------
# Seeded determinism and argument validation
# ---------------------------------------------------------------------------------------------------


def _half_accepting_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, vocab = 5, 16
    draft_probs = random_probs(k, vocab, 1)
    target_probs = random_probs(k + 1, vocab, 2)
    draft_tokens = sample(draft_probs, torch.Generator().manual_seed(3))
    return draft_tokens, draft_probs, target_probs


def test_same_seed_gives_the_same_result():
    draft_tokens, draft_probs, target_probs = _half_accepting_case()
    for seed in range(10):
        first = rejection_sample(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        again = rejection_sample(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        assert first == again


def test_different_seeds_can_differ():
    draft_tokens, draft_probs, target_probs = _half_accepting_case()
    results = set()
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        results.add(tuple(rejection_sample(draft_tokens, draft_probs, target_probs, gen).tokens))
    assert len(results) > 5


def test_verify_sampling_is_seeded_and_uses_the_shared_transform():
    cfg = SamplingConfig(temperature=0.8, top_k=5)
    draft_tokens, draft_probs, _ = _half_accepting_case()
    target_logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    draft = Draft.chain(draft_tokens, draft_probs)
    via_verify = verify(draft, target_logits, cfg, torch.Generator().manual_seed(9))
    direct = rejection_sample(
        draft_tokens, draft_probs, logits_to_probs(target_logits, cfg), torch.Generator().manual_seed(9)
    )
    assert via_verify == direct


@pytest.mark.parametrize(
    ("tokens", "probs", "target_shape", "message"),
    [
        pytest.param([1, 2], None, (2, 8), r"\[k\+1, vocab\]", id="target-one-row-short"),
        pytest.param([1, 2], None, (3,), r"\[k\+1, vocab\]", id="target-1d"),
        pytest.param([1, 2], (2, 7), (3, 8), r"draft_probs", id="draft-probs-vocab"),
    ],
)
def test_bad_shapes_raise_value_error(tokens, probs, target_shape, message):
    draft_probs = None if probs is None else torch.full(probs, 1 / probs[-1])
    target = torch.full(target_shape, 1 / target_shape[-1])
    with pytest.raises(ValueError, match=message):
        rejection_sample(as_tokens(tokens), draft_probs, target, None)
    with pytest.raises(ValueError, match=message):
        verify(Draft.chain(as_tokens(tokens), draft_probs), target, SamplingConfig(temperature=1.0), None)
    if probs is None:
        with pytest.raises(ValueError, match=message):
            greedy_verify(as_tokens(tokens), target)


def test_float_draft_tokens_raise_value_error():
    with pytest.raises(ValueError, match="integer"):
        rejection_sample(torch.tensor([1.0]), None, torch.full((2, 4), 0.25), None)


# ---------------------------------------------------------------------------------------------------
# Exactness: speculative sampling on a synthetic language model reproduces the target's distribution
# ---------------------------------------------------------------------------------------------------

VOCAB = 8
LENGTH = 3  # tokens generated per trial, from an empty context
TRIALS = 8000
ALPHA = 1e-3
# Significance level of each chi-square check. The seeds are fixed, so each check either always
# passes or always fails; ALPHA is the chance that an exact verifier would fail one check through
# bad luck of the seed (16 correct-verifier checks here: under 2% that any had to be reseeded).
# A biased verifier's statistic grows linearly with TRIALS while the critical value stays put
# (about 24 for 7 degrees of freedom, 103 for 63): with 8000 trials the exact verifier scores
# p > 0.03 on every check, the wrong verifiers of tests/wrong_verifiers.py score chi-square in the
# hundreds to tens of thousands, p ~ 0. Each exactness run takes 1-4 s on one CPU core.


@dataclass(frozen=True)
class ToyLM:
    """A target and a deliberately mismatched draft over every context up to ``max_len`` tokens.

    A context (t_1, ..., t_n) has id ``offsets[n] + sum(t_i * VOCAB ** (n - i))``; each id's row of
    logits comes from a seeded generator, which plays the part of hashing the context.
    """

    offsets: torch.Tensor  # [max_len + 2] int64, first id of each context length
    target_probs: torch.Tensor  # [num_contexts, VOCAB]
    draft_probs: torch.Tensor  # [num_contexts, VOCAB]

    @staticmethod
    def build(max_len: int, sampling: SamplingConfig, seed: int = 0) -> ToyLM:
        offsets = torch.tensor([0] + [VOCAB**n for n in range(max_len + 1)]).cumsum(dim=0)
        gen = torch.Generator().manual_seed(seed)
        target_logits = 2.0 * torch.randn(int(offsets[-1]), VOCAB, generator=gen)
        # Correlated with the target but noisy: each draft token is accepted with probability ~0.6-0.7.
        draft_logits = 0.7 * target_logits + torch.randn(int(offsets[-1]), VOCAB, generator=gen)
        target_probs = logits_to_probs(target_logits, sampling)
        return ToyLM(offsets, target_probs, logits_to_probs(draft_logits, sampling))

    def exact_joint(self, length: int) -> torch.Tensor:
        """[VOCAB] * length: the target's probability of every sequence of ``length`` tokens."""
        joint = torch.ones((), dtype=torch.float64)
        for n in range(length):
            rows = self.target_probs[self.offsets[n] : self.offsets[n + 1]].double()
            joint = joint.unsqueeze(-1) * rows.reshape([VOCAB] * (n + 1))
        return joint


def encode(tokens: list[int]) -> int:
    """A context's position among the contexts of its length (its tokens as base-VOCAB digits)."""
    code = 0
    for token in tokens:
        code = code * VOCAB + token
    return code


def simulate(
    lm: ToyLM, k: int, verifier: ChainVerifier, *, deterministic_draft: bool = False, seed: int = 0
) -> tuple[torch.Tensor, Counter[int]]:
    """Generate LENGTH tokens per trial by speculative decoding; all trials advance step by step.

    Returns the [TRIALS, LENGTH] tokens and how often each number of accepted tokens occurred.
    """
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    committed: list[list[int]] = [[] for _ in range(TRIALS)]
    accepted_counts: Counter[int] = Counter()
    while active := [i for i, seq in enumerate(committed) if len(seq) < LENGTH]:
        lengths = torch.tensor([len(committed[i]) for i in active])  # [A]
        codes = torch.tensor([encode(committed[i]) for i in active])  # [A]
        ids = [lm.offsets[lengths] + codes]  # context id at each position, [A] each
        draft_tokens = []
        for j in range(k):  # the draft samples its k tokens autoregressively
            rows = lm.draft_probs[ids[-1]]  # [A, VOCAB]
            if deterministic_draft:
                token = rows.argmax(dim=-1)
            else:
                token = torch.multinomial(rows, 1, generator=draft_gen).squeeze(-1)
            draft_tokens.append(token)
            codes = codes * VOCAB + token
            ids.append(lm.offsets[lengths + j + 1] + codes)
        draft_tokens_t = torch.stack(draft_tokens, dim=1)  # [A, k]
        context_ids = torch.stack(ids, dim=1)  # [A, k+1]
        target_rows = lm.target_probs[context_ids]  # [A, k+1, VOCAB]
        draft_rows = lm.draft_probs[context_ids[:, :k]]  # [A, k, VOCAB]
        for a, i in enumerate(active):
            result = verifier(
                draft_tokens_t[a], None if deterministic_draft else draft_rows[a], target_rows[a], verify_gen
            )
            accepted_counts[result.num_accepted] += 1
            committed[i] = (committed[i] + result.tokens)[:LENGTH]
    return torch.tensor(committed), accepted_counts


def distribution_checks(tokens: torch.Tensor, lm: ToyLM) -> dict[str, tuple[float, float]]:
    """Chi-square (statistic, p-value) of each position's marginal and of the first two tokens' joint."""
    exact = lm.exact_joint(LENGTH)  # [VOCAB] * LENGTH
    checks = {}
    for position in range(LENGTH):
        others = tuple(d for d in range(LENGTH) if d != position)
        marginal = exact.sum(dim=others) if others else exact
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)
        checks[f"position {position}"] = chi_square(counts, marginal)
    first_two = exact.sum(dim=tuple(range(2, LENGTH)))  # [VOCAB, VOCAB]
    counts = torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)
    checks["tokens 0 and 1"] = chi_square(counts, first_two)
    return checks


EXACTNESS_CASES = [
    pytest.param(SamplingConfig(temperature=1.0), 2, False, id="temperature-1"),
    pytest.param(SamplingConfig(temperature=0.7, top_p=0.8), 3, False, id="temperature-0.7-top-p-0.8"),
    pytest.param(SamplingConfig(temperature=1.0, top_k=3), 2, False, id="top-k-3"),
    pytest.param(SamplingConfig(temperature=1.0), 2, True, id="deterministic-draft-probs-None"),
]


@pytest.mark.parametrize(("sampling", "k", "deterministic_draft"), EXACTNESS_CASES)
def test_speculative_sampling_reproduces_the_target_distribution(sampling, k, deterministic_draft):
    lm = ToyLM.build(max_len=LENGTH - 1 + k, sampling=sampling)
    tokens, accepted_counts = simulate(lm, k, rejection_sample, deterministic_draft=deterministic_draft)

    # Not vacuous: drafts were accepted, rejected at every position, and fully accepted (bonus).
    assert set(accepted_counts) == set(range(k + 1)), accepted_counts
    for name, (statistic, p_value) in distribution_checks(tokens, lm).items():
        assert p_value > ALPHA, f"{name}: chi-square {statistic:.1f}, p = {p_value:.2e}"


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_wrong_verifier_fails_the_same_check(mistake: Mistake):
    sampling = SamplingConfig(temperature=1.0)
    k = 2
    lm = ToyLM.build(max_len=LENGTH - 1 + k, sampling=sampling)
    tokens, _ = simulate(lm, k, wrong_verifier(mistake))
    checks = distribution_checks(tokens, lm)
    for name in ("position 0", "tokens 0 and 1"):
        statistic, p_value = checks[name]
        assert p_value < ALPHA, f"{name}: chi-square {statistic:.1f}, p = {p_value:.2e}"
