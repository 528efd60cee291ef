"""The batched engine: continuous batching is invisible in the output, and requests come and go safely."""

from __future__ import annotations

import pytest

from tests.conftest import perturbed, tiny_llama
from verispec.config import DraftModelConfig, SchedulerConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import QueueFullError, VerispecError
from verispec.models.hf import HFCausalLM
from verispec.models.quant import quantize_int8_dynamic
from verispec.policy import FixedDepth
from verispec.proposers import build_proposer

PROMPTS = [
    [5, 17, 42, 8, 9, 61, 3],
    [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
    [77] * 3,
    [9],
    list(range(10, 90)),  # longer than the rowwise limit: a chunked SDPA prefill
    [4, 4, 8, 8, 4, 4, 8],
]


def engine_for(target, draft, method, k=4, batch=3, prefill_chunk=32) -> SpecEngine:
    spec = SpecConfig(
        method=method,
        num_speculative_tokens=k,
        draft=DraftModelConfig(model="d" if draft else None),
        depth="fixed",
    )
    proposer = build_proposer(spec, target, draft) if method else None
    scheduler = SchedulerConfig(max_batch_size=batch, max_waiting=64, prefill_chunk=prefill_chunk)
    return SpecEngine(target, proposer, spec, draft=draft, scheduler=scheduler)


@pytest.fixture(scope="module")
def int8_pair() -> tuple[HFCausalLM, HFCausalLM]:
    target = tiny_llama(0)
    draft = perturbed(target, 0.3, seed=1)
    return (
        HFCausalLM(quantize_int8_dynamic(target), name="int8-target"),
        HFCausalLM(quantize_int8_dynamic(draft), name="int8-draft"),
    )


@pytest.mark.parametrize("quant", ["fp32", "int8"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_batched_speculation_equals_one_at_a_time_plain_decoding(
    tiny_target, tiny_draft, int8_pair, quant, method
):
    """Six prompts of different lengths through three slots (sequences join as others finish, with
    different max_new_tokens so they leave at different steps) give exactly the tokens each prompt
    gets alone without speculation."""
    target, draft = (tiny_target, tiny_draft) if quant == "fp32" else int8_pair
    plain = engine_for(target, None, None, batch=1)
    want = [plain.generate(p, max_new_tokens=20 + 3 * i).token_ids for i, p in enumerate(PROMPTS)]
    engine = engine_for(target, draft if method == "draft" else None, method)
    requests = [engine.make_request(p, max_new_tokens=20 + 3 * i) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    batch_sizes, drafted, accepted = [], 0, 0
    engine.step_observers.append(lambda report: batch_sizes.append(report.batch_size))
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            got[out.request_id] += [e.token_id for e in out.events]
            for e in out.events:
                if e.stats is not None:
                    drafted += e.stats.num_drafted
                    accepted += e.stats.num_accepted
    assert [got[r.request_id] for r in requests] == want
    assert max(batch_sizes) == 3 and min(batch_sizes) < 3  # batches really formed, and shrank
    assert drafted > 0 and 0 < accepted < drafted  # non-vacuous: drafts accepted and rejected


def test_requests_with_speculation_off_mix_with_speculating_ones(tiny_target, tiny_draft):
    engine = engine_for(tiny_target, tiny_draft, "draft")
    plain = engine_for(tiny_target, None, None)
    gens = []
    for k in (0, 2, None):
        gens.append(engine.make_request(PROMPTS[0], max_new_tokens=24, num_speculative_tokens=k))
    for r in gens:
        engine.add(r)
    results: dict[str, list] = {r.request_id: [] for r in gens}
    while engine.has_work():
        for out in engine.step():
            results[out.request_id] += out.events
    want = plain.generate(PROMPTS[0], max_new_tokens=24).token_ids
    off, two, full = (results[r.request_id] for r in gens)
    for events in (off, two, full):
        assert [e.token_id for e in events] == want
    assert off[-1].stats.num_drafted == 0
    assert off[-1].stats.drafted_at == []
    assert len(two[-1].stats.drafted_at) <= 2 and two[-1].stats.num_drafted > 0
    assert len(full[-1].stats.drafted_at) == 4


def test_abort_frees_the_sequence_and_the_others_go_on(tiny_target, tiny_draft):
    engine = engine_for(tiny_target, tiny_draft, "draft", batch=2)
    a = engine.make_request(PROMPTS[0], max_new_tokens=30)
    b = engine.make_request(PROMPTS[1], max_new_tokens=30)
    engine.add(a)
    engine.add(b)
    engine.step()
    engine.step()
    assert len(engine.running) == 2
    assert engine.abort(a.request_id)
    assert not engine.abort(a.request_id)  # already gone
    assert [s.request.request_id for s in engine.running] == [b.request_id]
    finished = False
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == b.request_id
            finished |= out.finished
    assert finished and not engine.running


def test_a_full_queue_refuses_with_a_retry_hint(tiny_target):
    engine = engine_for(tiny_target, None, None, batch=1)
    engine.scheduler = SchedulerConfig(max_batch_size=1, max_waiting=2)
    for _ in range(3):  # one for the free batch slot, two to wait behind it
        engine.add(engine.make_request(PROMPTS[0], max_new_tokens=4))
    with pytest.raises(QueueFullError) as info:
        engine.add(engine.make_request(PROMPTS[0], max_new_tokens=4))
    assert info.value.retry_after >= 1
    while engine.has_work():
        engine.step()
    engine.add(engine.make_request(PROMPTS[0], max_new_tokens=4))  # room again


def test_the_choices_of_one_request_are_queued_all_or_none(tiny_target):
    engine = engine_for(tiny_target, None, None, batch=1)
    engine.scheduler = SchedulerConfig(max_batch_size=1, max_waiting=2)
    engine.add(engine.make_request(PROMPTS[0], max_new_tokens=4))  # takes the free batch slot
    choices = [engine.make_request(PROMPTS[1], max_new_tokens=4, request_id=f"c-{i}") for i in range(3)]
    with pytest.raises(QueueFullError, match="3 sequences would wait"):
        engine.add_all(choices)  # two could wait, the third could not: none is queued
    assert len(engine.waiting) == 1
    engine.add_all(choices[:2])
    assert [s.request.request_id for s in engine.waiting][1:] == ["c-0", "c-1"]
    with pytest.raises(VerispecError, match="must differ"):
        engine.add_all([choices[2], choices[2]])


def test_a_failing_batch_ends_its_requests_with_an_error_and_the_engine_goes_on(
    tiny_target, monkeypatch, caplog
):
    engine = engine_for(tiny_target, None, None)
    engine.add(engine.make_request(PROMPTS[0], max_new_tokens=4))
    real = tiny_target.forward_batch

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(tiny_target, "forward_batch", broken)
    with caplog.at_level("ERROR", logger="verispec.engine.step"):
        outs = engine.step()
    assert outs and all(o.finished and "simulated kernel failure" in o.error for o in outs)
    assert any(r.exc_info for r in caplog.records), "a bug's traceback is logged for the operator"
    assert not engine.has_work()
    monkeypatch.setattr(tiny_target, "forward_batch", real)
    assert len(engine.generate(PROMPTS[0], max_new_tokens=4).token_ids) == 4


def test_duplicate_request_ids_are_refused(tiny_target):
    engine = engine_for(tiny_target, None, None)
    engine.add(engine.make_request(PROMPTS[0], request_id="x"))
    with pytest.raises(VerispecError, match="already in use"):
        engine.add(engine.make_request(PROMPTS[0], request_id="x"))


def test_long_prompts_are_prefilled_in_chunks_while_others_decode(tiny_target):
    engine = engine_for(tiny_target, None, None, prefill_chunk=16)
    short = engine.make_request(PROMPTS[0], max_new_tokens=10)
    long = engine.make_request(list(range(1, 81)), max_new_tokens=3)
    engine.add(short)
    engine.add(long)
    produced_while_prefilling = 0
    for _ in range(4):  # 79 prompt tokens in chunks of 16 take 5 steps
        outs = engine.step()
        produced_while_prefilling += sum(len(o.events) for o in outs if o.request_id == short.request_id)
        assert all(o.request_id == short.request_id for o in outs)
    assert produced_while_prefilling == 4
    alone = engine_for(tiny_target, None, None, prefill_chunk=16).generate(
        list(range(1, 81)), max_new_tokens=3
    )
    rest = []
    while engine.has_work():
        rest += [e.token_id for o in engine.step() if o.request_id == long.request_id for e in o.events]
    assert rest == alone.token_ids


class PauseThenSpeculate(FixedDepth):
    """No speculation for the first ``pause`` steps, then the full k."""

    def __init__(self, pause: int) -> None:
        super().__init__()
        self.pause = pause
        self.calls = 0

    def _choose(self, queries):
        self.calls += 1
        return [0 if self.calls <= self.pause else q.cap for q in queries]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_proposer_state_stays_fresh_while_speculation_is_paused(tiny_target, tiny_draft, method):
    """After 15 plain steps the proposer drafts from the whole context: the same acceptance as a
    sequence that speculated all along, over the same stretch of output."""
    draft = tiny_draft if method == "draft" else None
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    paused = engine_for(tiny_target, draft, method)
    paused.policy = PauseThenSpeculate(15)
    got = paused.generate(prompt, max_new_tokens=60)
    want = engine_for(tiny_target, None, None).generate(prompt, max_new_tokens=60)
    assert got.token_ids == want.token_ids
    # Continue the always-speculating run from the same 15 tokens: same context, same proposals.
    resumed = engine_for(tiny_target, draft, method).generate(prompt + want.token_ids[:15], max_new_tokens=45)
    assert got.stats.num_drafted == resumed.stats.num_drafted > 0
    assert got.stats.num_accepted == resumed.stats.num_accepted > 0


@pytest.mark.parametrize("places", [None, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_burst_of_prompts_is_prefilled_one_a_step_on_cpu_or_together_when_asked(
    int8_pair, places, temperature
):
    """Three prompts added at once: by default (CPU) each takes a step's prefill of its own, so the
    first gets its first token a step before the second, and not after all three prompts' work;
    with ``prefill_sequences=3`` one forward prefills them all and their first tokens come together.
    Either way each gets the tokens (and draws) it gets alone (int8: the same bits in any batch)."""
    target = int8_pair[0]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[5]]
    options = {"max_new_tokens": 6, "temperature": temperature, "seed": 3}
    want = [engine_for(target, None, None).generate(p, **options).token_ids for p in prompts]
    scheduler = SchedulerConfig(max_batch_size=3, prefix_cache_gb=0.0, prefill_sequences=places)
    engine = SpecEngine(target, None, SpecConfig(method=None), scheduler=scheduler)
    requests = [engine.make_request(p, **options) for p in prompts]
    for request in requests:
        engine.add(request)
    first_step: dict[str, int] = {}
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    step = 0
    while engine.has_work():
        step += 1
        for out in engine.step():
            assert out.error is None
            if out.events:
                first_step.setdefault(out.request_id, step)
            got[out.request_id] += [e.token_id for e in out.events]
    assert [got[r.request_id] for r in requests] == want
    firsts = [first_step[r.request_id] for r in requests]
    assert firsts == ([1, 2, 3] if places is None else [1, 1, 1])
