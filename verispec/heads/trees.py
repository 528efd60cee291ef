"""Draft trees from head scores: which candidate continuations to spend a verify forward on.

A tree node's *score* is the draft's log-probability of the whole path to it. Both builders keep the
``nodes`` best-scoring paths within a depth limit, which is what EAGLE-2 does after expanding and
what Medusa's hand-tuned trees approximate: the expected number of accepted tokens is the sum, over
nodes, of the probability that the path to the node is accepted, and the draft score estimates it.

The output order is the one a :class:`~verispec.types.Draft` needs: every parent before its
children, and siblings in decreasing score (the order they are tried). Scores never increase along a
path (log-probabilities are <= 0), so sorting by score with depth as the tie-break gives both.
Candidates are deterministic (the heads' top tokens, no sampling): ``probs`` stays None and sampling
verification stays exact.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import torch

from verispec.types import Draft

_FORCED = -1
"""The rank of a heap entry that holds a token the grammar forces (:func:`product_tree`)."""


def product_tree(
    top_logp: torch.Tensor,
    top_ids: torch.Tensor,
    nodes: int,
    depth: int,
    fits: Callable[[list[int]], bool] | None = None,
    forced: Callable[[list[int]], list[int]] | None = None,
) -> Draft:
    """Medusa: level i's candidates are head i's top tokens, whatever the path above them.

    ``top_logp``/``top_ids``: ``[K, W]`` each head's W best log-probabilities (descending) and their
    token ids. A path's score is the sum of its tokens' head log-probabilities (heads are treated
    as independent). Best-first: a popped node adds its next sibling and its first child to the
    frontier, so the first ``nodes`` pops are the ``nodes`` best paths, parents first.
    ``fits(path)``: whether a path may be drafted at all (a request's grammar); a path that does not
    fit is dropped with everything below it, and its next sibling still gets its turn. A candidate
    of log-probability -inf (masked out) is never drafted.
    ``forced(path)``: the tokens a request's grammar forces after a path (a schema's next key); where
    there are some, the first is the node's only child, scored 0 (certain), and the levels below it
    take the next heads' candidates as usual; forced tokens may go deeper than the heads (up to
    ``depth``). The heads cannot guess key names, and under a grammar their candidates there are
    masked down to nothing (:meth:`~verispec.structured.Constraint.forced`).
    """
    heads, width = top_logp.shape  # no level below the last head has candidates (first_child)
    logp = top_logp.tolist()
    ids = top_ids.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    paths: list[list[int]] = []
    if depth <= 0 or nodes <= 0:
        return Draft.empty()

    tie = itertools.count()

    def first_child(
        level: int, parent: int, base: float
    ) -> list[tuple[float, int, int, int, int, float, int]]:
        """The heap entry of a parent's (-1: the root's) best child, if any: the forced token if
        there is one, else the level's best candidate (none below the last head)."""
        now = forced(paths[parent] if parent >= 0 else []) if forced is not None else []
        if now:
            return [(-base, next(tie), level, parent, _FORCED, base, now[0])]
        return [(-(base + logp[level][0]), next(tie), level, parent, 0, base, -1)] if level < heads else []

    # (-score, tie, level, parent node, rank at this level, score of the parent, forced token)
    heap = first_child(0, -1, 0.0)
    while heap and len(tokens) < nodes:
        neg, _, level, parent, rank, base, token = heapq.heappop(heap)
        if rank != _FORCED:
            if rank + 1 < width:
                sibling = (-(base + logp[level][rank + 1]), next(tie), level, parent, rank + 1, base, -1)
                heapq.heappush(heap, sibling)
            if neg == math.inf:  # ruled out by the request's rules (and so is every later sibling)
                continue
            token = ids[level][rank]
        path = [*(paths[parent] if parent >= 0 else []), token]
        if rank != _FORCED and fits is not None and not fits(path):
            continue
        me = len(tokens)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        paths.append(path)
        if level + 1 < depth:
            for child in first_child(level + 1, me, -neg):
                heapq.heappush(heap, child)
    return Draft(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        scores=torch.tensor(scores, dtype=torch.float64),
    )


def best_subtree(tokens: list[int], parents: list[int], scores: list[float], nodes: int) -> Draft:
    """EAGLE-2's rerank: of all expanded candidates (parents listed before children), keep the
    ``nodes`` best by score, which are closed under taking parents, in a draft's order."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depth[i], i))[:nodes]
    new_index = {old: new for new, old in enumerate(order)}
    kept_parents = []
    for old in order:
        p = parents[old]
        if p >= 0 and p not in new_index:  # only under exact ties with an unlisted parent
            raise AssertionError("rerank broke parent closure")
        kept_parents.append(-1 if p < 0 else new_index[p])
    return Draft(
        torch.tensor([tokens[i] for i in order], dtype=torch.long),
        torch.tensor(kept_parents, dtype=torch.long),
        scores=torch.tensor([scores[i] for i in order], dtype=torch.float64),
    )
