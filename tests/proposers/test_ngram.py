"""Prompt lookup: table-driven cases, equality with a brute-force search, constant work per step."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from verispec.config import NgramConfig, SamplingConfig, SpecConfig
from verispec.proposers import build_proposer, registered_methods
from verispec.proposers.ngram import NgramProposer, NgramState

GREEDY = SamplingConfig()


def make(min_ngram: int = 1, max_ngram: int = 4) -> NgramProposer:
    spec = SpecConfig(method="ngram", ngram=NgramConfig(min_ngram=min_ngram, max_ngram=max_ngram))
    return NgramProposer(spec, None, None)


def reference(tokens: Sequence[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Quadratic search: for n from max down to min, the latest earlier occurrence of the tail."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length < n:
            continue
        tail = list(tokens[length - n :])
        # An occurrence starting at i has a continuation iff i + n < length; this excludes the tail.
        for i in range(length - n - 1, -1, -1):
            if list(tokens[i : i + n]) == tail:
                return list(tokens[i + n : i + n + k])
    return []


CASES = [
    # (name, tokens, k, min_ngram, max_ngram, expected)
    ("repeated phrase proposes its continuation", [1, 2, 3, 4, 5, 9, 1, 2, 3], 2, 1, 3, [4, 5]),
    ("most recent occurrence wins", [1, 2, 7, 0, 1, 2, 8, 0, 1, 2], 1, 1, 2, [8]),
    ("longer n-gram beats a more recent shorter one", [5, 1, 2, 3, 9, 4, 2, 3, 6, 5, 1, 2, 3], 1, 1, 3, [9]),
    ("no match gives an empty draft", [1, 2, 3, 4, 5], 3, 1, 3, []),
    ("k limits the length", [1, 2, 3, 4, 5, 6, 7, 1, 2], 3, 1, 2, [3, 4, 5]),
    ("continuation runs to the end of the context", [1, 2, 1, 2, 1], 5, 1, 1, [2, 1]),
    ("continuation truncated at the end", [3, 4, 3], 4, 1, 2, [4, 3]),
    ("tail never matches itself", [7], 3, 1, 1, []),
    ("min_ngram respected: 1-token match ignored", [1, 9, 8, 2, 9], 3, 2, 3, []),
    ("min_ngram respected: 2-token match used", [1, 9, 8, 2, 1, 9], 3, 2, 3, [8, 2, 1]),
    ("max_ngram respected: longer match ignored", [1, 2, 3, 4, 0, 5, 3, 6, 1, 2, 3], 1, 1, 1, [6]),
    ("max_ngram respected: longest allowed match used", [1, 2, 3, 4, 0, 5, 3, 6, 1, 2, 3], 1, 1, 3, [4]),
    ("overlapping run", [4, 4, 4, 4], 3, 1, 3, [4]),
    ("empty context", [], 3, 1, 3, []),
]


@pytest.mark.parametrize(
    ("tokens", "k", "min_ngram", "max_ngram", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_cases(tokens: list[int], k: int, min_ngram: int, max_ngram: int, expected: list[int]) -> None:
    assert reference(tokens, k, min_ngram, max_ngram) == expected  # the table agrees with the reference
    proposer = make(min_ngram, max_ngram)
    state = proposer.new_state(tokens, GREEDY)
    draft = proposer.propose(state, tokens, k)
    assert draft.tokens.tolist() == expected
    assert draft.probs is None
    assert draft.size == len(expected)


def test_k_zero_is_empty() -> None:
    proposer = make()
    tokens = [1, 2, 1]
    assert proposer.propose(proposer.new_state(tokens, GREEDY), tokens, 0).size == 0


RANDOM_CASES = [(0, 3, 1, 4), (1, 5, 2, 3), (2, 8, 1, 2)]  # (seed, vocab, min_ngram, max_ngram)


@pytest.mark.parametrize(("seed", "vocab", "min_ngram", "max_ngram"), RANDOM_CASES)
def test_incremental_matches_reference(seed: int, vocab: int, min_ngram: int, max_ngram: int) -> None:
    rng = random.Random(seed)
    proposer = make(min_ngram, max_ngram)
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
    state = proposer.new_state(tokens, GREEDY)
    proposed = 0
    for _ in range(300):
        k = rng.randrange(1, 8)
        draft = proposer.propose(state, tokens, k)
        assert draft.tokens.tolist() == reference(tokens, k, min_ngram, max_ngram)
        proposed += draft.size
        # Commit a random number of tokens: sometimes via update, sometimes seen first by propose.
        tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
        if rng.random() < 0.5:
            proposer.update(state, tokens, num_accepted=0)
    assert proposed > 0  # the comparison was not vacuous


class CountingSequence(Sequence[int]):
    """A token list that records which positions the proposer reads."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.reads: set[int] = set()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, item):  # type: ignore[override]
        positions = range(len(self.tokens))[item]
        if isinstance(item, slice):
            self.reads.update(positions)
        else:
            self.reads.add(positions)
        return self.tokens[item]


def test_work_per_step_does_not_grow_with_context() -> None:
    rng = random.Random(0)
    proposer = make(1, 4)
    tokens = [rng.randrange(50) for _ in range(5000)]
    state = proposer.new_state(tokens, GREEDY)
    assert state.positions_indexed == len(tokens) - 1
    for _ in range(50):
        new = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        old_len = len(tokens)
        tokens = tokens + new
        seen = CountingSequence(tokens)
        before = state.positions_indexed
        proposer.propose(state, seen, 5)
        proposer.update(state, seen, num_accepted=0)  # already in sync: reads at most one old token
        # Only the new tokens are read, plus the last indexed one as a consistency check.
        assert seen.reads <= set(range(old_len - 1, len(tokens)))
        assert state.positions_indexed - before == len(new)
    assert state.positions_indexed == len(tokens) - 1  # every position was indexed exactly once


def test_rewritten_history_rebuilds_index() -> None:
    proposer = make(1, 2)
    state = proposer.new_state([1, 2, 3, 1], GREEDY)
    assert proposer.propose(state, [1, 2, 3, 1], 2).tokens.tolist() == [2, 3]
    rewritten = [4, 5, 4]  # shorter than what was indexed: not an extension
    assert proposer.propose(state, rewritten, 2).tokens.tolist() == [5, 4]
    assert isinstance(state, NgramState) and state.tokens == rewritten


def test_states_are_independent() -> None:
    proposer = make(1, 2)
    a = proposer.new_state([1, 2, 1], GREEDY)
    b = proposer.new_state([1, 3, 1], GREEDY)
    assert proposer.propose(a, [1, 2, 1], 1).tokens.tolist() == [2]
    assert proposer.propose(b, [1, 3, 1], 1).tokens.tolist() == [3]


def test_registered() -> None:
    assert "ngram" in registered_methods()
    proposer = build_proposer(SpecConfig(method="ngram"), None, None)  # type: ignore[arg-type]
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_ngram, proposer.max_ngram) == (NgramConfig().min_ngram, NgramConfig().max_ngram)
