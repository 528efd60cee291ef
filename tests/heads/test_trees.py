"""Draft-tree builders: the best paths by score, in a draft's order (parents first, siblings by score)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from verispec.heads.trees import best_subtree, product_tree
from verispec.types import Draft


def paths_of(tree: Draft) -> list[tuple[int, ...]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out: list[tuple[int, ...]] = []
    for i, p in enumerate(parents):
        out.append((*(out[p] if p >= 0 else ()), tokens[i]))
    return out


def check_order(tree: Draft, score: dict[tuple[int, ...], float]) -> None:
    paths = paths_of(tree)
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))  # parents before children
    for siblings in tree.children():
        values = [score[paths[c]] for c in siblings]
        assert values == sorted(values, reverse=True)  # tried best first


def test_product_tree_keeps_the_best_paths():
    torch.manual_seed(0)
    logp = torch.randn(3, 4).log_softmax(-1).sort(descending=True).values  # [K, W]
    ids = torch.arange(12).reshape(3, 4) + 10
    # Brute force: every path of depth <= 3, scored by its summed head log-probabilities.
    score: dict[tuple[int, ...], float] = {}
    for depth in (1, 2, 3):
        for ranks in itertools.product(range(4), repeat=depth):
            path = tuple(int(ids[i, r]) for i, r in enumerate(ranks))
            score[path] = sum(float(logp[i, r]) for i, r in enumerate(ranks))
    for nodes in (1, 5, 11, 30):
        tree = product_tree(logp, ids, nodes, depth=3)
        assert tree.size == nodes and tree.probs is None
        got = paths_of(tree)
        cutoff = sorted(score.values(), reverse=True)[nodes - 1]
        assert all(score[p] >= cutoff - 1e-9 for p in got)
        check_order(tree, score)


def test_product_tree_respects_the_depth_limit():
    logp = torch.zeros(4, 2) - math.log(2)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    tree = product_tree(logp, ids, nodes=50, depth=2)
    assert max(tree.depths()) == 2 and tree.size == 2 + 4
    assert product_tree(logp, ids, nodes=5, depth=0).size == 0


def test_product_tree_keeps_the_best_paths_that_fit():
    """With ``fits`` (a grammar), the tree is the best ``nodes`` paths among those whose every
    prefix fits; masked candidates (-inf) are never drafted."""
    torch.manual_seed(1)
    logp = torch.randn(3, 4).log_softmax(-1).sort(descending=True).values
    logp[0, 3] = -math.inf
    ids = torch.arange(12).reshape(3, 4) + 10

    def fits(path: list[int]) -> bool:
        return all(t % 3 != 0 for t in path)  # forbids 12, 15, 18, 21

    score: dict[tuple[int, ...], float] = {}
    for depth in (1, 2, 3):
        for ranks in itertools.product(range(4), repeat=depth):
            path = tuple(int(ids[i, r]) for i, r in enumerate(ranks))
            value = sum(float(logp[i, r]) for i, r in enumerate(ranks))
            if fits(list(path)) and value > -math.inf:
                score[path] = value
    for nodes in (1, 4, 9, 100):
        tree = product_tree(logp, ids, nodes, depth=3, fits=fits)
        got = paths_of(tree)
        assert tree.size == min(nodes, len(score)) and all(p in score for p in got)
        cutoff = sorted(score.values(), reverse=True)[tree.size - 1]
        assert all(score[p] >= cutoff - 1e-9 for p in got)
        check_order(tree, score)
    nothing = product_tree(logp, ids, 10, depth=3, fits=lambda path: False)
    assert nothing.size == 0


def test_product_tree_drafts_forced_tokens_as_the_only_child():
    """Where ``forced`` names tokens (a grammar's next key), the first is the path's only child,
    scored as certain (its parent's score), even where no head offers it; the level below it takes
    the next head's candidates. Paths not forced keep the heads' candidates."""
    logp = torch.tensor([[-0.2, -1.0], [-0.3, -2.0], [-0.4, -3.0]])
    ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    table = {(): [7, 8], (10,): [99]}  # the opening is forced, and path (10,) forces 99 next

    def forced(path: list[int]) -> list[int]:
        return table.get(tuple(path), [])

    tree = product_tree(logp, ids, nodes=6, depth=3, forced=forced)
    assert paths_of(tree)[:3] == [(7,), (7, 20), (7, 20, 30)]  # root forced, then heads 2 and 3
    assert tree.scores is not None and tree.scores[:3].tolist() == pytest.approx([0.0, -0.3, -0.7])
    table[(7,)] = [5]  # now forced at the second level as well: no sibling there
    tree = product_tree(logp, ids, nodes=6, depth=3, forced=forced)
    assert paths_of(tree) == [(7,), (7, 5), (7, 5, 30), (7, 5, 31)]
    assert tree.scores.tolist() == pytest.approx([0.0, 0.0, -0.4, -3.0])
    table.pop(())
    table.pop((7,))
    tree = product_tree(logp, ids, nodes=4, depth=3, forced=forced)
    assert paths_of(tree) == [(10,), (10, 99), (10, 99, 30), (11,)]
    assert tree.scores.tolist() == pytest.approx([-0.2, -0.2, -0.6, -1.0])
    table.update({(10, 99, 30): [1], (10, 99, 30, 1): [2]})  # forced past the last head, up to depth
    tree = product_tree(logp, ids, nodes=4, depth=5, forced=forced)
    assert paths_of(tree) == [(10,), (10, 99), (10, 99, 30), (10, 99, 30, 1)]
    assert paths_of(product_tree(logp, ids, nodes=9, depth=5, forced=forced))[4] == (10, 99, 30, 1, 2)
    assert max(len(p) for p in paths_of(product_tree(logp, ids, nodes=50, depth=5))) == 3  # no forcing


def test_best_subtree_is_closed_under_parents_and_ordered():
    # A root level of three, each expanded with two children; scores are path log-probabilities.
    tokens = [10, 11, 12, 20, 21, 22, 23, 24, 25]
    parents = [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    scores = [-0.1, -1.0, -2.0, -0.3, -3.0, -1.1, -1.2, -2.1, -2.5]
    tree = best_subtree(tokens, parents, scores, nodes=5)
    all_paths = paths_of(Draft(torch.tensor(tokens), torch.tensor(parents)))
    score = dict(zip(all_paths, scores, strict=True))
    got = paths_of(tree)
    assert set(got) == {(10,), (10, 20), (11,), (11, 22), (11, 23)}
    check_order(tree, score)


def test_best_subtree_breaks_ties_towards_the_parent():
    # A child as likely as its parent (probability 1) must not be kept without it.
    tree = best_subtree([1, 2, 3], [-1, 0, -1], [-0.5, -0.5, -0.5], nodes=2)
    assert paths_of(tree) == [(1,), (1, 2)] or paths_of(tree) == [(1,), (3,)]
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))


def test_scores_fall_so_every_prefix_is_the_best_subtree_of_its_size():
    torch.manual_seed(1)
    logp = torch.randn(3, 4).log_softmax(-1).sort(descending=True).values
    ids = torch.arange(12).reshape(3, 4) + 10
    full = product_tree(logp, ids, nodes=20, depth=3)
    assert full.scores is not None and bool((full.scores[1:] <= full.scores[:-1]).all())
    for n in (1, 4, 9, 20):
        cut = full.prefix(n)
        direct = product_tree(logp, ids, nodes=n, depth=3)
        assert paths_of(cut) == paths_of(direct) and torch.equal(cut.scores, direct.scores)
    tokens, parents = [10, 11, 20, 21], [-1, -1, 0, 1]
    reranked = best_subtree(tokens, parents, [-0.2, -0.9, -0.4, -1.5], nodes=4)
    assert reranked.scores.tolist() == [-0.2, -0.4, -0.9, -1.5]
    assert paths_of(reranked.prefix(2)) == [(10,), (10, 20)]
