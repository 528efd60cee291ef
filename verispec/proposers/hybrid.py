"""``eagle+ngram`` and ``medusa+ngram``: a learned drafter's token tree with prompt lookup's
continuation grafted on as one more branch; ``eagle+suffix`` and ``medusa+suffix``: the same tree
merged with suffix decoding's.

The two drafters are right in different places. Prompt lookup wins where the answer copies its
context (code edits, summaries, RAG: long runs, each accepted token nearly free to find) and has
nothing to offer elsewhere; heads draft everywhere but seldom more than two or three tokens deep
when trained on little data. One verify forward can check both: the lookup continuation is a chain
of deterministic candidates, so it merges into the heads' tree (shared prefixes become one path)
and tree verification stays exact (:mod:`verispec.verify.tree`).

Each lookup node gets a score like the heads' nodes, the log-probability that the path to it is
accepted, so the depth policy can size the merged tree as it sizes any scored tree. That probability
is measured, per sequence and position, by how far past lookup continuations matched the tokens
the step actually committed (shrunk toward an estimate over all sequences): it is known before this
step's verification, so sizing the tree by it cannot bias the output. A node that both drafters
proposed keeps the higher of its two scores; scores still never increase along a path.

``eagle+suffix``, ``medusa+suffix`` and ``eagle3+suffix`` merge suffix decoding's tree
(:mod:`verispec.proposers.suffix`) instead: it carries scores of its own (how often each path
followed the context's tail before), so the two scored trees merge node by node (:func:`merge`) and
the depth policy sizes the union. Both budgets count: the merged tree may hold both trees' nodes.
The scope, the release and every commit reach both parts: the suffix part adds the output to its
scope's cache when the sequence is released.

Where the suffix tree alone is expected to accept at least as many tokens as the heads' trees do on
average (the sum of its nodes' probabilities against a running mean of the heads' own), the heads
do not draft for that sequence in that step: on output that repeats earlier output (agents' calls,
code edits) the suffix tree is then long and sure, the heads' levels cost drafter passes and their
extra nodes verify rows that the policy would keep for little, and eagle+suffix ran behind suffix
decoding alone (a JSON tool-call loop on a 2-core Zen 5, the heads skipped in ~60% of steps: 1.71x
-> 1.85x plain over all calls, suffix decoding alone 1.85-1.92x; code editing 3.40x -> 3.55x;
HumanEval and Spec-Bench no slower). Their features keep arriving and are fed at their next draft
(:mod:`verispec.proposers.eagle`'s catch-up). Which drafter runs is decided before verification
from what both proposed before, so the output distribution is untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verispec.heads.trees import best_subtree
from verispec.policy import AcceptanceEstimate, AcceptancePrior
from verispec.proposers.base import BatchProposer, Proposer, ProposerFactory, register
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.eagle3 import Eagle3Proposer
from verispec.proposers.heads_base import HeadsProposer
from verispec.proposers.medusa import MedusaProposer
from verispec.proposers.ngram import NgramProposer
from verispec.proposers.suffix import SuffixProposer
from verispec.types import Draft

if TYPE_CHECKING:
    from verispec.config import SamplingConfig, SpecConfig
    from verispec.models.base import CausalLM
    from verispec.models.kv import KVBuffer
    from verispec.penalties import RequestRules


@dataclass
class PairState:
    heads: Any
    """The heads proposer's own per-sequence state."""
    other: Any
    """The model-free proposer's (prompt lookup's, suffix decoding's)."""


@dataclass
class HybridState(PairState):
    acceptance: AcceptanceEstimate
    """How deep this sequence's lookup continuations have matched what was committed."""
    chain: list[int]
    """The lookup continuation proposed at the last step (empty when there was none)."""


class HeadsPlus(BatchProposer):
    """A :class:`HeadsProposer`'s tree together with a model-free proposer's draft: what both
    combinations share (every hook reaches both parts; hidden states go to the heads)."""

    needs_hidden = True
    drafts_trees = True

    def __init__(self, heads: HeadsProposer, other: Proposer, kind: str) -> None:
        self.heads = heads
        self.other = other
        self.name = f"{heads.name}+{kind}"  # type: ignore[misc]  # one class, several registered names
        self.feature_layers = heads.feature_layers
        self.raw_features = heads.raw_features

    def constrain(self, state: PairState, rules: RequestRules) -> None:
        self.heads.constrain(state.heads, rules)
        self.other.constrain(state.other, rules)

    def set_scope(self, state: PairState, scope: str | None) -> None:
        self.heads.set_scope(state.heads, scope)
        self.other.set_scope(state.other, scope)

    def prefill(self, state: PairState, hidden: torch.Tensor) -> None:
        self.heads.prefill(state.heads, hidden)

    def prefix_kv(self, state: PairState) -> KVBuffer | None:
        return self.heads.prefix_kv(state.heads)

    def update(
        self,
        state: PairState,
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        self.heads.update(state.heads, token_ids, num_accepted, hidden)
        self.other.update(state.other, token_ids, num_accepted)

    def release(self, state: PairState) -> None:
        self.heads.release(state.heads)
        self.other.release(state.other)


class HybridProposer(HeadsPlus):
    """A :class:`HeadsProposer`'s tree plus prompt lookup's continuation (module docstring)."""

    def __init__(self, heads: HeadsProposer, lookup: NgramProposer) -> None:
        super().__init__(heads, lookup, "ngram")
        self.lookup = lookup
        self.prior = AcceptancePrior(mean=0.5)
        """Lookup's record over all sequences. Neutral where nothing is measured yet: the engine's
        optimistic 0.8 would rank an unmeasured lookup branch above most of the heads' nodes."""
        self.description: dict[str, object] = {
            **heads.description,
            "ngram": {"max_ngram": lookup.max_ngram, "min_ngram": lookup.min_ngram},
        }
        """What defines this proposer, for benchmark reports."""

    def max_tree_size(self, k: int) -> int:
        return self.heads.max_tree_size(k) + k  # the lookup branch may share no node with the tree

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> HybridState:
        return HybridState(
            heads=self.heads.new_state(prompt_ids, sampling),
            other=self.lookup.new_state(prompt_ids, sampling),
            acceptance=AcceptanceEstimate(self.prior),
            chain=[],
        )

    def propose_batch(
        self,
        states: Sequence[HybridState],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        *,
        min_logp: float = -math.inf,
    ) -> list[Draft]:
        trees = self.heads.propose_batch([s.heads for s in states], token_ids, ks, min_logp=min_logp)
        out: list[Draft] = []
        for state, ids, k, tree in zip(states, token_ids, ks, trees, strict=True):
            state.chain = self.lookup.propose(state.other, ids, k).tokens.tolist()
            out.append(graft(tree, state.chain, state.acceptance.survival(len(state.chain))))
        return out

    def update(
        self,
        state: HybridState,  # type: ignore[override]
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        super().update(state, token_ids, num_accepted, hidden)
        if state.chain:
            committed = list(token_ids[len(token_ids) - num_accepted - 1 :])
            checked = min(len(state.chain), len(committed))
            matched = next((j for j in range(checked) if state.chain[j] != committed[j]), checked)
            # Greedy: the committed tokens are the target's own choices, so a lookup token equal
            # to them would have been accepted whatever the tree kept. Sampling: a close proxy.
            state.acceptance.observe(checked, matched)
            self.prior.observe(checked, matched)
            state.chain = []


class SuffixHybridProposer(HeadsPlus):
    """A :class:`HeadsProposer`'s tree merged with suffix decoding's (module docstring)."""

    HEADS_MEMORY = 0.05
    """Weight of the newest heads' tree in :attr:`heads_expected` (a mean over ~20 drafts)."""

    def __init__(self, heads: HeadsProposer, suffix: SuffixProposer) -> None:
        super().__init__(heads, suffix, "suffix")
        self.suffix = suffix
        self.description: dict[str, object] = {**heads.description, **suffix.description}
        """What defines this proposer, for benchmark reports."""
        self.heads_expected: float | None = None
        """Running mean of the heads' trees' expected accepted tokens (their nodes' probabilities
        summed), over every sequence's drafts; None until the heads have drafted once."""

    def max_tree_size(self, k: int) -> int:
        return self.heads.max_tree_size(k) + self.suffix.max_tree_size(k)  # they may share no node

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> PairState:
        return PairState(
            heads=self.heads.new_state(prompt_ids, sampling),
            other=self.suffix.new_state(prompt_ids, sampling),
        )

    def propose_batch(
        self,
        states: Sequence[PairState],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        *,
        min_logp: float = -math.inf,
    ) -> list[Draft]:
        drafts = [
            self.suffix.draft(state.other, ids, k, min_logp)
            for state, ids, k in zip(states, token_ids, ks, strict=True)
        ]
        bar = self.heads_expected
        wanted = [i for i, draft in enumerate(drafts) if bar is None or draft.expected < bar]
        if not wanted:
            return drafts
        trees = self.heads.propose_batch(
            [states[i].heads for i in wanted],
            [token_ids[i] for i in wanted],
            [ks[i] for i in wanted],
            min_logp=min_logp,
        )
        for i, tree in zip(wanted, trees, strict=True):
            if tree.size:  # an empty tree: the heads had nothing to draft from yet, not a bad guess
                mean = tree.expected if self.heads_expected is None else self.heads_expected
                self.heads_expected = mean + self.HEADS_MEMORY * (tree.expected - mean)
            drafts[i] = merge(tree, drafts[i])
        return drafts


def graft(tree: Draft, chain: Sequence[int], survival: Sequence[float]) -> Draft:
    """``tree`` with ``chain`` added as a path from the root, node j of the chain scored
    ``log survival[j]``; nodes already in the tree keep the higher score. Re-sorted best first."""
    if not chain:
        return tree
    scores = [math.log(max(p, 1e-12)) for p in survival]
    branch = Draft.chain(torch.tensor(list(chain), dtype=torch.long))
    scored = Draft(branch.tokens, branch.parents, scores=torch.tensor(scores, dtype=torch.float64))
    return merge(tree, scored)


def merge(tree: Draft, other: Draft) -> Draft:
    """Two scored trees (or empty drafts) as one: a path both hold is one node with the higher of
    its two scores, which keeps scores non-increasing along every path (each tree's are). Re-sorted
    best first, parents first (:func:`best_subtree`)."""
    if other.size == 0:
        return tree
    lists = []
    for draft in (tree, other):
        if draft.scores is not None:
            lists.append((draft.tokens.tolist(), draft.parents.tolist(), draft.scores.tolist()))
        elif draft.size == 0:
            lists.append(([], [], []))
        else:
            raise TypeError("only a scored tree (or nothing) can be merged with another")
    (tokens, parents, scores), (their_tokens, their_parents, their_scores) = lists
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    mapped: list[int] = []  # other's node i is merged node mapped[i]
    for token, their_parent, score in zip(their_tokens, their_parents, their_scores, strict=True):
        parent = mapped[their_parent] if their_parent >= 0 else -1
        node = children.get((parent, token))
        if node is None:
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(score)
            children[(parent, token)] = node
        else:
            scores[node] = max(scores[node], score)
        mapped.append(node)
    return best_subtree(tokens, parents, scores, len(tokens))


def _hybrid(heads_cls: type[HeadsProposer]) -> ProposerFactory:
    def build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
        return HybridProposer(heads_cls.build(spec, target), NgramProposer(spec))

    return build


def _suffix_hybrid(heads_cls: type[HeadsProposer]) -> ProposerFactory:
    def build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
        return SuffixHybridProposer(heads_cls.build(spec, target), SuffixProposer(spec))

    return build


register("eagle+ngram")(_hybrid(EagleProposer))
register("medusa+ngram")(_hybrid(MedusaProposer))
register("eagle3+ngram")(_hybrid(Eagle3Proposer))
register("eagle+suffix")(_suffix_hybrid(EagleProposer))
register("medusa+suffix")(_suffix_hybrid(MedusaProposer))
register("eagle3+suffix")(_suffix_hybrid(Eagle3Proposer))
