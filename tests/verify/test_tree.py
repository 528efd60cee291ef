"""Token-tree verification: greedy picks the target's path; sampling stays exactly the target's."""

from __future__ import annotations

import pytest
import torch

from tests.stats import chi_square
from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft
from verispec.verify import tree as tree_module
from verispec.verify.tree import tree_attention_inputs, verify_tree

V = 4
GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=1.0)


def test_greedy_follows_the_target_argmax_down_the_tree():
    # root -> {0: token 2, 1: token 1}; node 0 -> {2: token 3}; node 1 -> {3: token 0}
    tree = Draft(tokens=torch.tensor([2, 1, 3, 0]), parents=torch.tensor([-1, -1, 0, 1]))
    logits = torch.full((5, V), -5.0)
    logits[0, 1] = 5  # after the root the target wants 1: node 1
    logits[2, 0] = 5  # after node 1 it wants 0: node 3
    logits[4, 2] = 5  # after node 3 it wants 2: the bonus token
    result = verify_tree(tree, logits, GREEDY, None)
    assert result.path == (1, 3) and result.tokens == [1, 0, 2] and result.num_accepted == 2
    logits[0] = -5
    logits[0, 3] = 5  # no child matches: the target's own token only
    assert verify_tree(tree, logits, GREEDY, None).tokens == [3]


def test_tree_attention_inputs_see_only_ancestors():
    tree = Draft(tokens=torch.tensor([2, 1, 3]), parents=torch.tensor([-1, -1, 0]))
    positions, mask = tree_attention_inputs(tree, start=10)
    assert positions == [10, 11, 11, 12]
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parent"):
        Draft(tokens=torch.tensor([1, 2]), parents=torch.tensor([1, -1]))
    tree = Draft(tokens=torch.tensor([1]), parents=torch.tensor([-1]))
    with pytest.raises(ValueError, match="rows"):
        verify_tree(tree, torch.zeros(3, V), GREEDY, None)


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target P(t1), P(t2 | t1) and P(t3 | t1, t2) over a 4-token vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.softmax(torch.randn(*shape, generator=gen) * 1.5, -1) for shape in [(V,), (V, V), (V, V, V)]
    )


def _target_row(tables, prefix: list[int]) -> torch.Tensor:
    p1, p2, p3 = tables
    return [p1, p2[prefix[0]] if prefix else None, p3[tuple(prefix[:2])] if len(prefix) >= 2 else None][
        len(prefix)
    ]


def _two_token_counts(kind: str, trials: int = 6000) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Counts of the first two output tokens (the step's, then plain sampling if the step stopped at
    one), their exact distribution P(t1) P(t2 | t1), and the accepted draft tokens, for a 2-wide,
    2-deep tree drafted from a distribution unlike the target's."""
    tables = _tables(0)
    q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the draft distribution at every node
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V * V)
    accepted = 0
    for _ in range(trials):
        if kind == "deterministic":  # top-2 candidates at each level, like a Medusa head's
            first = [3, 2]
            tokens = [3, 2, 3, 2, 3, 2]
            probs = None
        else:  # children drawn i.i.d. from q1
            first = torch.multinomial(q1, 2, replacement=True, generator=gen).tolist()
            second = torch.multinomial(q1, 4, replacement=True, generator=gen).tolist()
            tokens = first + second
            probs = q1.expand(6, V).clone()
        parents = [-1, -1, 0, 0, 1, 1]
        tree = Draft(tokens=torch.tensor(tokens), parents=torch.tensor(parents), probs=probs)
        paths = [[], [first[0]], [first[1]], [first[0], tokens[2]], [first[0], tokens[3]],
                 [first[1], tokens[4]], [first[1], tokens[5]]]  # fmt: skip
        logits = torch.stack([_target_row(tables, path).log() for path in paths])
        result = verify_tree(tree, logits, SAMPLED, gen)
        out = result.tokens
        if len(out) == 1:
            out = [*out, int(torch.multinomial(_target_row(tables, out), 1, generator=gen))]
        counts[out[0] * V + out[1]] += 1
        accepted += result.num_accepted
    return counts, (tables[0].unsqueeze(1) * tables[1]).flatten(), accepted


@pytest.mark.parametrize("kind", ["deterministic", "sampled"])
def test_tree_sampling_is_exact(kind):
    counts, exact, accepted = _two_token_counts(kind)
    assert accepted > counts.sum() * 0.2  # the tree was used, not just the recovered token
    assert chi_square(counts, exact)[1] > 1e-4


def test_deterministic_candidates_follow_what_plain_decoding_samples():
    """A tree of deterministic candidates is walked by the target's own samples, one draw per
    committed token: with a seed, the output is plain decoding's samples down the matching path."""
    tables = _tables(0)
    tokens, parents = [3, 2, 3, 2, 3, 2], [-1, -1, 0, 0, 1, 1]  # two candidates at each level
    tree = Draft(tokens=torch.tensor(tokens), parents=torch.tensor(parents))
    paths = [[], [3], [2], [3, 3], [3, 2], [2, 3], [2, 2]]
    logits = torch.stack([_target_row(tables, path).log() for path in paths])
    lengths = set()
    for seed in range(40):
        result = verify_tree(tree, logits, SAMPLED, torch.Generator().manual_seed(seed))
        gen = torch.Generator().manual_seed(seed)
        plain: list[int] = []
        while len(plain) < len(result.tokens):  # plain decoding along the same prefix, same seed
            probs = logits_to_probs(_target_row(tables, plain).log(), SAMPLED)  # as plain decoding has them
            plain.append(int(sample(probs, gen)))
        assert result.tokens == plain
        lengths.add(len(result.tokens))
    assert lengths == {1, 2, 3}  # stopped at the root, at depth 1, and accepted a whole path


def test_a_verifier_that_forgets_rejected_siblings_fails_the_same_check(monkeypatch):
    """Trying the next sibling against the unchanged target distribution over-produces the
    siblings' tokens; the check must see it, or its passing above would mean nothing."""

    def forgetful(candidates, tokens, probs, p, generator):
        for c in candidates:
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(probs[c][tokens[c]]) < float(p[tokens[c]]):
                return c, p
        return None, p

    monkeypatch.setattr(tree_module, "_try_children", forgetful)
    counts, exact, _ = _two_token_counts("sampled")
    assert chi_square(counts, exact)[1] < 1e-6


def test_scores_must_fall_and_only_deterministic_trees_are_cut():
    tokens, parents = torch.tensor([3, 4, 5]), torch.tensor([-1, 0, -1])
    tree = Draft(tokens, parents, scores=torch.tensor([-0.1, -0.5, -0.7]))
    assert tree.prefix(2).tokens.tolist() == [3, 4] and tree.prefix(0).size == 0
    assert tree.prefix(10).size == 3
    with pytest.raises(ValueError, match="non-increasing"):
        Draft(tokens, parents, scores=torch.tensor([-0.5, -0.1, -0.7]))
    probs = torch.full((3, 8), 1 / 8)
    with pytest.raises(ValueError, match="deterministic"):
        Draft(tokens, parents, probs, scores=torch.tensor([-0.1, -0.5, -0.7]))
    with pytest.raises(ValueError, match="cannot be cut"):
        Draft(tokens, parents, probs).prefix(1)
