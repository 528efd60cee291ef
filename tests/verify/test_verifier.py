"""The one verifier: chosen from the config, the same call for chains and trees, and on a chain
exactly the chain kernel (rejection sampling, the reference)."""

from __future__ import annotations

import pytest
import torch

from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs
from verispec.types import Draft
from verispec.verify import (
    make_verifier,
    rejection_sample,
    verify,
    verify_chain,
    verify_tree,
    verify_typical,
)

V = 6
SAMPLINGS = [
    SamplingConfig(),
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=3),
    SamplingConfig(temperature=1.2, top_p=0.8),
]


def _case(seed: int, k: int) -> tuple[Draft, torch.Tensor]:
    """A chain of k tokens and target logits whose argmax agrees with it for a while, then not."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, V, generator=gen) * 2  # [k+1, V]
    agree = int(torch.randint(0, k + 1, (), generator=gen))
    tokens = [int(logits[i].argmax()) if i < agree else int((logits[i].argmax() + 1) % V) for i in range(k)]
    return Draft.chain(torch.tensor(tokens, dtype=torch.long)), logits


def test_a_chain_is_the_tree_whose_parents_are_the_previous_nodes():
    chain = Draft.chain(torch.tensor([4, 1, 3]))
    assert chain.is_chain and chain.parents.tolist() == [-1, 0, 1] and chain.depth == chain.size == 3
    same = Draft(torch.tensor([4, 1, 3]), torch.tensor([-1, 0, 1]))
    assert same.is_chain and same.depths() == [1, 2, 3]
    tree = Draft(torch.tensor([4, 1, 3]), torch.tensor([-1, -1, 0]))
    assert not tree.is_chain and tree.depth == 2
    assert Draft.empty().is_chain and Draft.empty().size == Draft.empty().depth == 0


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t1", "top-k", "top-p"])
def test_a_deterministic_chain_walked_as_a_tree_equals_the_chain_kernel(sampling):
    """Same tokens, same accepted path, and the same random draws spent (the next draw agrees)."""
    lengths = set()
    for seed in range(60):
        draft, logits = _case(seed, k=1 + seed % 4)
        as_chain, as_tree = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = verify_chain(draft, logits, sampling, as_chain)
        got = verify_tree(draft, logits, sampling, as_tree)
        assert got == want
        assert torch.rand((), generator=as_tree) == torch.rand((), generator=as_chain)
        lengths.add(want.num_accepted)
    assert len(lengths) > 2  # rejections at several depths, and whole chains accepted


def test_the_verifier_takes_chains_to_the_chain_kernel_and_trees_to_the_walk():
    """A sampled chain (draft probabilities given) keeps rejection sampling's results and random
    stream bit for bit; a tree goes to the walk."""
    sampling = SamplingConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(3)
    for seed in range(20):
        draft, logits = _case(seed, k=3)
        probs = torch.softmax(torch.randn(3, V, generator=gen), -1)  # [k, V]
        sampled = Draft.chain(draft.tokens, probs)
        want = rejection_sample(
            draft.tokens, probs, logits_to_probs(logits, sampling), torch.Generator().manual_seed(seed)
        )
        assert verify(sampled, logits, sampling, torch.Generator().manual_seed(seed)) == want
    tree = Draft(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]))
    logits = torch.randn(4, V, generator=gen)
    for seed in range(5):
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert verify(tree, logits, sampling, a) == verify_tree(tree, logits, sampling, b)


def test_the_verifier_is_chosen_once_from_the_acceptance_setting():
    assert make_verifier("exact") is verify
    assert make_verifier("typical") is verify_typical
    with pytest.raises(ValueError, match="acceptance"):
        make_verifier("lenient")  # type: ignore[arg-type]


def test_the_chain_kernel_refuses_a_tree():
    tree = Draft(torch.tensor([1, 2]), torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="chain"):
        verify_chain(tree, torch.zeros(3, V), SamplingConfig(), None)
