"""eagle+ngram and medusa+ngram: grafting prompt lookup's continuation onto a heads tree keeps the
tree valid and verification exact (greedy equality, chi-square), and the lookup branch is drafted,
scored from its own record and accepted where the heads alone are not. eagle+suffix and
medusa+suffix: the heads' tree merged with suffix decoding's, scope and release reaching both."""

from __future__ import annotations

import math

import pytest
import torch

import verispec
from tests.conftest import needs_smollm2
from tests.proposers.heads_checks import PROMPTS, SAMPLINGS, assert_trees_sample_the_target, plain_outputs
from tests.proposers.test_eagle import eagle_proposer
from tests.training.tiny import trained
from verispec.config import SamplingConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.identity import identify
from verispec.heads.io import save_heads
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.hybrid import HybridProposer, PairState, SuffixHybridProposer, graft, merge
from verispec.proposers.medusa import MedusaProposer
from verispec.proposers.ngram import NgramProposer
from verispec.proposers.suffix import SuffixProposer
from verispec.types import Draft

pytestmark = pytest.mark.usefixtures("one_thread")


def scored_tree(tokens: list[int], parents: list[int], probs: list[float]) -> Draft:
    return Draft(
        torch.tensor(tokens), torch.tensor(parents), scores=torch.tensor([math.log(p) for p in probs])
    )


def as_paths(tree: Draft) -> dict[tuple[int, ...], float]:
    """Each node as the token path from the root to it, with its acceptance probability."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    assert tree.scores is not None
    return {p: round(math.exp(s), 6) for p, s in zip(paths, tree.scores.tolist(), strict=True)}


def test_graft_merges_shared_prefixes_keeps_the_higher_score_and_sorts_best_first():
    # Heads tree: 7 (0.6) -> 8 (0.3); 9 (0.2). Lookup chain 7, 5, 6 with survival 0.5, 0.45, 0.4.
    tree = scored_tree([7, 8, 9], [-1, 0, -1], [0.6, 0.3, 0.2])
    merged = graft(tree, [7, 5, 6], [0.5, 0.45, 0.4])
    assert merged.scores is not None
    assert as_paths(merged) == {(7,): 0.6, (9,): 0.2, (7, 8): 0.3, (7, 5): 0.45, (7, 5, 6): 0.4}
    assert merged.tokens.tolist() == [7, 5, 6, 8, 9]  # best first; parents before children
    assert merged.scores is not None and bool((merged.scores[1:] <= merged.scores[:-1]).all())
    # A lookup node both drafters chose takes the lookup's score when it is the higher one.
    raised = graft(tree, [7, 8], [0.9, 0.8])
    assert as_paths(raised) == {(7,): 0.9, (9,): 0.2, (7, 8): 0.8}
    assert raised.size == 3


def test_graft_without_a_chain_or_without_a_tree():
    tree = scored_tree([7], [-1], [0.6])
    assert graft(tree, [], []) is tree
    alone = graft(Draft.empty(), [4, 4], [0.7, 0.5])
    assert alone.scores is not None and as_paths(alone) == {(4,): 0.7, (4, 4): 0.5}
    assert graft(Draft.empty(), [], []).size == 0
    with pytest.raises(TypeError, match="scored tree"):
        graft(Draft.chain(torch.tensor([1, 2])), [3], [0.5])


def hybrid_engine(model: HFCausalLM, drafter: EagleDrafter, k: int = 4) -> SpecEngine:
    spec = SpecConfig(method="eagle+ngram", num_speculative_tokens=k, depth="fixed")
    proposer = HybridProposer(eagle_proposer(model, drafter, nodes=6, width=2), NgramProposer(spec))
    return SpecEngine(model, proposer, spec)


def test_greedy_equals_plain_and_lookup_adds_accepted_tokens(tiny_target):
    """An untrained EAGLE layer hardly ever drafts right; with the lookup branch the same engine
    accepts more (a random model's greedy text falls into loops that lookup copies), and output is
    unchanged, one request at a time and batched."""
    torch.manual_seed(3)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target)).eval()
    want = plain_outputs(tiny_target, PROMPTS, 40)
    eagle_only = SpecEngine(
        tiny_target,
        eagle_proposer(tiny_target, drafter, nodes=6, width=2),
        SpecConfig(method="eagle", num_speculative_tokens=4, depth="fixed"),
    ).generate_batch(PROMPTS, max_new_tokens=40)
    engine = hybrid_engine(tiny_target, drafter)
    alone = [engine.generate(p, max_new_tokens=40) for p in PROMPTS]
    batched = engine.generate_batch(PROMPTS, max_new_tokens=40)
    assert [g.token_ids for g in alone] == want
    assert [g.token_ids for g in batched] == want
    hybrid_accepted = sum(g.stats.num_accepted for g in batched)
    assert hybrid_accepted > 2 * sum(g.stats.num_accepted for g in eagle_only) + 10, hybrid_accepted
    assert sum(sum(g.stats.accepted_at[1:]) for g in batched) > 0  # beyond depth 1
    proposer = engine.proposer
    assert isinstance(proposer, HybridProposer)
    assert proposer.prior.counts.hits[0] > 0 and proposer.prior.counts.tries[0] > 0


def test_a_hybrid_asks_for_its_drafter_s_feature_layers(tiny_target):
    drafter, _, _ = trained(tiny_target, "eagle", layers=(1,))
    engine = hybrid_engine(tiny_target, drafter)
    assert engine.proposer.feature_layers == (1,)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    got = engine.generate(prompt, max_new_tokens=20)
    assert got.token_ids == plain_outputs(tiny_target, [prompt], 20)[0]
    assert got.stats.accepted_at[0] > 0


def test_the_lookup_record_counts_matches_against_what_was_committed(tiny_target):
    """Chain [a, b, c] and a step that committed [a, b, x]: positions 1-2 matched, 3 did not; a
    chain longer than the step's commit is judged only as far as the commit goes."""
    drafter, _, _ = trained(tiny_target, "eagle")
    proposer = HybridProposer(eagle_proposer(tiny_target, drafter), NgramProposer(SpecConfig()))
    state = proposer.new_state([1, 2], SamplingConfig())
    hidden = torch.zeros(3, tiny_target.hidden_size)
    state.chain = [5, 6, 7]
    proposer.update(state, [1, 2, 5, 6, 9], num_accepted=2, hidden=hidden)
    counts = state.acceptance.counts
    assert counts.hits == [1.0, 1.0, 0.0] and counts.tries == [1.0, 1.0, 1.0]
    assert state.chain == []
    state.chain = [9, 9, 9, 9]
    proposer.update(state, [1, 2, 5, 6, 9, 9], num_accepted=0, hidden=hidden[:1])
    assert state.acceptance.counts.tries[0] == pytest.approx(0.9 + 1.0)  # one position judged
    assert state.acceptance.counts.hits[0] == pytest.approx(0.9 + 1.0)
    before = state.acceptance.survival(3)
    state.chain = [4, 4, 4]
    proposer.update(state, [1, 2, 5, 6, 9, 9, 3], num_accepted=0, hidden=hidden[:1])
    assert state.acceptance.survival(3)[0] < before[0]


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize(("plus", "hybrid"), [("ngram", HybridProposer), ("suffix", SuffixHybridProposer)])
def test_registry_builds_every_hybrid_from_saved_heads(tmp_path, tiny_target, kind, plus, hybrid):
    module, vocab, _ = trained(tiny_target, kind)
    save_heads(tmp_path / kind, kind, module, identify(tiny_target), vocab)
    spec = SpecConfig(method=f"{kind}+{plus}", heads=str(tmp_path), num_speculative_tokens=3, depth="fixed")
    proposer = build_proposer(spec, tiny_target, None)
    assert isinstance(proposer, hybrid) and proposer.name == f"{kind}+{plus}"
    assert isinstance(proposer.heads, {"eagle": EagleProposer, "medusa": MedusaProposer}[kind])
    got = SpecEngine(tiny_target, proposer, spec).generate_batch(PROMPTS, max_new_tokens=20)
    assert [g.token_ids for g in got] == plain_outputs(tiny_target, PROMPTS, 20)
    assert sum(g.stats.num_accepted for g in got) > 0


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_hybrid_engine_samples_the_target_distribution(small_vocab_target, prefix_logits, sampling):
    """A random EAGLE layer's trees with the lookup chain grafted on (the prompt repeats a token, so
    lookup drafts from the first step): sampled sequences follow the target's joint distribution."""
    torch.manual_seed(4)
    drafter = EagleDrafter(EagleConfig.for_target(small_vocab_target)).eval()
    engine = hybrid_engine(small_vocab_target, drafter, k=3)
    proposer = engine.proposer
    assert isinstance(proposer, HybridProposer)
    chains: list[int] = []
    lookup = proposer.lookup.propose

    def counted(*args: object) -> Draft:
        draft = lookup(*args)  # type: ignore[arg-type]
        chains.append(draft.size)
        return draft

    proposer.lookup.propose = counted  # type: ignore[method-assign]
    assert_trees_sample_the_target(engine, prefix_logits, sampling)
    assert sum(k > 0 for k in chains) > 500 and sum(k > 1 for k in chains) > 200, "lookup hardly drafted"


# ------------------------------------------------------------------------------------ +suffix


def test_merge_keeps_the_higher_score_of_shared_nodes_and_sorts_best_first():
    heads = scored_tree([7, 8, 9], [-1, 0, -1], [0.6, 0.3, 0.2])
    suffix = scored_tree([7, 5, 8], [-1, 0, 0], [0.8, 0.5, 0.4])
    merged = merge(heads, suffix)
    assert as_paths(merged) == {(7,): 0.8, (7, 5): 0.5, (7, 8): 0.4, (9,): 0.2}
    assert merged.tokens.tolist() == [7, 5, 8, 9] and merged.parents.tolist() == [-1, 0, 0, -1]
    assert merge(heads, Draft.empty()) is heads
    assert as_paths(merge(Draft.empty(), suffix)) == as_paths(suffix)
    with pytest.raises(TypeError, match="scored tree"):
        merge(heads, Draft.chain(torch.tensor([1, 2])))


def test_a_suffix_hybrid_forwards_scope_and_release_and_sizes_for_both(tiny_target):
    drafter, _, _ = trained(tiny_target, "eagle")
    spec = SpecConfig(method="eagle+suffix", num_speculative_tokens=4, depth="fixed")
    heads = eagle_proposer(tiny_target, drafter, nodes=6, width=2)
    proposer = SuffixHybridProposer(heads, SuffixProposer(spec))
    assert proposer.name == "eagle+suffix" and proposer.drafts_trees and proposer.needs_hidden
    assert proposer.max_tree_size(4) == heads.max_tree_size(4) + proposer.suffix.max_tree_size(4)
    engine = SpecEngine(tiny_target, proposer, spec)
    want = plain_outputs(tiny_target, PROMPTS, 30)
    first = [engine.generate(p, max_new_tokens=30, cache_scope="a") for p in PROMPTS]
    again = [engine.generate(p, max_new_tokens=30, cache_scope="a") for p in PROMPTS]
    private = [engine.generate(p, max_new_tokens=30, cache_scope=None) for p in PROMPTS]
    assert (
        [g.token_ids for g in first] == [g.token_ids for g in again] == [g.token_ids for g in private] == want
    )
    assert set(proposer.suffix.cache.scopes) == {"a"}  # released outputs, private ones not kept
    assert sum(g.stats.num_accepted for g in again) > sum(g.stats.num_accepted for g in first)


def test_a_sure_suffix_tree_drafts_without_the_heads(tiny_target, monkeypatch):
    """Where the suffix tree alone expects at least what the heads' trees have expected on average,
    the heads are not asked for that sequence; elsewhere both trees are merged as before."""
    drafter, _, _ = trained(tiny_target, "eagle")
    spec = SpecConfig(method="eagle+suffix", num_speculative_tokens=4, depth="fixed")
    heads_proposer = eagle_proposer(tiny_target, drafter, nodes=6, width=2)
    proposer = SuffixHybridProposer(heads_proposer, SuffixProposer(spec))
    sure = scored_tree([5, 6, 7], [-1, 0, 1], [0.95, 0.9, 0.85])
    unsure = scored_tree([5], [-1], [0.3])
    heads_tree = scored_tree([9, 5], [-1, -1], [0.5, 0.4])
    assert sure.expected == pytest.approx(2.7) and heads_tree.expected == pytest.approx(0.9)
    assert Draft.empty().expected == 0.0
    suffix_trees = {"sure": sure, "unsure": unsure}
    monkeypatch.setattr(proposer.suffix, "draft", lambda state, ids, k, min_logp: suffix_trees[state])
    asked: list[list[str]] = []

    def heads(states, token_ids, ks, *, min_logp):
        asked.append(list(states))
        return [heads_tree] * len(states)

    monkeypatch.setattr(proposer.heads, "propose_batch", heads)
    states = [PairState(heads="sure", other="sure"), PairState(heads="unsure", other="unsure")]
    proposer.propose_batch(states, [[1, 2], [1, 2]], [4, 4])
    assert asked == [["sure", "unsure"]]  # nothing known of the heads yet: they draft for both
    assert proposer.heads_expected == pytest.approx(0.9)
    drafts = proposer.propose_batch(states, [[1, 2], [1, 2]], [4, 4])
    assert asked[-1] == ["unsure"]
    assert drafts[0] is sure
    assert as_paths(drafts[1]) == as_paths(merge(heads_tree, unsure)) == {(5,): 0.4, (9,): 0.5}


@pytest.mark.slow
@needs_smollm2
def test_eagle_plus_suffix_on_smollm2_equals_plain_and_reuses_its_scope_s_output():
    """The shipped SmolLM2 EAGLE heads with suffix decoding: greedy output equals plain decoding,
    drafts are accepted, and a repeated request in the same scope accepts more than the first."""
    engine = verispec.load(
        "smollm2-135m-instruct", method="eagle+suffix", num_speculative_tokens=6, depth="fixed"
    )
    prompt = engine.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses the words of a sentence."}]
    )
    plain = engine.plain_engine().generate(prompt, max_new_tokens=48)
    first = engine.generate(prompt, max_new_tokens=48, cache_scope="a")
    again = engine.generate(prompt, max_new_tokens=48, cache_scope="a")
    assert first.token_ids == again.token_ids == plain.token_ids
    assert first.stats.num_accepted > 0
    assert (
        again.stats.num_accepted > first.stats.num_accepted and again.stats.num_steps < first.stats.num_steps
    )
