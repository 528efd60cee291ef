"""The eagle proposer in the engine: lossless greedy output with accepted trees, its cache of true
features, tree limits, loading through the registry, and exact sampling (chi-square)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_llama
from tests.proposers.heads_checks import (
    PROMPTS,
    SAMPLINGS,
    assert_greedy_equals_plain_with_deep_trees,
    assert_lossless_on_the_int8_path,
    assert_trees_sample_the_target,
    mid_generation,
    plain_outputs,
)
from tests.training.tiny import trained
from verispec.config import SamplingConfig, SpecConfig
from verispec.costs import Curve, StepCostModel
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.identity import identify
from verispec.heads.io import save_heads
from verispec.heads.vocab import VocabHead
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.proposers.eagle import EagleProposer, EagleState
from verispec.types import Draft

pytestmark = pytest.mark.usefixtures("one_thread")


def eagle_proposer(
    model: HFCausalLM, drafter: EagleDrafter, nodes: int = 10, width: int = 3, expand_min_prob: float = 0.05
) -> EagleProposer:
    embeddings = model.model.get_input_embeddings()
    return EagleProposer(
        drafter, VocabHead(model, None), embeddings, nodes=nodes, width=width, expand_min_prob=expand_min_prob
    )


def eagle_engine(model: HFCausalLM, drafter: EagleDrafter, k: int = 4) -> SpecEngine:
    spec = SpecConfig(method="eagle", num_speculative_tokens=k, depth="fixed")
    return SpecEngine(model, eagle_proposer(model, drafter), spec)


def test_greedy_eagle_equals_plain_and_accepts_drafts(tiny_target):
    drafter, _, _ = trained(tiny_target, "eagle")
    assert_greedy_equals_plain_with_deep_trees(eagle_engine(tiny_target, drafter))


def test_eagle_with_feature_layers_drafts_from_the_fused_taps(tiny_target):
    """EAGLE-3's taps end to end: the engine asks the target for the drafter's layers in prefill and
    verify, greedy output equals plain with accepted trees, and the drafter's cache holds exactly
    the pairs of fused true features (the target's rows recomputed with their taps)."""
    drafter, _, _ = trained(tiny_target, "eagle", layers=(1,))
    engine = eagle_engine(tiny_target, drafter)
    assert engine.proposer.feature_layers == (1,)
    assert_greedy_equals_plain_with_deep_trees(engine)
    seq = mid_generation(engine, PROMPTS[1], steps=5)
    state, ids = seq.proposer_state, seq.token_ids
    rows = tiny_target.forward_batch(
        [tiny_target.new_cache()], [ids[:-1]], logits_to_keep=[0], hidden_to_keep=[len(ids) - 1],
        feature_layers=(1,),
    ).hidden[0]  # fmt: skip
    n = state.fed
    embeds = tiny_target.model.get_input_embeddings()(torch.tensor(ids[1 : n + 1]))[None]
    with torch.no_grad():
        features = drafter.fuse(rows[:n])[None]
        _, keys, _ = drafter(embeds, features, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    torch.testing.assert_close(state.cache.keys, keys[0], rtol=1e-4, atol=1e-4)


def test_heads_fusing_layers_the_target_lacks_are_refused(tmp_path, tiny_target):
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target, feature_layers=(5,)))
    save_heads(tmp_path / "eagle", "eagle", drafter, identify(tiny_target), None)
    with pytest.raises(VerispecError, match="feature layers \\[5\\] do not exist"):
        build_proposer(SpecConfig(method="eagle", heads=str(tmp_path)), tiny_target, None)


def test_greedy_eagle_on_the_int8_path_equals_plain():
    assert_lossless_on_the_int8_path(EagleProposer, lambda p: p.drafter.fc, k=4, nodes=10)


def test_the_draft_cache_holds_every_committed_pair_with_true_features(tiny_target):
    """After some steps the drafter's cache equals one causal pass over all pairs (h_j, x_{j+1}) with
    the target's hidden states computed afresh: nothing drafted leaked into it."""
    drafter, _, _ = trained(tiny_target, "eagle")
    engine = eagle_engine(tiny_target, drafter)
    seq = mid_generation(engine, PROMPTS[0], steps=5)
    state = seq.proposer_state
    ids = seq.token_ids
    hidden = tiny_target.forward(
        torch.tensor([ids[:-1]]), tiny_target.new_cache(), logits_to_keep=0, return_hidden=True
    ).hidden[0]
    n = state.fed
    assert n + sum(p.shape[0] for p in state.pending) == len(ids) - 1
    embeds = tiny_target.model.get_input_embeddings()(torch.tensor(ids[1 : n + 1]))[None]
    with torch.no_grad():
        _, keys, _ = drafter(
            embeds, hidden[None, :n], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
        )
    torch.testing.assert_close(state.cache.keys, keys[0], rtol=1e-4, atol=1e-4)


def test_trees_stay_within_k_nodes_and_width(tiny_target):
    drafter, _, _ = trained(tiny_target, "eagle")
    proposer = eagle_proposer(tiny_target, drafter, nodes=7, width=2, expand_min_prob=0.0)
    ids = [1, 2, 3, 4]
    state = proposer.new_state(ids, SamplingConfig())
    assert proposer.propose(state, [9], 3).tokens.numel() == 0  # a one-token prompt: nothing yet
    hidden = tiny_target.forward(
        torch.tensor([ids[:-1]]), tiny_target.new_cache(), logits_to_keep=0, return_hidden=True
    )
    proposer.prefill(state, hidden.hidden[0])
    for k in (1, 2, 5):
        tree = proposer.propose(state, ids, k)
        assert tree.scores is not None and tree.probs is None  # a scored tree of deterministic candidates
        assert max(tree.depths()) <= k and tree.size <= 7 and len(tree.children()[0]) <= 2
        assert tree.size == {1: 2, 2: 2 + 2 * 2, 5: 7}[k]  # level 1, then 2 expanded x 2 children
    assert state.cache.length == len(ids) - 1  # drafting left the cache alone


def count_passes(drafter: EagleDrafter, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an entry per drafting pass (:meth:`EagleDrafter.step` call) of ``drafter``:
    the pass's row count."""
    calls: list[int] = []
    real = drafter.step
    monkeypatch.setattr(
        drafter, "step", lambda embeds, *args: (calls.append(len(embeds)), real(embeds, *args))[1]
    )
    return calls


def test_levels_without_a_likely_node_are_not_expanded(tiny_target, monkeypatch):
    """Expansion stops at the first level whose best path probability is below expand_min_prob:
    none past level 1 at a threshold of 1, and the drafter runs once per expanded level."""
    drafter, _, _ = trained(tiny_target, "eagle")
    ids = [5, 17, 42, 8, 9]
    hidden = tiny_target.forward(
        torch.tensor([ids[:-1]]), tiny_target.new_cache(), logits_to_keep=0, return_hidden=True
    ).hidden[0]
    calls = count_passes(drafter, monkeypatch)  # the drafter is shared: monkeypatch restores it
    shapes = {}
    for threshold in (0.0, 0.3, 1.0):
        proposer = eagle_proposer(tiny_target, drafter, nodes=40, width=2, expand_min_prob=threshold)
        state = proposer.new_state(ids, SamplingConfig())
        proposer.prefill(state, hidden)
        proposer.propose(state, ids, 1)  # catch up on the prompt first
        calls.clear()
        tree = proposer.propose(state, ids, 5)
        assert tree.scores is not None
        shapes[threshold] = (max(tree.depths()), len(calls))
        assert len(calls) == max(tree.depths()) - 1  # one drafter pass per expanded level
        if threshold:  # every expanded node's parent level had a node at the threshold
            for depth in range(2, max(tree.depths()) + 1):
                level_above = [
                    s for s, d in zip(tree.scores.tolist(), tree.depths(), strict=True) if d == depth - 1
                ]
                assert max(level_above) >= math.log(threshold)
    assert shapes[0.0] == (5, 4) and shapes[1.0] == (1, 0)
    assert shapes[1.0][0] <= shapes[0.3][0] <= shapes[0.0][0]


def caught_up(model: HFCausalLM, width: int) -> tuple[EagleDrafter, EagleProposer, EagleState, list[int]]:
    """A trained drafter's proposer (40 nodes, no ``expand_min_prob``) and a state caught up on a
    prompt, ready to draft trees from it (again and again: drafting leaves the state as it was)."""
    drafter, _, _ = trained(model, "eagle")
    ids = [5, 17, 42, 8, 9]
    hidden = model.forward(
        torch.tensor([ids[:-1]]), model.new_cache(), logits_to_keep=0, return_hidden=True
    ).hidden[0]
    proposer = eagle_proposer(model, drafter, nodes=40, width=width, expand_min_prob=0.0)
    state = proposer.new_state(ids, SamplingConfig())
    proposer.prefill(state, hidden)
    proposer.propose(state, ids, 1)  # catch up on the prompt first
    return drafter, proposer, state, ids


def test_the_policy_floor_stops_expansion_like_expand_min_prob(tiny_target, monkeypatch):
    """``min_logp`` (the depth policy's floor) cuts expansion as ``expand_min_prob`` does: a level
    whose best node is below it is not expanded, so no drafter pass is spent on children the
    policy could not keep."""
    drafter, proposer, state, ids = caught_up(tiny_target, width=2)
    calls = count_passes(drafter, monkeypatch)
    depths = {}
    for floor in (-math.inf, 0.0):
        calls.clear()
        (tree,) = proposer.propose_batch([state], [ids], [5], min_logp=floor)
        assert tree.scores is not None
        depths[floor] = (max(tree.depths()), len(calls))
    assert depths == {-math.inf: (5, 4), 0.0: (1, 0)}


def _paths(tree: Draft) -> dict[tuple[int, ...], float]:
    """Each node's token path from the root, with its score."""
    assert tree.scores is not None
    tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return dict(zip(paths, scores, strict=True))


def test_within_a_level_only_nodes_at_the_policy_floor_are_expanded(tiny_target, monkeypatch):
    """Of a level's ``width`` best nodes, those below ``min_logp`` get no children (theirs could only
    score lower): fewer drafter rows, and every node at or above the floor is still drafted, with
    the same path and score as without the floor."""
    drafter, proposer, state, ids = caught_up(tiny_target, width=3)
    rows = count_passes(drafter, monkeypatch)
    (whole,) = proposer.propose_batch([state], [ids], [3])
    whole_rows = sum(rows)
    first = sorted((s for p, s in _paths(whole).items() if len(p) == 1), reverse=True)
    assert first[0] > first[-1]  # a floor between them cuts inside the level
    floor = (first[0] + first[-1]) / 2
    rows.clear()
    (cut,) = proposer.propose_batch([state], [ids], [3], min_logp=floor)
    assert cut.scores is not None
    got, want = _paths(cut), _paths(whole)
    kept = {p: s for p, s in want.items() if s >= floor}
    assert set(kept) <= set(got)
    assert all(got[p] == pytest.approx(s, abs=1e-4) for p, s in kept.items())
    parents = {p[:-1] for p in got if len(p) > 1}
    assert all(want[p] >= floor for p in parents)  # nothing below the floor was expanded
    assert 0 < sum(rows) < whole_rows


def test_the_engine_skips_drafting_when_no_node_could_pay(tiny_target, monkeypatch):
    """Where every verify token costs more than a plain step, no node is worth verifying: the
    engine does not ask the drafter at all (and decodes plainly); where verifying is nearly free
    it drafts and gets trees accepted. Greedy output equals plain decoding either way."""
    drafter, _, _ = trained(tiny_target, "eagle")
    want = plain_outputs(tiny_target, PROMPTS[:2], 20)
    spec = SpecConfig(method="eagle", num_speculative_tokens=4, depth="adaptive")
    for curve, drafts in (((0.010, 0.700), False), ((0.100, 0.110), True)):
        proposer = eagle_proposer(tiny_target, drafter)
        calls = count_passes(drafter, monkeypatch)
        costs = StepCostModel(Curve((1, 64), curve), correction=0.0)  # the curve as given, not learned
        engine = SpecEngine(tiny_target, proposer, spec, costs=costs)
        got = engine.generate_batch(PROMPTS[:2], max_new_tokens=20)
        assert [g.token_ids for g in got] == want
        assert bool(calls) == drafts
        assert (sum(g.stats.num_accepted for g in got) > 0) == drafts


def test_a_batch_drafts_what_each_sequence_drafts_alone_in_one_pass_per_level(tiny_target, monkeypatch):
    """propose_batch: sequences of different lengths, depths and backlogs draft the same trees as one
    by one, with one catch-up pass and one pass per level for the whole batch, and their caches end
    up the same."""
    drafter, _, _ = trained(tiny_target, "eagle")
    prompts = [[5, 17, 42, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [11]]
    ks = [5, 3, 4, 2]
    proposer = eagle_proposer(tiny_target, drafter, nodes=40, width=2, expand_min_prob=0.0)
    alone = [proposer.new_state(ids, SamplingConfig()) for ids in prompts]
    together = [proposer.new_state(ids, SamplingConfig()) for ids in prompts]
    calls = count_passes(drafter, monkeypatch)
    for ids, a, b in zip(prompts[:3], alone[:3], together[:3], strict=True):
        hidden = tiny_target.forward(
            torch.tensor([ids[:-1]]), tiny_target.new_cache(), logits_to_keep=0, return_hidden=True
        ).hidden[0]
        for state in (a, b):
            proposer.prefill(state, hidden)
    for _ in range(2):
        expected = [proposer.propose(s, ids, k) for s, ids, k in zip(alone, prompts, ks, strict=True)]
        calls.clear()
        got = proposer.propose_batch(together, prompts, ks)
        assert len(calls) == 1 + max(ks) - 1  # one catch-up pass, then one per expanded level
        assert got[3].tokens.numel() == 0  # a one-token prompt has no feature to draft from yet
        for e, g in zip(expected[:3], got[:3], strict=True):
            assert e.scores is not None and g.scores is not None
            assert torch.equal(e.tokens, g.tokens) and torch.equal(e.parents, g.parents)
            torch.testing.assert_close(e.scores, g.scores, rtol=1e-4, atol=1e-5)
        assert [max(t.depths()) for t in got[:3]] == ks[:3]  # deep trees, not a vacuous match
        for a, b in zip(alone, together, strict=True):
            torch.testing.assert_close(a.cache.keys, b.cache.keys, rtol=1e-4, atol=1e-5)
        # Next round: each sequence commits a different number of tokens (different backlogs).
        for i, ids in enumerate(prompts[:3]):
            ids.extend(range(20, 21 + i))
            hidden = tiny_target.forward(
                torch.tensor([ids[:-1]]), tiny_target.new_cache(), logits_to_keep=0, return_hidden=True
            ).hidden[0, -(i + 1) :]
            for state in (alone[i], together[i]):
                proposer.update(state, ids, i, hidden)


def test_registry_loads_eagle_heads_and_refuses_another_target(tmp_path, tiny_target):
    drafter, vocab, _ = trained(tiny_target, "eagle", draft_vocab=40, epochs=2)
    save_heads(tmp_path / "eagle", "eagle", drafter, identify(tiny_target), vocab)
    proposer = build_proposer(
        SpecConfig(method="eagle", heads=str(tmp_path), tree_nodes=5), tiny_target, None
    )
    assert isinstance(proposer, EagleProposer) and proposer.nodes == 5 and proposer.vocab_head.size == 40
    engine = SpecEngine(
        tiny_target, proposer, SpecConfig(method="eagle", num_speculative_tokens=3, depth="fixed")
    )
    got = engine.generate_batch(PROMPTS, max_new_tokens=20)
    assert [g.token_ids for g in got] == plain_outputs(tiny_target, PROMPTS, 20)
    with pytest.raises(VerispecError, match="not for other-tiny"):
        build_proposer(
            SpecConfig(method="eagle", heads=str(tmp_path)), HFCausalLM(tiny_llama(5), "other-tiny"), None
        )


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_eagle_engine_samples_the_target_distribution(small_vocab_target, prefix_logits, sampling):
    """A random drafter's 3-deep dynamic trees: the sampled sequences must follow the target's joint
    distribution whatever the drafter proposes."""
    torch.manual_seed(4)
    drafter = EagleDrafter(EagleConfig.for_target(small_vocab_target)).eval()
    engine = SpecEngine(
        small_vocab_target,
        eagle_proposer(small_vocab_target, drafter, nodes=6, width=3),
        SpecConfig(method="eagle", num_speculative_tokens=3, depth="fixed"),
    )
    assert_trees_sample_the_target(engine, prefix_logits, sampling)
