"""The prefix cache: blocks found by scope and tokens, evicted least recently used, and reuse that is
exact (the same output, log-probabilities and random draws as recomputing the prompt)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from tests.conftest import needs_smollm2, perturbed, tiny_llama
from tests.training.test_eagle3_train import raw_arrays
from tests.training.tiny import greedy_texts, trained
from verispec.config import NgramConfig, SchedulerConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.engine.prefix_cache import BLOCK, CANDIDATES, DRAFT, PrefixCache
from verispec.heads.eagle import EagleDrafter
from verispec.heads.eagle3 import Eagle3Drafter
from verispec.heads.vocab import VocabHead
from verispec.models.base import BatchOutput
from verispec.models.hf import HFCausalLM
from verispec.models.kv import KVBuffer
from verispec.models.quant import quantize_model
from verispec.proposers import build_proposer
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.eagle3 import Eagle3Proposer
from verispec.training.config import TrainSettings
from verispec.training.eagle3 import train_eagle3
from verispec.training.tokens import TokenData

LAYERS, HKV, DIM = 3, 2, 4


def filled(tokens: int, seed: int = 0) -> KVBuffer:
    """A cache holding random keys and values at ``tokens`` positions of every layer."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVBuffer()
    for layer in range(LAYERS):
        keys, values = (torch.randn(HKV, tokens, DIM, generator=gen) for _ in range(2))
        cache.write(layer, 0, keys, values)
    cache.advance(tokens)
    return cache


def same_positions(a: KVBuffer, b: KVBuffer, n: int) -> bool:
    return all(
        torch.equal(x[i][:, :n], y[i][:, :n])
        for x, y in ((a.keys, b.keys), (a.values, b.values))
        for i in range(LAYERS)
    )


def test_a_prompt_takes_the_longest_prefix_it_shares_to_the_token():
    cache = PrefixCache(10**9)
    ids = list(range(100, 100 + 3 * BLOCK + 5))
    source = filled(len(ids))
    assert cache.keep("a", ids, source) == 4  # three whole blocks and the 5 tokens after them
    assert cache.keep("a", ids, source) == 0  # nothing new the second time
    again = KVBuffer()
    got = cache.reuse("a", [*ids, 7, 8], again, limit=len(ids) + 1)
    assert got.tokens == len(ids) == again.length
    assert same_positions(source, again, len(ids))
    # a prompt that differs inside the second block takes the first and the second's first token
    other = [*ids[: BLOCK + 1], 1, *ids[BLOCK + 2 :]]
    taken = KVBuffer()
    assert cache.reuse("a", other, taken, limit=len(other)).tokens == BLOCK + 1
    assert same_positions(source, taken, BLOCK + 1)
    # the limit keeps the prompt's last token out
    assert cache.reuse("a", ids, KVBuffer(), limit=2 * BLOCK + 3).tokens == 2 * BLOCK + 3
    assert cache.reuse("a", [*ids[:5], 9], KVBuffer(), limit=6).tokens == 5
    assert cache.hits == len(ids) + BLOCK + 1 + 2 * BLOCK + 3 + 5


def test_a_longer_partial_block_replaces_the_one_it_extends():
    cache = PrefixCache(10**9)
    ids = list(range(BLOCK + 3))
    source = filled(2 * BLOCK + 2)
    assert cache.keep("a", ids, source) == 2
    longer = [*ids, 50, 51]
    assert cache.keep("a", longer, source) == 1  # the 5-token tail; the 3-token one is dropped
    assert len(cache) == 2
    assert cache.keep("a", ids, source) == 0  # a tail that a stored block starts with is not kept
    whole = [*longer, *range(60, 60 + BLOCK - 5)]
    assert cache.keep("a", whole, source) == 1 and len(cache) == 2  # a whole block replaces it
    got = KVBuffer()
    assert cache.reuse("a", [*whole, 0], got, limit=len(whole)).tokens == 2 * BLOCK
    assert same_positions(source, got, 2 * BLOCK)
    # sibling tails of one parent: the one sharing the most is taken
    cache.keep("a", [*ids[:BLOCK], 7, 8, 9], filled(BLOCK + 3, seed=3))
    assert cache.reuse("a", [*ids[:BLOCK], 7, 8, 5, 5], KVBuffer(), limit=BLOCK + 4).tokens == BLOCK + 2
    assert cache.reuse("a", [*whole[: BLOCK + 4], 9, 9], KVBuffer(), limit=BLOCK + 6).tokens == BLOCK + 4


def test_a_parent_with_many_continuations_compares_only_its_recent_blocks():
    """Under a shared prefix followed by many conversations, storing or finding a partial block
    compares at most CANDIDATES of the parent's blocks (newest first); a sequence's own tail, stored
    last, is still replaced by the block that extends it and found again."""
    cache = PrefixCache(10**9)
    shared = list(range(BLOCK))
    source = filled(2 * BLOCK)
    for i in range(CANDIDATES + 40):  # as many conversations after one system prompt
        cache.keep("a", [*shared, 10_000 + i, 7], source)
    (shared_key,) = [k for k, b in cache._blocks.items() if b.tokens == tuple(shared)]
    assert len(cache._children[shared_key]) == CANDIDATES + 40
    assert len(cache._recent(shared_key)) == CANDIDATES
    tail = [*shared, 5, 6, 7]
    before = len(cache)
    assert cache.keep("a", tail, source) == 1
    assert cache.keep("a", [*tail, 8], source) == 1 and len(cache) == before + 1  # the 3-token tail went
    assert cache.reuse("a", [*tail, 8, 0], KVBuffer(), limit=BLOCK + 4).tokens == BLOCK + 4


def test_scopes_never_see_each_others_blocks():
    cache = PrefixCache(10**9)
    ids = list(range(2 * BLOCK + 1))
    cache.keep("tenant-a", ids, filled(len(ids)))
    assert cache.reuse("tenant-b", ids, KVBuffer(), limit=len(ids) - 1).tokens == 0
    assert cache.reuse("tenant-a", ids, KVBuffer(), limit=len(ids) - 1).tokens == 2 * BLOCK


def test_least_recently_used_blocks_go_first_and_a_prefix_outlives_its_tail():
    one = filled(BLOCK)
    block_bytes = sum(t[:, :BLOCK].numel() * 4 for t in (*one.keys.values(), *one.values.values()))
    cache = PrefixCache(4 * block_bytes)
    first = list(range(3 * BLOCK))
    cache.keep("s", first, filled(len(first), seed=1))
    second = list(range(1000, 1000 + 2 * BLOCK))
    cache.keep("s", second, filled(len(second), seed=2))
    assert cache.nbytes <= 4 * block_bytes and len(cache) == 4
    # the first conversation lost its last block, not its first ones
    assert cache.reuse("s", [*first, 0], KVBuffer(), limit=len(first)).tokens == 2 * BLOCK
    assert cache.reuse("s", [*second, 0], KVBuffer(), limit=len(second)).tokens == 2 * BLOCK


def test_hidden_rows_travel_with_their_blocks():
    cache = PrefixCache(10**9)
    ids = list(range(2 * BLOCK))
    hidden = torch.randn(2 * BLOCK, 5)
    cache.keep("s", ids, filled(len(ids)), hidden)
    got = cache.reuse("s", [*ids, 1], KVBuffer(), limit=len(ids), with_hidden=True)
    assert got.tokens == 2 * BLOCK and torch.equal(got.hidden, hidden)
    bare = PrefixCache(10**9)
    bare.keep("s", ids, filled(len(ids)))
    assert bare.reuse("s", [*ids, 1], KVBuffer(), limit=len(ids), with_hidden=True).tokens == 0


def test_a_draft_models_blocks_are_apart_from_the_targets_and_not_counted_as_hits():
    cache = PrefixCache(10**9)
    ids = list(range(2 * BLOCK + 1))
    target, draft = filled(len(ids), seed=1), filled(len(ids), seed=2)
    cache.keep("s", ids, target)
    assert cache.reuse("s", ids, KVBuffer(), limit=len(ids) - 1, part=DRAFT).tokens == 0
    assert cache.keep("s", ids, draft, part=DRAFT) == 3  # same scope and tokens: blocks of its own
    mine, theirs = KVBuffer(), KVBuffer()
    assert cache.reuse("s", ids, mine, limit=len(ids) - 1, part=DRAFT).tokens == 2 * BLOCK
    assert cache.reuse("s", ids, theirs, limit=len(ids) - 1).tokens == 2 * BLOCK
    assert same_positions(draft, mine, 2 * BLOCK) and same_positions(target, theirs, 2 * BLOCK)
    assert cache.hits == 2 * BLOCK and cache.queried == len(ids) - 1  # the one lookup of the target


def test_only_an_empty_cache_takes_a_prefix_and_a_zero_budget_keeps_nothing():
    with pytest.raises(ValueError, match="empty cache"):
        PrefixCache(10**9).reuse("s", [1, 2], filled(2), limit=1)
    assert PrefixCache(0).keep("s", list(range(BLOCK)), filled(BLOCK)) == 0


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def int8_target() -> HFCausalLM:
    model = HFCausalLM(quantize_model(tiny_llama(3, context=1024), "int8"), name="tiny-int8")
    model.quantization = "int8"
    return model


@pytest.fixture(scope="module")
def int8_draft() -> HFCausalLM:
    """A draft that agrees with :func:`int8_target` often but not always, on int8 weights too."""
    model = HFCausalLM(quantize_model(perturbed(tiny_llama(3, context=1024), 0.02, 5), "int8"), name="tiny-d")
    model.quantization = "int8"
    return model


def engine(
    target: HFCausalLM, method: str | None, gb: float = 1.0, draft: HFCausalLM | None = None
) -> SpecEngine:
    spec = SpecConfig(method=method, num_speculative_tokens=4, ngram=NgramConfig(3, 1), depth="fixed")  # type: ignore[arg-type]
    return SpecEngine(
        target,
        build_proposer(spec, target, draft),
        spec,
        scheduler=SchedulerConfig(prefix_cache_gb=gb, prefill_chunk=48),
    )


class CountingRows:
    """Counts the tokens a model is fed (wraps its ``forward_batch``)."""

    def __init__(self, model: HFCausalLM) -> None:
        self.inner, self.tokens = model.forward_batch, 0

    def __call__(self, caches: list[KVBuffer], tokens: list[list[int]], **kwargs: object) -> BatchOutput:
        self.tokens += sum(len(row) for row in tokens)
        return self.inner(caches, tokens, **kwargs)  # type: ignore[arg-type]


def conversation(engine: SpecEngine, turns: int, **options) -> list:
    """A chat-like exchange in token ids: each turn's prompt is the last prompt, the reply and new text."""
    gens, prompt = [], list(range(5, 45))
    for turn in range(turns):
        gen = engine.generate(prompt, max_new_tokens=24, logprobs=2, **options)
        gens.append(gen)
        prompt = prompt + gen.token_ids + [60 + turn, 61, 62, 63 + turn]
    return gens


def test_a_position_is_the_same_bits_from_a_prefill_or_a_decode_step(int8_target):
    assert int8_target.position_invariant
    ids = list(range(3, 70))
    whole, stepped = int8_target.new_cache(), int8_target.new_cache()
    int8_target.forward_batch([whole], [ids], logits_to_keep=[0])
    for i in range(0, len(ids), 5):
        int8_target.forward_batch([stepped], [ids[i : i + 5]], logits_to_keep=[1])
    for layer in whole.keys:
        assert torch.equal(whole.keys[layer][:, : len(ids)], stepped.keys[layer][:, : len(ids)])
        assert torch.equal(whole.values[layer][:, : len(ids)], stepped.values[layer][:, : len(ids)])


@pytest.mark.parametrize("method", [None, "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_later_turns_reuse_the_conversation_and_change_nothing(int8_target, method, temperature):
    options = {"temperature": temperature, "seed": 11}
    cached = conversation(engine(int8_target, method), 3, **options)
    fresh = conversation(engine(int8_target, method, gb=0.0), 3, **options)
    for a, b in zip(cached, fresh, strict=True):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.events] == [e.logprob for e in b.events]
        assert [e.top_logprobs for e in a.events] == [e.top_logprobs for e in b.events]
    assert cached[0].stats.cached_prompt_tokens == 0
    for later in cached[1:]:  # the earlier prompt and reply came from the cache, to the token
        shared = later.stats.prompt_tokens - 4 - 1  # all but the new text and the reply's last token
        assert later.stats.cached_prompt_tokens == shared > 0
    assert all(g.stats.cached_prompt_tokens == 0 for g in fresh)
    if method is not None:
        assert sum(g.stats.num_accepted for g in cached) > 0


def test_a_draft_model_takes_its_own_keys_and_values_from_the_cache_and_drafts_the_same(
    int8_target, int8_draft, monkeypatch
):
    """Its positions are reused like the target's (no prefill of them), and exactly: every turn
    drafts and accepts the very tokens it did when the draft computed its whole prompt."""
    assert int8_draft.position_invariant
    fed = CountingRows(int8_draft)
    monkeypatch.setattr(int8_draft, "forward_batch", fed)
    cached_engine = engine(int8_target, "draft", draft=int8_draft)
    cached = conversation(cached_engine, 3, temperature=1.0, seed=3)
    cached_fed, fed.tokens = fed.tokens, 0
    fresh = conversation(engine(int8_target, "draft", gb=0.0, draft=int8_draft), 3, temperature=1.0, seed=3)
    for a, b in zip(cached, fresh, strict=True):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.events] == [e.logprob for e in b.events]
        assert (a.stats.num_drafted, a.stats.num_accepted) == (b.stats.num_drafted, b.stats.num_accepted)
    assert sum(g.stats.num_accepted for g in cached) > 0
    # the draft skipped the positions the target reused, its replies' included, but for at most a
    # token a turn (a fully accepted draft's last token is never fed to the draft)
    reused, skipped = sum(g.stats.cached_prompt_tokens for g in cached), fed.tokens - cached_fed
    assert 0 < reused - (len(cached) - 1) <= skipped <= reused


class CountingPairs:
    """Counts the true pairs an EAGLE drafter is fed (wraps its ``step``; catch-up rows only)."""

    def __init__(self, drafter: EagleDrafter) -> None:
        self.inner, self.pairs = drafter.step, 0

    def __call__(self, embeds: torch.Tensor, features: torch.Tensor, groups: list) -> torch.Tensor:
        self.pairs += sum(g.count for g in groups if g.catch_up)
        return self.inner(embeds, features, groups)


def trained_eagle3(target: HFCausalLM) -> Eagle3Drafter:
    """An EAGLE-3 drafter fitted on the target's own greedy text, reading the raw input of layer 1."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (4,), generator=gen).tolist() for _ in range(100)]
    arrays = raw_arrays(target, greedy_texts(target, prompts, 32), (1,))
    settings = TrainSettings(kind="eagle3", aux_layers=(1,), unroll=2, epochs=10, batch_tokens=256, lr=1e-2)
    data = TokenData(arrays, "soft", (1,), raw_taps=True)
    return train_eagle3(target, data, settings, progress=False)[0]


def heads_proposer(target: HFCausalLM, method: str) -> Callable[[], EagleProposer]:
    """A maker of fresh proposers around one drafter trained for ``target``: verispec's EAGLE layer,
    or an EAGLE-3 drafter in the speculators' arithmetic; int8 Linears either way."""
    if method == "eagle":
        drafter = trained(target, "eagle")[0]
        embeddings = target.model.get_input_embeddings()
        return lambda: EagleProposer(
            copy.deepcopy(drafter), VocabHead(target, None), embeddings, nodes=6, width=2, quantize="int8"
        )
    drafter3 = trained_eagle3(target)
    size = target.vocab_size
    return lambda: Eagle3Proposer(copy.deepcopy(drafter3), size, nodes=6, width=2, quantize="int8")


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_drafters_take_their_pairs_from_the_cache_and_draft_the_same(int8_target, method):
    """Beside the target's keys the cache keeps an EAGLE or EAGLE-3 drafter's pairs (int8 drafter,
    C++ operations): a later turn feeds the drafter only its new positions, and drafts, accepts and
    samples exactly what it did when the drafter caught up on the whole conversation."""
    make = heads_proposer(int8_target, method)
    spec = SpecConfig(method=method, num_speculative_tokens=4, depth="fixed")  # type: ignore[arg-type]
    runs = []
    for gb in (1.0, 0.0):
        proposer = make()
        if not proposer.drafter.position_invariant:
            pytest.skip("the C++ operations did not build here")
        fed = CountingPairs(proposer.drafter)
        proposer.drafter.step = fed  # type: ignore[method-assign]
        scheduler = SchedulerConfig(prefix_cache_gb=gb, prefill_chunk=48)
        eng = SpecEngine(int8_target, proposer, spec, scheduler=scheduler)
        runs.append((conversation(eng, 3, temperature=1.0, seed=3), fed.pairs))
    (cached, cached_pairs), (fresh, fresh_pairs) = runs
    for a, b in zip(cached, fresh, strict=True):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.events] == [e.logprob for e in b.events]
        assert (a.stats.num_drafted, a.stats.num_accepted) == (b.stats.num_drafted, b.stats.num_accepted)
    assert sum(g.stats.num_accepted for g in cached) > 0
    # a later turn skips the pairs of the positions it reused, but for the one whose next token is
    # new and those the last step of the turn before had not fed yet (its verified rows: k + 1)
    reused, skipped = sum(g.stats.cached_prompt_tokens for g in cached), fresh_pairs - cached_pairs
    assert reused - (len(cached) - 1) * (spec.num_speculative_tokens + 2) <= skipped < reused


def test_private_requests_and_other_scopes_reuse_nothing(int8_target):
    eng = engine(int8_target, None)
    prompt = list(range(5, 60))
    first = eng.generate(prompt, max_new_tokens=8, cache_scope="a")
    assert eng.generate(prompt, max_new_tokens=8, cache_scope="a").stats.cached_prompt_tokens > 0
    other = eng.generate(prompt, max_new_tokens=8, cache_scope="b")
    private = eng.generate(prompt, max_new_tokens=8, cache_scope=None)
    assert other.stats.cached_prompt_tokens == private.stats.cached_prompt_tokens == 0
    assert first.token_ids == other.token_ids == private.token_ids


def test_prompt_logprobs_are_computed_not_reused(int8_target):
    eng = engine(int8_target, None)
    prompt = list(range(5, 60))
    eng.generate(prompt, max_new_tokens=4)
    scored = eng.generate(prompt, max_new_tokens=4, prompt_logprobs=1)
    assert scored.stats.cached_prompt_tokens == 0
    assert len(scored.prompt_logprobs) == len(prompt)


def test_no_prefix_cache_where_reuse_would_not_be_exact(tiny_target, int8_target):
    assert not tiny_target.position_invariant  # float weights: BLAS sums depend on the rows
    assert engine(tiny_target, None).prefix_cache is None
    assert engine(int8_target, None, gb=0.0).prefix_cache is None
    assert engine(int8_target, None).prefix_cache is not None


@needs_smollm2
@pytest.mark.parametrize("method", ["none", "eagle+ngram", "draft"])
def test_bundled_chat_turns_are_identical_with_the_cache(method):
    """SmolLM2's own GGUF blocks: a three-turn chat through its template, the EAGLE heads fed the
    reused positions' hidden states, a draft model (SmolLM2's own GGUF again) its reused keys and
    values. Each proposer drafts exactly what it drafted without the cache."""
    import verispec

    options = {"draft": "smollm2-135m-instruct"} if method == "draft" else {}
    cached = verispec.load("smollm2-135m-instruct", method=method, depth="fixed", **options)
    fresh = verispec.load("smollm2-135m-instruct", method=method, depth="fixed", prefix_cache_gb=0, **options)
    assert cached.prefix_cache is not None and fresh.prefix_cache is None
    replies = []
    for eng in (cached, fresh):
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        out = []
        for follow_up in ("Now add a docstring.", "Now add type hints."):
            gen = eng.chat(messages, max_new_tokens=40, logprobs=1)
            out.append(gen)
            messages += [{"role": "assistant", "content": gen.text}, {"role": "user", "content": follow_up}]
        replies.append(out)
    for a, b in zip(*replies, strict=True):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.events] == [e.logprob for e in b.events]
        assert (a.stats.num_drafted, a.stats.num_accepted) == (b.stats.num_drafted, b.stats.num_accepted)
    assert replies[0][1].stats.cached_prompt_tokens >= 32
    if method != "none":
        assert sum(g.stats.num_accepted for g in replies[0]) > 0
