"""Tests of the one logits-to-probabilities transform and the sampler shared by draft and target."""

from __future__ import annotations

import math

import pytest
import torch

from tests.stats import chi_square
from verispec.config import SamplingConfig
from verispec.sampling import SAMPLE_BLOCK, logits_to_probs, make_generator, sample


def logits_of(probs: list[float]) -> torch.Tensor:
    """[V] logits whose softmax is ``probs``."""
    return torch.tensor([math.log(p) for p in probs])


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.3),
        SamplingConfig(temperature=2.0, top_k=4),
        SamplingConfig(temperature=1.0, top_p=0.5),
        SamplingConfig(temperature=0.7, top_k=10, top_p=0.9),
    ],
    ids=["greedy", "t1", "t0.3", "t2-top-k", "top-p", "all"],
)
def test_rows_sum_to_one(cfg):
    logits = 3.0 * torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))  # [2, 3, V]
    probs = logits_to_probs(logits, cfg)
    assert probs.shape == logits.shape
    assert probs.dtype == torch.float32
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2, 3))


def test_half_precision_logits_give_float32_probs():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, logits.float().softmax(dim=-1))


def test_greedy_is_one_hot_at_the_argmax():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(2))
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.0, top_k=3, top_p=0.5))
    expected = torch.nn.functional.one_hot(logits.argmax(dim=-1), 20).float()
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("top_k", [1, 2, 5, 19])
def test_top_k_keeps_exactly_the_k_most_likely_tokens(top_k):
    logits = torch.randperm(20, generator=torch.Generator().manual_seed(3)).float()  # distinct values
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=top_k))
    kept = set(probs.nonzero().flatten().tolist())
    assert kept == set(torch.topk(logits, top_k).indices.tolist())
    # The kept tokens keep their relative probabilities.
    torch.testing.assert_close(probs[sorted(kept)], logits[sorted(kept)].softmax(dim=-1))


def test_top_k_of_the_whole_vocabulary_changes_nothing():
    logits = torch.randn(8, generator=torch.Generator().manual_seed(4))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=8))
    torch.testing.assert_close(probs, logits.softmax(dim=-1))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # 0.5 < 0.7 <= 0.5 + 0.3: the two most likely tokens are the smallest prefix reaching 0.7.
        (0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        # 0.8 < 0.9 <= 0.95: three tokens.
        (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        # The most likely token alone reaches 0.4.
        (0.4, [1.0, 0.0, 0.0, 0.0]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    # Shuffled vocabulary order, so the prefix is taken in probability order, not index order.
    order = [2, 0, 3, 1]
    probs_by_rank = [0.5, 0.3, 0.15, 0.05]
    logits = torch.empty(4)
    expected_probs = torch.empty(4)
    for rank, index in enumerate(order):
        logits[index] = math.log(probs_by_rank[rank])
        expected_probs[index] = expected[rank]
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, expected_probs)


def test_top_k_is_applied_before_top_p():
    # top-k 3 renormalises [0.4, 0.3, 0.2] to [0.444, 0.333, 0.222]; top-p 0.75 then keeps two tokens
    # (0.444 < 0.75 <= 0.778). Applied the other way round top-p would keep three (0.7 < 0.75).
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0]))


def nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference top-p over [R, V] logits: the whole row sorted, in float64. Returns the kept mask
    and each token's mass before it in that order."""
    sorted_logits, order = torch.sort(logits.double(), dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    before_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs
    before = torch.empty_like(before_sorted).scatter_(-1, order, before_sorted)
    return before < top_p, before


@pytest.mark.parametrize(
    ("scale", "vocab", "top_p", "top_k"),
    [
        (3.0, 151_936, 0.95, 0),  # a flat row: the cut lies past the first candidates, the search widens
        (0.3, 5_000, 0.9, 0),  # nearly uniform: the nucleus is most of the row
        (8.0, 151_936, 0.9, 0),  # peaked: the cut is among the first candidates
        (3.0, 151_936, 0.8, 40),
        (3.0, 49_152, 0.99, 0),
    ],
)
def test_top_p_matches_a_full_sort_of_the_row(scale, vocab, top_p, top_k):
    """Only the most likely tokens are sorted; the kept set must be the one a full float64 sort gives
    (a token may differ only where its mass-before is within float32 rounding of top_p)."""
    logits = scale * torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p))
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    want, before = nucleus_by_full_sort(logits, top_p)
    differ = (probs > 0) != want
    assert ((before[differ] - top_p).abs() < 1e-6).all(), before[differ]
    assert want.sum() > 1 and differ.sum() <= 1
    kept = torch.where(want, logits.double(), float("-inf")).softmax(dim=-1)
    torch.testing.assert_close(probs.double(), kept, atol=1e-6, rtol=1e-4)


def test_top_p_keeps_every_token_tied_at_the_top_k_cut():
    """Ties at the k-th logit keep more than k tokens; top-p then sees all of them."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=0.99))
    assert (probs[0, :4] > 0).all() and (probs[0, 4:] == 0).all()


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.5, 4.0])
def test_temperature_divides_the_logits(temperature):
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    probs = logits_to_probs(logits, SamplingConfig(temperature=temperature))
    torch.testing.assert_close(probs, (logits / temperature).softmax(dim=-1))


def test_sample_is_reproducible_with_a_seeded_generator():
    probs = logits_to_probs(
        torch.randn(4, 6, 100, generator=torch.Generator().manual_seed(6)), SamplingConfig(1.0)
    )
    first = sample(probs, make_generator(123))
    again = sample(probs, make_generator(123))
    assert first.shape == (4, 6)
    assert first.dtype == torch.int64
    assert torch.equal(first, again)
    others = [sample(probs, make_generator(seed)) for seed in range(5)]
    assert any(not torch.equal(first, other) for other in others)


def test_sample_one_row_returns_a_scalar_and_never_picks_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])
    gen = make_generator(7)
    draws = [sample(probs, gen) for _ in range(200)]
    assert all(draw.dim() == 0 for draw in draws)
    assert {int(draw) for draw in draws} == {1, 3}


def block_spanning_weights() -> torch.Tensor:
    """[3000] unnormalised weights on both sides of the sampler's block edges, in a padded last block,
    and zero everywhere else (whole blocks of zeros included)."""
    weights = torch.zeros(3000)
    weights[[0, SAMPLE_BLOCK - 1, SAMPLE_BLOCK, 2 * SAMPLE_BLOCK - 1, 2999]] = torch.tensor(
        [0.5, 1.0, 2.0, 1e-3, 4.0]
    )
    return weights


def test_sample_draws_each_token_with_its_share_of_the_weight():
    weights = block_spanning_weights()
    draws = sample(weights.expand(40_000, -1), make_generator(11))  # [40000]: one per row
    counts = torch.bincount(draws, minlength=weights.numel())
    assert counts[weights == 0].sum() == 0
    _, p_value = chi_square(counts, weights / weights.sum())
    assert p_value > 1e-3, p_value


def test_sample_keeps_the_batch_shape_and_each_row_its_own_distribution():
    probs = torch.zeros(2, 3, 5000)
    for i, token in enumerate([0, 1023, 1024, 2047, 4999, 3000]):
        probs.view(6, -1)[i, token] = 1.0
    assert sample(probs, make_generator(0)).tolist() == [[0, 1023, 1024], [2047, 4999, 3000]]


@pytest.mark.parametrize(("uniform", "token"), [(1.0, 2999), (1.0 - 2**-53, 2999), (0.0, 0)])
def test_sample_survives_a_uniform_at_either_end(monkeypatch, uniform, token):
    """A draw at the very top (1.0 is where rounding can carry u * total) lands on the last positive
    weight, not on a zero or past the row; a uniform of exactly 0 takes the first positive weight."""
    monkeypatch.setattr(torch, "rand", lambda *size, **kw: torch.full(size, uniform, dtype=torch.float64))
    assert int(sample(block_spanning_weights(), make_generator(3))) == token


@pytest.mark.parametrize(
    "weights", [torch.zeros(8), torch.tensor([0.5, float("nan")]), torch.tensor([-1.0, 2.0])]
)
def test_sample_refuses_weights_it_cannot_draw_from(weights):
    with pytest.raises(ValueError, match="cannot sample"):
        sample(weights, make_generator(0))


def test_make_generator_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    gen = make_generator(99)
    sample(torch.full((10,), 0.1), gen)
    assert torch.equal(torch.rand(3), expected)
    unseeded = [int(sample(torch.full((1000,), 1e-3), make_generator(None))) for _ in range(5)]
    assert len(set(unseeded)) > 1
