"""Suffix decoding: the hash-chain index against a brute-force search (matches, counts, eviction,
stale entries, collisions, scopes, budget), the frequency trees, and the engine: greedy output equal
to plain decoding with drafts from earlier outputs of the same scope only, sampled output following
the target's distribution."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import verispec
from tests.conftest import make_engine, needs_smollm2
from tests.proposers.heads_checks import PROMPTS, SAMPLINGS, assert_trees_sample_the_target
from verispec.config import SamplingConfig, SpecConfig, SuffixConfig
from verispec.engine import SpecEngine
from verispec.proposers import build_proposer, registered_methods, suffix_index
from verispec.proposers.suffix import SuffixProposer, SuffixState, count_tree
from verispec.proposers.suffix_index import ANCHORS, MAX_WALK, SEPARATOR, OutputCache, TokenIndex

GREEDY = SamplingConfig()
UNBOUNDED = 10**9
"""A walk that visits a whole chain: the look-up then finds every occurrence, as brute force does."""


def occurrences(
    stream: Sequence[int], tail: Sequence[int], start: int = 0
) -> tuple[int, list[tuple[int, int]]]:
    """Brute force over ``stream`` (absolute positions from ``start``, documents split by
    SEPARATOR): the longest anchor n for which the tail's last n tokens occur with a continuation,
    and each occurrence's (end, match length), most recent first."""
    for n in sorted(ANCHORS, reverse=True):
        if n > len(tail):
            continue
        found = []
        for i in range(len(stream) - 1, n - 1, -1):  # i: the occurrence's end, its continuation's start
            if stream[i] == SEPARATOR or list(stream[i - n : i]) != list(tail[-n:]):
                continue
            length = 0
            while length < len(tail) and i - length - 1 >= 0 and stream[i - length - 1] == tail[-length - 1]:
                length += 1
            found.append((start + i, length))
        if found:
            return n, found
    return 0, []


def found(index: TokenIndex, tail: Sequence[int], owner: int = 0, walk: int = UNBOUNDED):
    match = index.find(np.asarray(tail, dtype=np.int64), owner, walk)
    if match is None:
        return 0, []
    return match.anchor, list(zip(match.ends.tolist(), match.lengths.tolist(), strict=True))


# --------------------------------------------------------------------------------------- the index


def test_a_tail_s_hashes_are_those_of_the_stream_s_last_ngrams() -> None:
    rng = np.random.default_rng(0)
    for size in (1, 3, 16, 24):
        tail = rng.integers(0, 50_000, size=size)
        usable = [a for a, n in enumerate(ANCHORS) if n <= size]
        want = suffix_index.ngram_hashes(tail)[-1, usable]
        assert (suffix_index.tail_hashes(tail)[usable] == want).all()


@pytest.mark.parametrize(("seed", "vocab"), [(0, 3), (1, 6), (2, 40)])
def test_find_agrees_with_brute_force_as_the_stream_grows(seed: int, vocab: int) -> None:
    rng = random.Random(seed)
    index = TokenIndex(capacity=8)  # grows (and re-indexes) several times on the way
    stream: list[int] = []
    checked = 0
    while len(stream) < 600:
        new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        stream += new
        index.append(np.asarray(new, dtype=np.int32))
        tail = stream[-rng.randrange(1, 24) :]
        assert found(index, tail) == occurrences(stream, tail)
        checked += bool(occurrences(stream, tail)[1])
    assert checked > 50 and index.capacity >= 600


def test_the_tail_never_matches_itself_and_continuations_stop_at_the_end() -> None:
    index = TokenIndex()
    index.append(np.asarray([7], dtype=np.int32))
    assert index.find(np.asarray([7])) is None
    index.append(np.asarray([8, 7], dtype=np.int32))
    match = index.find(np.asarray([7, 8, 7]))
    assert match is not None and match.ends.tolist() == [1] and match.lengths.tolist() == [1]
    assert index.continuations(match.ends, 4).tolist() == [[8, 7, SEPARATOR, SEPARATOR]]


def test_documents_never_match_across_their_separator() -> None:
    index = TokenIndex(budget=100)
    index.add_document(np.asarray([1, 2, 3]), owner=1)
    index.add_document(np.asarray([4, 5, 1, 2]), owner=1)
    # "3 4" spans the boundary: not an occurrence; "1 2" is, twice, and the first continues with 3,
    # the second with nothing (its document ends), so only the first is indexed.
    assert found(index, [3, 4], owner=1) == (1, [(5, 1)])  # only "4", followed by 5
    anchor, hits = found(index, [9, 1, 2], owner=1)
    assert (anchor, hits) == (2, [(2, 2)])
    assert index.continuations(np.asarray([2]), 3).tolist() == [[3, SEPARATOR, SEPARATOR]]


def test_a_bounded_walk_takes_the_most_recent_occurrences() -> None:
    index = TokenIndex()
    index.append(np.asarray([1, 2] * 200, dtype=np.int32))
    match = index.find(np.asarray([1, 2, 1, 2]))
    assert match is not None and len(match.ends) == MAX_WALK
    assert match.ends.tolist() == sorted(match.ends.tolist(), reverse=True)
    assert match.ends[0] == 398  # the latest "1 2 1 2" with a continuation (400 is the tail itself)


def test_eviction_keeps_the_budget_and_forgets_the_oldest_documents() -> None:
    rng = random.Random(3)
    budget = 120
    index = TokenIndex(budget=budget, capacity=16)
    docs: list[list[int]] = []
    for _ in range(60):
        doc = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        index.make_room(len(doc) + 1)
        index.add_document(np.asarray(doc), owner=1)
        docs.append(doc)
        assert index.live <= budget and index.capacity <= budget
        # The live stream, as brute force sees it: the newest documents that fit.
        stream: list[int] = []
        for d in reversed(docs):
            if len(stream) + len(d) + 1 > index.live:
                break
            stream = [*d, SEPARATOR, *stream]
        assert len(stream) == index.live
        for _ in range(5):
            tail = [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
            assert found(index, tail, owner=1) == occurrences(stream, tail, start=index.start)
    assert index.start > 5 * budget  # the ring went round several times: slots were reused


def test_stale_chain_entries_are_recognised_by_their_position() -> None:
    index = TokenIndex(budget=40)
    index.make_room(11)
    index.add_document(np.asarray([9, 8, 7, 6, 5, 4, 3, 2, 1, 0]), owner=1)
    assert found(index, [8, 7, 6], owner=1)[1] == [(4, 3)]
    for _ in range(4):  # the first document is evicted, its slots reused by other tokens
        index.make_room(11)
        index.add_document(np.asarray([20 + i for i in range(10)]), owner=1)
    two = ANCHORS.index(2)
    bucket = int(index._buckets(suffix_index.tail_hashes(np.asarray([8, 7, 6]))[two : two + 1], 1)[0])
    assert 0 <= index.heads[two, bucket] < index.start  # the chain's head is stale ...
    assert index.find(np.asarray([8, 7, 6]), 1) is None  # ... and never read as a match


@pytest.fixture
def colliding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every n-gram hashes alike: one chain per anchor holds everything, found only by checking."""
    zeros = lambda window, anchors=ANCHORS: np.zeros((len(window), len(anchors)), dtype=np.uint64)  # noqa: E731
    monkeypatch.setattr(suffix_index, "ngram_hashes", zeros)
    monkeypatch.setattr(suffix_index, "tail_hashes", lambda tail, anchors=ANCHORS: zeros(tail, anchors)[-1])


@pytest.mark.usefixtures("colliding")
def test_hash_collisions_are_checked_against_the_tokens() -> None:
    rng = random.Random(5)
    index = TokenIndex()
    stream = [rng.randrange(8) for _ in range(300)]
    index.append(np.asarray(stream, dtype=np.int32))
    for _ in range(40):
        tail = [rng.randrange(8) for _ in range(rng.randrange(1, 12))]
        assert found(index, tail) == occurrences(stream, tail)
    # Bounded: a walk through a chain of colliding entries stops after MAX_WALK of them.
    assert index.find(np.asarray([99, 98])) is None


@pytest.mark.usefixtures("colliding")
def test_a_scope_never_finds_another_scope_s_outputs_even_when_their_hashes_collide() -> None:
    cache = OutputCache(1000)
    text = np.asarray([11, 12, 13, 14, 15, 16, 17, 18])
    cache.add("a", text)
    cache.add("b", np.asarray([1, 2, 3]))
    assert cache.find("a", text[:4].astype(np.int64)) is not None
    assert cache.find("b", text[:4].astype(np.int64)) is None
    assert cache.find("c", text[:4].astype(np.int64)) is None  # an unknown scope has nothing


def test_one_budget_for_all_scopes_evicts_the_oldest_outputs_first() -> None:
    cache = OutputCache(30)
    cache.add("a", np.arange(100, 109))  # 10 positions with its separator
    cache.add("b", np.arange(200, 209))
    cache.add("c", np.arange(300, 309))
    assert cache.held == {1: 10, 2: 10, 3: 10}
    cache.add("b", np.arange(400, 404))  # a's output, the oldest, makes room
    assert "a" not in cache.scopes and cache.find("a", np.asarray([100, 101])) is None
    assert cache.find("b", np.asarray([200, 201])) is not None
    assert cache.index.live <= 30 and sum(cache.held.values()) == cache.index.live
    cache.add("a", np.arange(500, 560))  # longer than the budget: its last 29 tokens, alone
    assert cache.index.live == 30 and set(cache.scopes) == {"a"}
    match = cache.find("a", np.asarray([540, 541]))
    assert match is not None and cache.index.continuations(match.ends, 2).tolist() == [[542, 543]]


def test_memory_is_bounded_by_the_budget_not_by_what_was_added() -> None:
    cache = OutputCache(5000)
    rng = np.random.default_rng(0)
    for _ in range(200):
        cache.add("a", rng.integers(0, 1000, size=200))
    assert cache.index.capacity == 5000 and cache.index.live <= 5000
    assert cache.index.nbytes < 5000 * (8 + 12 * len(ANCHORS)) * 2


# --------------------------------------------------------------------------------------- the trees


def paths(tree) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    seen: list[tuple[int, ...]] = []
    for token, parent, score in zip(tree.tokens, tree.parents, tree.scores, strict=True):
        seen.append((*(seen[parent] if parent >= 0 else ()), token))
        out[seen[-1]] = round(math.exp(score), 6)
    return out


def test_count_tree_scores_paths_by_their_share_of_the_occurrences() -> None:
    # Four occurrences: 5 6 7, 5 6 8, 5 6 7, 9. Shares of (N + 1) = 5 (one pseudo-occurrence).
    conts = [[5, 6, 7], [5, 6, 8], [5, 6, 7], [9, SEPARATOR, SEPARATOR]]
    tree = count_tree(conts, depth=3, nodes=10, floor=0.1)
    assert paths(tree) == {(5,): 0.6, (5, 6): 0.6, (5, 6, 7): 0.4, (9,): 0.2, (5, 6, 8): 0.2}
    assert tree.scores == sorted(tree.scores, reverse=True)
    assert all(p < i for i, p in enumerate(tree.parents))
    assert paths(count_tree(conts, depth=3, nodes=10, floor=0.3)) == {(5,): 0.6, (5, 6): 0.6, (5, 6, 7): 0.4}
    assert paths(count_tree(conts, depth=2, nodes=2, floor=0.1)) == {(5,): 0.6, (5, 6): 0.6}
    assert count_tree([], depth=3, nodes=3, floor=0.1).draft().size == 0


def proposer(**config: object) -> SuffixProposer:
    return SuffixProposer(SpecConfig(method="suffix", suffix=SuffixConfig(**config)))  # type: ignore[arg-type]


def test_the_draft_grows_with_the_match_and_is_at_most_k_deep() -> None:
    suffix = proposer(spec_factor=1.0)
    state = suffix.new_state([1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY)
    short = suffix.propose(state, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 4], 8)  # "4" matched: 1 token
    assert short.tokens.tolist() == [5] and short.scores is not None
    longer = suffix.propose(state, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 4, 0, 2, 3, 4], 8)  # "2 3 4": 3 tokens
    assert longer.tokens.tolist() == [5, 6, 7]
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 4, 0, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]  # 6 matched, k = 4
    assert suffix.propose(state, ids, 4).tokens.tolist() == [7, 8, 9, 0]
    assert suffix.propose(state, ids, 0).size == 0
    assert "suffix" in registered_methods()
    assert isinstance(build_proposer(SpecConfig(method="suffix"), None, None), SuffixProposer)  # type: ignore[arg-type]


def test_the_draft_is_a_scored_tree_where_earlier_continuations_diverged() -> None:
    suffix = proposer()
    ids = [5, 1, 2, 3, 7, 6, 1, 2, 3, 8, 4, 1, 2, 3, 7, 9, 1, 2, 3]  # "1 2 3" went on with 7, 8, 7
    tree = suffix.propose(suffix.new_state(ids, GREEDY), ids, 3)
    assert tree.tokens.tolist()[:2] == [7, 8] and tree.parents.tolist()[:2] == [-1, -1]
    assert tree.scores is not None and bool((tree.scores[1:] <= tree.scores[:-1]).all())
    assert torch.allclose(tree.scores[:2].exp(), torch.tensor([2 / 4, 1 / 4], dtype=torch.float64))
    assert tree.size == 3  # a 3-token match proposes 3 nodes


def release_with(suffix: SuffixProposer, scope: str | None, prompt: list[int], output: list[int]) -> None:
    state = suffix.new_state(prompt, GREEDY)
    suffix.set_scope(state, scope)
    committed = list(prompt)
    suffix.update(state, committed, 0)
    committed += output  # the engine's list grows in place; the last step is never told by update
    suffix.release(state)


def test_outputs_join_their_scope_at_release_and_private_requests_leave_nothing() -> None:
    suffix = proposer()
    output = [40, 41, 42, 43, 44, 45, 46, 47]
    release_with(suffix, None, [1, 2], output)
    assert suffix.cache.index.live == 0
    release_with(suffix, "a", [1, 2], output)
    assert suffix.cache.held == {1: len(output) + 1}  # the whole output, its last step included

    def draft(scope: str | None) -> list[int]:
        state = suffix.new_state([9, 40, 41, 42], GREEDY)
        suffix.set_scope(state, scope)
        return suffix.propose(state, [9, 40, 41, 42], 4).tokens.tolist()

    assert draft("a") == [43, 44, 45]  # a 3-token match proposes 3 tokens
    assert draft("b") == [] and draft(None) == []


def test_a_released_state_adds_its_output_once() -> None:
    suffix = proposer()
    state = suffix.new_state([1, 2], GREEDY)
    suffix.set_scope(state, "a")
    suffix.update(state, [1, 2, 3, 4], 0)
    suffix.release(state)
    suffix.release(state)
    assert suffix.cache.held == {1: 3}


def test_rewritten_history_rebuilds_the_own_index() -> None:
    suffix = proposer()
    state = suffix.new_state([1, 2, 3, 1, 2], GREEDY)
    assert suffix.propose(state, [1, 2, 3, 1, 2], 2).tokens.tolist() == [3, 1]
    assert suffix.propose(state, [4, 5, 4], 2).tokens.tolist() == [5]
    assert isinstance(state, SuffixState) and state.local.length == 3


def test_work_per_step_does_not_grow_with_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step reads a bounded number of chain entries and continuations whatever the cache holds."""
    suffix = proposer(cache_tokens=200_000)
    rng = np.random.default_rng(1)
    phrase = rng.integers(0, 500, size=40)
    for _ in range(400):  # ~200k tokens, the phrase in every output
        filler = rng.integers(0, 500, size=400)
        suffix.cache.add("a", np.concatenate([filler[:200], phrase, filler[200:]]))
    walked: list[int] = []
    walk = TokenIndex._walk

    def counted(self: TokenIndex, anchor: int, position: int, max_walk: int, *tokens: int) -> list[int]:
        out = walk(self, anchor, position, max_walk, *tokens)
        walked.append(len(out))
        return out

    monkeypatch.setattr(TokenIndex, "_walk", counted)
    state = suffix.new_state([3, *phrase[:20].tolist()], GREEDY)
    suffix.set_scope(state, "a")
    draft = suffix.propose(state, [3, *phrase[:20].tolist()], 8)
    assert draft.tokens.tolist()[:8] == phrase[20:28].tolist()
    assert 0 < max(walked) <= MAX_WALK and len(walked) <= 2 * len(ANCHORS)


# --------------------------------------------------------------------------------------- the engine


def test_greedy_equals_plain_and_outputs_help_only_their_own_scope(tiny_target) -> None:
    """On a tiny random model: a second round of the same prompts in scope "a" accepts more than
    the first, which drafted from each request's own text only, as private and "b" requests do
    (their drafts are the first round's, step for step); every output equals plain decoding."""
    engine = make_engine(tiny_target, None, "suffix", k=6)
    want = [make_engine(tiny_target).generate(p, max_new_tokens=40).token_ids for p in PROMPTS]

    def run(scope: str | None) -> list[tuple[int, int]]:
        got = [engine.generate(p, max_new_tokens=40, cache_scope=scope) for p in PROMPTS[:3]]
        assert [g.token_ids for g in got] == want[:3]
        return [(g.stats.num_drafted, g.stats.num_accepted) for g in got]

    first = run("a")  # each request drafts from its own text and the outputs before it in "a"
    other, private, again = run("b"), run(None), run("a")
    assert other == first  # "b" went through the same history, "a"'s outputs unseen
    fresh = make_engine(tiny_target, None, "suffix", k=6)
    assert private == [
        (g.stats.num_drafted, g.stats.num_accepted)
        for g in (fresh.generate(p, max_new_tokens=40, cache_scope=None) for p in PROMPTS[:3])
    ]  # a private request drafts from its own text only, as on an engine that has seen nothing
    assert sum(a for _, a in first) > 0
    assert sum(a for _, a in again) > sum(a for _, a in first), (first, again)
    batched = engine.generate_batch(PROMPTS, max_new_tokens=40, cache_scope="c")
    assert [g.token_ids for g in batched] == want


pytestmark = pytest.mark.usefixtures("one_thread")


def test_drafts_stay_within_a_request_s_grammar_and_output_equals_plain(monkeypatch) -> None:
    """Under a JSON schema the nodes the grammar forbids are dropped; the second request drafts its
    first request's JSON (same scope) and accepts it."""
    from tests.proposers.test_drafting_under_rules import JSON, JSON_PROMPT, record_drafts
    from tests.server.harness import tiny_pair
    from tests.test_structured import fits

    target = tiny_pair()[0]
    spec = SpecConfig(method="suffix", num_speculative_tokens=4, depth="fixed")
    engine = SpecEngine(target, SuffixProposer(spec), spec, tokenizer=target.tokenizer)
    fitted = record_drafts(engine, monkeypatch)
    want = engine.plain_engine().generate(JSON_PROMPT, max_new_tokens=60, structured=JSON)
    first = engine.generate(JSON_PROMPT, max_new_tokens=60, structured=JSON, cache_scope="a")
    again = engine.generate(JSON_PROMPT, max_new_tokens=60, structured=JSON, cache_scope="a")
    assert first.token_ids == again.token_ids == want.token_ids and fits(JSON, want.text)
    assert fitted and all(fitted)
    assert again.stats.num_accepted > first.stats.num_accepted
    # The power of the check: told nothing of the grammar, the same drafts leave it.
    untold = SuffixProposer(spec)
    monkeypatch.setattr(untold, "constrain", lambda state, rules: None)
    blind = SpecEngine(target, untold, spec, tokenizer=target.tokenizer)
    outside = record_drafts(blind, monkeypatch)
    blind.generate(JSON_PROMPT, max_new_tokens=60, structured=JSON, cache_scope="a")
    assert not all(outside)


class OneScope(SuffixProposer):
    """Every request in one scope: the chi-square runs' requests draft from each other's outputs."""

    def set_scope(self, state: SuffixState, scope: str | None) -> None:
        super().set_scope(state, "shared")


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_sampled_output_follows_the_target_with_suffix_trees(small_vocab_target, prefix_logits, sampling):
    """Trees counted from the earlier samples' outputs (branching where they diverged) verified
    exactly: the samples follow the target's joint distribution, and trees were accepted and
    rejected at the first two levels."""
    spec = SpecConfig(method="suffix", num_speculative_tokens=3, depth="fixed")
    proposer = OneScope(spec)
    engine = SpecEngine(small_vocab_target, proposer, spec)
    branched: list[int] = []
    draft = proposer.draft

    def counted(*args: object, **kwargs: object):
        tree = draft(*args, **kwargs)  # type: ignore[arg-type]
        branched.append(int(tree.size > tree.depth))
        return tree

    proposer.draft = counted  # type: ignore[method-assign]
    assert_trees_sample_the_target(engine, prefix_logits, sampling)
    assert sum(branched) > 200, "the trees hardly branched"


@pytest.fixture(scope="module")
def smollm2() -> SpecEngine:
    return verispec.load("smollm2-135m-instruct", method="suffix", num_speculative_tokens=8, depth="fixed")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_repeats_a_scope_s_output_from_its_cache(smollm2: SpecEngine) -> None:
    """The same request twice in one scope: the second drafts from the first's output and accepts
    most of it; a private and another scope's request draft as the first did (their own text
    only). Greedy output equals plain decoding throughout."""
    prompt = smollm2.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    )
    plain = smollm2.plain_engine().generate(prompt, max_new_tokens=64)
    runs = {}
    for name, scope in (("first", "a"), ("private", None), ("other", "b"), ("again", "a")):
        got = smollm2.generate(prompt, max_new_tokens=64, cache_scope=scope)
        assert got.token_ids == plain.token_ids, name
        runs[name] = got.stats
    assert runs["private"].num_accepted == runs["first"].num_accepted
    assert runs["other"].num_accepted == runs["first"].num_accepted
    assert runs["again"].num_accepted >= len(plain.token_ids) // 2
    assert runs["again"].num_accepted > runs["first"].num_accepted + 10
    assert runs["again"].num_steps < runs["first"].num_steps
