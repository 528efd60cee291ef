"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): draft a tree of what followed the context's
tail wherever it occurred before, in this request or in earlier requests' outputs.

Agents, repeated code edits and structured output (JSON) write the same spans again and again,
within a request and across requests. Like prompt lookup (:mod:`verispec.proposers.ngram`) no model
is involved, but the material is wider and the draft is a tree with scores:

* Two indexes (:mod:`verispec.proposers.suffix_index`): the sequence's own prompt and output,
  extended as tokens are committed, and the outputs of earlier requests in the same cache scope
  (:meth:`SuffixProposer.set_scope`), one ring for every scope with one token budget, the oldest
  outputs evicted first. A request's output joins the ring when it is released (finished, aborted
  or failed); a request without a scope (None) neither reads nor adds to it: cross-request caches
  are a timing side channel, shared only among callers who may see each other's text.
* In each index the longest tail of the context (up to ``max_pattern`` tokens) that occurred
  before is found, with its most recent occurrences. Their continuations are counted into a trie:
  a node's probability is the share of occurrences whose continuation starts with its path, i.e.
  the product of the conditional frequencies count(child) / count(parent) along the path, shrunk
  by N / (N + 1) for N occurrences (:func:`count_tree`: one occurrence is weak evidence). Nodes
  below ``min_prob`` (or below the engine's ``min_logp``) are not expanded; the best nodes by that
  probability are kept (best first, parents first: :func:`~verispec.heads.trees.best_subtree`), at
  most ``ceil(spec_factor * match length)`` of them (a short match is weak evidence) and at most
  :meth:`~SuffixProposer.max_tree_size` (k), no deeper than k.
* Two thresholds per index give two candidate trees: the occurrences of the longest match alone
  (most specific) and every occurrence the anchor found (more samples, a shorter match).
* Of the candidate trees the one with the most expected accepted tokens (the sum of its nodes'
  probabilities) is drafted. Not a merge: the two indexes count different populations (this
  request's own text, other requests' outputs), and pooling their counts would let many short
  global matches outvote one long local match. Arctic Inference picks the same way.

Scores are log path-probabilities, non-increasing along each path and sorted best first, so the
engine's depth policy sizes the tree as it sizes EAGLE's (:attr:`drafts_trees`). The candidates are
deterministic (no probabilities), so tree verification is exact, greedy and sampled. Under a
request's grammar, nodes the grammar forbids are dropped with everything below them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from verispec.proposers.base import Proposer, register
from verispec.proposers.suffix_index import MAX_WALK, SEPARATOR, Match, OutputCache, TokenIndex, tail_hashes
from verispec.types import Draft

if TYPE_CHECKING:
    from verispec.config import SamplingConfig, SpecConfig, SuffixConfig
    from verispec.models.base import CausalLM
    from verispec.penalties import RequestRules
    from verispec.structured import Constraint

TREE_FACTOR = 2
"""A draft k deep has at most this many times k nodes: branches exist only where earlier
continuations diverged, and each node costs a verify row."""


@dataclass
class SuffixState:
    """One sequence: its own index, its scope and the engine's list of its committed tokens."""

    local: TokenIndex
    prompt_len: int
    scope: str | None = None
    committed: Sequence[int] | None = None
    """The committed sequence last passed in. The engine extends its list in place, so at release
    this also holds the final step's tokens, which no update told (checked, not assumed)."""
    last: int = -1
    """The last token indexed (a cheap check that the next sequence extends the indexed one)."""
    constraint: Constraint | None = None
    released: bool = False

    def sync(self, token_ids: Sequence[int]) -> None:
        """Index the tokens beyond those indexed; a sequence that does not extend them (shorter, or
        its last indexed token differs) rebuilds the index."""
        self.committed = token_ids
        known = self.local.length
        if len(token_ids) < known or (known and int(token_ids[known - 1]) != self.last):
            self.local = TokenIndex()
            known = 0
        if len(token_ids) > known:
            self.local.append(np.asarray(token_ids[known:], dtype=np.int32))
            self.last = int(token_ids[-1])

    def output(self) -> list[int]:
        """The tokens generated so far: the committed list's where it extends the index, else the
        index's own."""
        known = self.local.length
        live = self.committed
        if live is not None and len(live) >= known and (not known or int(live[known - 1]) == self.last):
            return [int(t) for t in live[self.prompt_len :]]
        return self.local.tokens[self.prompt_len : known].tolist()


@dataclass
class Tree:
    """A candidate draft: tokens, parents and log path-probabilities, best first."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    @property
    def expected(self) -> float:
        """Expected accepted tokens, if the scores are right: the sum of the path probabilities."""
        return sum(math.exp(s) for s in self.scores)

    def draft(self) -> Draft:
        if not self.tokens:
            return Draft.empty()
        return Draft(
            torch.tensor(self.tokens, dtype=torch.long),
            torch.tensor(self.parents, dtype=torch.long),
            scores=torch.tensor(self.scores, dtype=torch.float64),
        )


def count_tree(continuations: list[list[int]], depth: int, nodes: int, floor: float) -> Tree:
    """The trie of ``continuations`` (each cut at its first :data:`SEPARATOR`), each node scored by
    the log of its path's probability: the share of the N continuations through it, i.e. the product
    of the conditional frequencies count(child) / count(parent) along the path, times N / (N + 1).
    That factor is Laplace's rule of succession (one pseudo-occurrence that continues otherwise): a
    single occurrence is weak evidence, and ten that agree are not certainty either. Only nodes
    scored at least ``log floor`` are expanded; the ``nodes`` best are kept, no deeper than ``depth``."""
    total = len(continuations)
    if total == 0 or depth <= 0 or nodes <= 0:
        return Tree()
    least = max(1, math.ceil(floor * (total + 1) - 1e-9))
    # Repeated work repeats its continuations: count each distinct one once, with its weight.
    distinct = Counter(tuple(c[: c.index(SEPARATOR)] if SEPARATOR in c else c) for c in continuations)
    rows = list(distinct.items())
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    level: list[tuple[int, list[int]]] = [(-1, list(range(len(rows))))]  # (node, rows through it)
    for d in range(depth):
        below: list[tuple[int, list[int]]] = []
        for node, members in level:
            children: dict[int, list[int]] = {}
            counts: dict[int, int] = {}
            for i in members:
                row, weight = rows[i]
                if d < len(row):
                    children.setdefault(row[d], []).append(i)
                    counts[row[d]] = counts.get(row[d], 0) + weight
            for token, through in children.items():
                if counts[token] >= least:
                    below.append((len(tokens), through))
                    tokens.append(token)
                    parents.append(node)
                    scores.append(math.log(counts[token] / (total + 1)))
        if not below:
            break
        level = below
    return best_nodes(Tree(tokens, parents, scores), nodes)


def best_nodes(tree: Tree, nodes: int) -> Tree:
    """The ``nodes`` best nodes of ``tree`` by score, parents first (as
    :func:`~verispec.heads.trees.best_subtree`, without its tensors: a step's draft is built once)."""
    depth: list[int] = []
    for p in tree.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    order = sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], depth[i], i))[:nodes]
    new_index = {old: new for new, old in enumerate(order)}
    return Tree(
        [tree.tokens[i] for i in order],
        [-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in order],
        [tree.scores[i] for i in order],
    )


@register("suffix")
class SuffixProposer(Proposer):
    """Suffix decoding over the sequence's own text and its scope's earlier outputs (module docstring)."""

    name = "suffix"
    drafts_trees = True

    def __init__(self, spec: SpecConfig, target: CausalLM | None = None, draft: CausalLM | None = None):
        self.config: SuffixConfig = spec.suffix
        self.cache = OutputCache(self.config.cache_tokens)
        """Earlier requests' outputs, per scope, shared by every sequence of this proposer."""
        self.max_walk = MAX_WALK
        self.description: dict[str, object] = {"suffix": {
            "max_pattern": self.config.max_pattern,
            "min_prob": self.config.min_prob,
            "spec_factor": self.config.spec_factor,
            "cache_tokens": self.config.cache_tokens,
        }}  # fmt: skip
        """What defines this proposer, for benchmark reports."""

    def max_tree_size(self, k: int) -> int:
        return TREE_FACTOR * k

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig | None = None) -> SuffixState:
        state = SuffixState(local=TokenIndex(), prompt_len=len(prompt_ids))
        state.sync(list(prompt_ids))
        return state

    def set_scope(self, state: SuffixState, scope: str | None) -> None:
        state.scope = scope

    def constrain(self, state: SuffixState, rules: RequestRules) -> None:
        state.constraint = rules.constraint

    def propose(self, state: SuffixState, token_ids: Sequence[int], k: int) -> Draft:
        return self.draft(state, token_ids, k)

    def propose_batch(
        self,
        states: Sequence[SuffixState],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        *,
        min_logp: float = -math.inf,
    ) -> list[Draft]:
        return [self.draft(s, t, k, min_logp) for s, t, k in zip(states, token_ids, ks, strict=True)]

    def draft(
        self, state: SuffixState, token_ids: Sequence[int], k: int, min_logp: float = -math.inf
    ) -> Draft:
        """The best candidate tree for ``state`` after ``token_ids``, at most k deep (module docstring)."""
        state.sync(token_ids)
        if k <= 0:
            return Draft.empty()
        tail = np.asarray(token_ids[-self.config.max_pattern :], dtype=np.int64)
        floor = max(self.config.min_prob, math.exp(min_logp) if min_logp > -math.inf else 0.0)
        nodes = self.max_tree_size(k)
        best = Tree()
        hashes = tail_hashes(tail)
        sources: list[tuple[TokenIndex, Match | None]] = [
            (state.local, state.local.find(tail, 0, self.max_walk, hashes))
        ]
        if state.scope is not None:
            sources.append((self.cache.index, self.cache.find(state.scope, tail, self.max_walk, hashes)))
        for index, match in sources:
            if match is None:
                continue
            for tree in self._trees(index, match, k, nodes, floor):
                if tree.expected > best.expected:
                    best = tree
        if state.constraint is not None:
            best = _within_grammar(best, state.constraint)
        return best.draft()

    def _trees(self, index: TokenIndex, match: Match, k: int, nodes: int, floor: float) -> list[Tree]:
        """A tree from the occurrences of the longest match, and one from all the anchor found."""
        out = []
        longest = match.longest
        thresholds = [longest] if longest == match.anchor else [longest, match.anchor]
        depth = min(k, self._budget(longest))
        conts = index.continuations(match.ends, depth).tolist()
        for least in thresholds:
            chosen = [c for c, n in zip(conts, match.lengths.tolist(), strict=True) if n >= least]
            budget = self._budget(least)
            out.append(count_tree(chosen, min(depth, budget), min(nodes, budget), floor))
        return out

    def _budget(self, match_length: int) -> int:
        """The most tokens a match this long may propose (Arctic's max_spec_factor)."""
        return max(1, math.ceil(self.config.spec_factor * match_length))

    def update(
        self,
        state: SuffixState,
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        state.sync(token_ids)

    def release(self, state: SuffixState) -> None:
        """The sequence is done (finished, aborted or failed): its output joins its scope's cache."""
        if state.released:
            return
        state.released = True
        if state.scope is not None:
            self.cache.add(state.scope, np.asarray(state.output(), dtype=np.int32))


def _within_grammar(tree: Tree, constraint: Constraint) -> Tree:
    """``tree`` without the nodes whose path the grammar forbids (nor anything below them)."""
    paths: list[list[int]] = []
    kept: dict[int, int] = {}
    out = Tree()
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        path = [*(paths[parent] if parent >= 0 else []), token]
        paths.append(path)
        if (parent < 0 or parent in kept) and constraint.fits(path):
            kept[i] = len(out.tokens)
            out.tokens.append(token)
            out.parents.append(kept[parent] if parent >= 0 else -1)
            out.scores.append(tree.scores[i])
    return out
