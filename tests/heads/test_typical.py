"""Typical acceptance (Medusa): its rule, its choice of path, and proof that it is LOSSY (by design)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_engine import PROMPTS
from tests.tree_proposer import TopTwoTree
from verispec.config import NgramConfig, SamplingConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.types import Draft
from verispec.verify import make_verifier, typical, verify

T1 = SamplingConfig(temperature=1.0)

pytestmark = pytest.mark.usefixtures("one_thread")


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_threshold_is_min_of_epsilon_and_entropy_term():
    uniform = torch.full((4,), 0.25)
    assert typical.threshold(uniform, 0.09, 0.3) == pytest.approx(min(0.09, 0.3 * math.exp(-math.log(4))))
    one_hot = torch.tensor([1.0, 0.0, 0.0])
    assert typical.threshold(one_hot, 0.09, 0.3) == pytest.approx(0.09)  # H = 0: the hard threshold
    flat = torch.full((1000,), 1e-3)
    assert typical.threshold(flat) == pytest.approx(0.3 / 1000)  # unsure target: a low bar


def test_a_candidate_is_accepted_iff_its_probability_clears_the_threshold():
    probs = [0.5, 0.3, 0.15, 0.05]
    p = torch.tensor(probs, dtype=torch.float64)
    limit = typical.threshold(p)  # = min(0.09, 0.3 * exp(-H)) ~ 0.09 here
    rows = torch.stack([logits_of(probs)] * 2)  # root, then after the single node
    for token, prob in enumerate(probs):
        tree = Draft(torch.tensor([token]), torch.tensor([-1]))
        result = typical.verify_typical(tree, rows, T1, torch.Generator().manual_seed(0))
        assert result.num_accepted == int(prob > limit), (token, prob, limit)
        assert len(result.tokens) == result.num_accepted + 1


def test_the_longest_accepted_path_wins_then_the_likelier():
    # Root children: a (p 0.6), b (p 0.4). Under a: x (p 0.01, rejected). Under b: y (p 0.9, accepted).
    v = 6
    rows = torch.full((5, v), -30.0)
    rows[0, 0], rows[0, 1] = math.log(0.6), math.log(0.4)
    rows[1, 2], rows[1, 5] = math.log(0.01), math.log(0.99)  # after a
    rows[2, 3], rows[2, 5] = math.log(0.9), math.log(0.1)  # after b
    tree = Draft(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, -1, 0, 1]))
    result = typical.verify_typical(tree, rows, T1, torch.Generator().manual_seed(1))
    assert result.path == (1, 3)  # b then y: longer than a alone, although a is likelier
    # Equal lengths: the likelier path.
    short = Draft(torch.tensor([0, 1]), torch.tensor([-1, -1]))
    assert typical.verify_typical(short, rows[:3], T1, None).path == (0,)


def test_greedy_is_exact_verification():
    rows = torch.randn(4, 10)
    tree = Draft(torch.tensor([int(rows[0].argmax()), 3, 4]), torch.tensor([-1, -1, 0]))
    chain = Draft.chain(torch.tensor([int(rows[0].argmax()), int(rows[1].argmax()), 4]))
    greedy = SamplingConfig()
    for draft in (tree, chain):
        assert typical.verify_typical(draft, rows, greedy, None) == verify(draft, rows, greedy, None)


def test_typical_acceptance_is_lossy():
    """A candidate with p = 0.5 clears the threshold, so it is *always* accepted: the first token is
    then that candidate with probability 1 instead of the target's 0.5. Exact verification keeps 0.5."""
    probs = [0.5, 0.3, 0.2]
    rows = torch.stack([logits_of(probs)] * 2)
    draft = Draft.chain(torch.tensor([0]))
    gen = torch.Generator().manual_seed(0)
    firsts_typical = [make_verifier("typical")(draft, rows, T1, gen).tokens[0] for _ in range(400)]
    firsts_exact = [make_verifier("exact")(draft, rows, T1, gen).tokens[0] for _ in range(400)]
    assert firsts_typical.count(0) == 400
    assert 160 < firsts_exact.count(0) < 240  # ~ Binomial(400, 0.5)


def test_chains_use_the_same_rule():
    probs = [0.5, 0.3, 0.2]
    rows = torch.stack([logits_of(probs)] * 3)
    draft = Draft.chain(torch.tensor([0, 2]))  # 0.5 accepted, then 0.2 accepted too (both > 0.09)
    result = typical.verify_typical(draft, rows, T1, torch.Generator().manual_seed(0))
    assert result.num_accepted == 2 and result.num_drafted == 2 and result.tokens[:2] == [0, 2]
    greedy = typical.verify_typical(draft, rows, SamplingConfig(), None)
    assert greedy.tokens[0] == 0 and greedy.num_accepted == 1  # greedy: argmax 0 then 0 != 2


def test_acceptance_setting_is_validated():
    assert SpecConfig(acceptance="typical").acceptance == "typical"
    with pytest.raises(VerispecError, match="acceptance must be"):
        SpecConfig(acceptance="sloppy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="acceptance"):
        make_verifier("sloppy")  # type: ignore[arg-type]


def test_the_engine_runs_with_typical_acceptance(tiny_target, tiny_draft):
    """``SpecConfig(acceptance="typical")``: trees verified with the lossy rule when sampling, greedy
    output still equal to plain."""
    spec = SpecConfig(method="draft", num_speculative_tokens=2, depth="fixed", acceptance="typical")
    engine = SpecEngine(tiny_target, TopTwoTree(tiny_draft), spec)
    sampled = engine.generate([5, 17, 42], max_new_tokens=20, temperature=1.0, seed=0)
    assert len(sampled.token_ids) == 20 and sampled.stats.num_accepted > 0
    plain = SpecEngine(tiny_target, None, SpecConfig()).generate([5, 17, 42], max_new_tokens=20)
    assert engine.generate([5, 17, 42], max_new_tokens=20).token_ids == plain.token_ids  # greedy: exact


def _engine(kind: str, acceptance: str, target: HFCausalLM, draft: HFCausalLM) -> SpecEngine:
    """Prompt lookup's chains, or the draft model's top-two trees, verified by ``acceptance``."""
    spec = SpecConfig(
        method="ngram" if kind == "chain" else "draft",
        num_speculative_tokens=3,
        depth="fixed",
        acceptance=acceptance,  # type: ignore[arg-type]
        ngram=NgramConfig(max_ngram=3, min_ngram=1),
    )
    proposer = build_proposer(spec, target, None) if kind == "chain" else TopTwoTree(draft)
    return SpecEngine(target, proposer, spec)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_typical_acceptance_keeps_more_drafts_than_exact_through_the_engine(tiny_target, tiny_draft, kind):
    """The setting must reach the step. At temperature 1, deterministic candidates (prompt lookup's
    chains, the draft model's top-two trees) are kept by exact verification only where the target's
    own sample is one of them, and by the typical rule wherever the target finds them plausible:
    on the same prompts and seeds, typical acceptance keeps far more of them."""
    rates = {}
    for acceptance in ("exact", "typical"):
        engine = _engine(kind, acceptance, tiny_target, tiny_draft)
        gens = [engine.generate(p, max_new_tokens=30, temperature=1.0, seed=0) for p in PROMPTS]
        drafted = sum(g.stats.num_drafted for g in gens)
        assert drafted > 0, acceptance
        rates[acceptance] = sum(g.stats.num_accepted for g in gens) / drafted
    assert rates["typical"] > rates["exact"] + 0.25, rates
