"""The medusa proposer in the engine: lossless greedy output with accepted trees, the hidden state it
drafts from, loading through the registry, and exact sampling (chi-square, as the engine's tests)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_llama
from tests.proposers.heads_checks import (
    PROMPTS,
    assert_greedy_equals_plain_with_deep_trees,
    assert_lossless_on_the_int8_path,
    assert_trees_sample_the_target,
    mid_generation,
    plain_outputs,
)
from tests.training.tiny import trained
from verispec.config import SamplingConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.heads.identity import identify
from verispec.heads.io import save_heads
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.heads.vocab import VocabHead
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.proposers.medusa import MedusaProposer

pytestmark = pytest.mark.usefixtures("one_thread")


def medusa_engine(model: HFCausalLM, heads: MedusaHeads, k: int = 3, nodes: int = 8) -> SpecEngine:
    spec = SpecConfig(method="medusa", num_speculative_tokens=k, depth="fixed")
    proposer = MedusaProposer(heads, VocabHead(model, None), nodes=nodes, width=3)
    return SpecEngine(model, proposer, spec)


def test_greedy_medusa_equals_plain_and_accepts_drafts(tiny_target):
    heads, _, _ = trained(tiny_target, "medusa")
    assert_greedy_equals_plain_with_deep_trees(medusa_engine(tiny_target, heads))


def test_greedy_medusa_on_the_int8_path_equals_plain():
    assert_lossless_on_the_int8_path(MedusaProposer, lambda p: p.heads.medusa_head[0][0].linear, k=3, nodes=8)


def test_the_proposer_drafts_from_the_state_before_the_pending_token(tiny_target):
    heads, _, _ = trained(tiny_target, "medusa")
    engine = medusa_engine(tiny_target, heads)
    seq = mid_generation(engine, PROMPTS[1], steps=4)
    ids = seq.token_ids[:-1]  # the pending (last) token has not been through the target yet
    fresh = tiny_target.forward(
        torch.tensor([ids]), tiny_target.new_cache(), logits_to_keep=0, return_hidden=True
    )
    torch.testing.assert_close(seq.proposer_state.last_hidden, fresh.hidden[0, -1], rtol=1e-4, atol=1e-4)


def test_tree_shape_follows_k_nodes_and_width(tiny_target):
    heads, _, _ = trained(tiny_target, "medusa")
    proposer = MedusaProposer(heads, VocabHead(tiny_target, None), nodes=10, width=4)
    state = proposer.new_state([1, 2, 3], SamplingConfig())
    assert proposer.propose(state, [1, 2, 3], 3).tokens.numel() == 0  # nothing seen yet
    proposer.prefill(state, torch.randn(2, 64, generator=torch.Generator().manual_seed(0)))
    wide = MedusaProposer(heads, VocabHead(tiny_target, None), nodes=4 + 16 + 64, width=4)
    for k, depth in ((1, 1), (2, 2), (5, 3)):  # at most k deep, and at most one level per head
        tree = proposer.propose(state, [1, 2, 3], k)
        assert tree.scores is not None and tree.probs is None  # a scored tree of deterministic candidates
        assert max(tree.depths()) <= depth and tree.size == min(10, 4 * (1 if k == 1 else 10))
        assert len(tree.children()[0]) <= 4
        # With nodes for every path, the tree is exactly that deep (the best 10 need not reach it).
        assert max(wide.propose(state, [1, 2, 3], k).depths()) == depth


def test_registry_loads_heads_from_a_folder_and_refuses_another_target(tmp_path, tiny_target):
    heads, vocab, _ = trained(tiny_target, "medusa")
    save_heads(tmp_path, "medusa", heads, identify(tiny_target), vocab, tree={"nodes": 6, "width": 2})
    spec = SpecConfig(method="medusa", heads=str(tmp_path), num_speculative_tokens=3, tree_width=3)
    proposer = build_proposer(spec, tiny_target, None)
    assert isinstance(proposer, MedusaProposer) and (proposer.nodes, proposer.width) == (6, 3)
    other = HFCausalLM(tiny_llama(5), name="other-tiny")
    with pytest.raises(VerispecError, match="trained for tiny-target, not for other-tiny"):
        build_proposer(spec, other, None)
    with pytest.raises(VerispecError, match="no medusa heads are shipped for other-tiny"):
        build_proposer(SpecConfig(method="medusa"), other, None)


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)],
    ids=["temperature-1", "temperature-0.7-top-p-0.9"],
)
def test_medusa_engine_samples_the_target_distribution(small_vocab_target, prefix_logits, sampling):
    """Random heads (they need not be good: only acceptance depends on them) proposing 2-deep trees of
    top-3 candidates; every sampled sequence must still follow the target's joint distribution."""
    torch.manual_seed(3)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, num_heads=2))
    for p in heads.parameters():
        p.data.normal_(0, 0.2)
    assert_trees_sample_the_target(
        medusa_engine(small_vocab_target, heads, k=2, nodes=6), prefix_logits, sampling
    )


def test_the_adaptive_policy_sizes_trees_by_cost_and_stays_lossless(tiny_target):
    """A memory-bound cost curve keeps whole trees; where each verify token costs 10% of a step,
    trees shrink to the nodes the drafter is confident in. Greedy output equals plain decoding."""
    from verispec.costs import Curve, StepCostModel

    heads, _, _ = trained(tiny_target, "medusa")
    want = plain_outputs(tiny_target, PROMPTS[:2], 30)
    # correction=0: the curves as given (the tiny model's real steps would teach each token count
    # its own, nearly flat, cost)
    curves = {
        "flat": StepCostModel(Curve((1, 64), (0.100, 0.101)), correction=0.0),
        "steep": StepCostModel(Curve((1, 11), (0.100, 0.200)), correction=0.0),
    }
    rows: dict[str, list[int]] = {}
    for name, costs in curves.items():
        spec = SpecConfig(method="medusa", num_speculative_tokens=3, depth="adaptive")
        proposer = MedusaProposer(heads, VocabHead(tiny_target, None), nodes=8, width=3)
        seen: list[int] = []

        def spy(caches, tokens, *args, _seen=seen, **kwargs):
            _seen.extend(len(t) for t in tokens)
            return tiny_target.forward_batch(caches, tokens, *args, **kwargs)

        spied = copy.copy(tiny_target)
        spied.forward_batch = spy  # type: ignore[method-assign]
        engine = SpecEngine(spied, proposer, spec, costs=costs)
        got = [engine.generate(p, max_new_tokens=30) for p in PROMPTS[:2]]
        assert [g.token_ids for g in got] == want
        assert sum(g.stats.num_accepted for g in got) > 0, name
        rows[name] = seen
    assert max(rows["flat"]) == 8 + 1  # the pending token and the full tree
    mean = {name: sum(seen) / len(seen) for name, seen in rows.items()}
    assert mean["steep"] < mean["flat"] / 2, mean
