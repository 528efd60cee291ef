"""AsyncEngine: the engine thread behind the server. Ordering, refusals, aborts, faults, shutdown."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from verispec.async_engine import SHUTDOWN_MESSAGE, AsyncEngine
from verispec.config import SchedulerConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import QueueFullError
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer

PROMPT = [5, 17, 42, 8, 9, 61, 3]


def engine_for(target: HFCausalLM, draft: HFCausalLM | None = None, **scheduler: int) -> SpecEngine:
    spec = SpecConfig(method="draft" if draft is not None else None, num_speculative_tokens=3, depth="fixed")
    return SpecEngine(
        target, build_proposer(spec, target, draft), spec, draft=draft, scheduler=SchedulerConfig(**scheduler)
    )


@pytest.fixture
def running(tiny_target) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(engine_for(tiny_target, max_batch_size=1, max_waiting=1))
    engine.start()
    yield engine
    engine.shutdown()


def held_count(async_engine: AsyncEngine) -> int:
    return async_engine.call(lambda e: len(e.running) + len(e.waiting)).result(timeout=10)


def test_outputs_match_the_synchronous_engine(tiny_target, tiny_draft):
    want = engine_for(tiny_target, tiny_draft).generate(PROMPT, max_new_tokens=20)
    async_engine = AsyncEngine(engine_for(tiny_target, tiny_draft))
    async_engine.start()

    async def run() -> list:
        request = async_engine.engine.make_request(PROMPT, max_new_tokens=20)
        return [out async for out in async_engine.generate(request)]

    try:
        outputs = asyncio.run(run())
    finally:
        async_engine.shutdown()
    events = [e for out in outputs for e in out.events]
    assert [e.token_id for e in events] == want.token_ids
    assert outputs[-1].finished and not any(out.finished for out in outputs[:-1])
    assert all(out.error is None for out in outputs)
    assert events[-1].stats is not None and events[-1].stats.num_drafted > 0


def test_full_queue_is_refused_before_any_output(running):
    gate = threading.Event()
    running.call(lambda e: gate.wait(10))  # hold the thread so all adds run in one drain, no step between

    async def run() -> tuple[object, object]:
        engine = running.engine
        # Batch 1 + 1 waiting: the first takes the free slot, the second waits, the third is refused.
        adds = [
            asyncio.ensure_future(running.add(engine.make_request(PROMPT, max_new_tokens=5)))
            for _ in range(3)
        ]
        await asyncio.sleep(0.05)  # the commands are queued behind the gate
        gate.set()
        results = await asyncio.gather(*adds, return_exceptions=True)
        last = None
        for stream in results[:2]:
            async with stream:  # type: ignore[attr-defined]
                last = [out async for out in stream][-1]  # type: ignore[attr-defined]
        return results[2], last

    refusal, last = asyncio.run(run())
    assert isinstance(refusal, QueueFullError) and refusal.retry_after >= 1
    assert last.finished and last.error is None


def test_leaving_early_aborts_and_frees_the_sequence(running):
    async def run() -> int:
        request = running.engine.make_request(PROMPT, max_new_tokens=400)
        received = 0
        async for out in running.generate(request):
            received += len(out.events)
            if received >= 2:
                break
        return received

    assert asyncio.run(run()) >= 2
    assert held_count(running) == 0

    async def next_request() -> list:  # the only batch slot is free again
        request = running.engine.make_request(PROMPT, max_new_tokens=3)
        return [out async for out in running.generate(request)]

    assert next_request_done(asyncio.run(next_request()))


def next_request_done(outputs: list) -> bool:
    return outputs[-1].finished and outputs[-1].error is None and sum(len(o.events) for o in outputs) == 3


def test_cancel_while_waiting_for_admission_withdraws_the_request(running):
    gate = threading.Event()
    running.call(lambda e: gate.wait(10))

    async def run() -> None:
        add = asyncio.ensure_future(running.add(running.engine.make_request(PROMPT, max_new_tokens=300)))
        await asyncio.sleep(0.05)
        add.cancel()
        with pytest.raises(asyncio.CancelledError):
            await add
        gate.set()

    asyncio.run(run())
    assert held_count(running) == 0


def test_call_runs_on_the_engine_thread_and_passes_errors_back(running):
    assert running.call(lambda e: threading.current_thread().name).result(timeout=10) == "verispec-engine"

    def broken(_engine: SpecEngine) -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        running.call(broken).result(timeout=10)
    assert running.alive  # a failing command does not stop the thread


def test_a_failing_step_fails_its_requests_and_the_thread_goes_on(running):
    real_step = running.engine.step
    failures = iter([RuntimeError("injected")])

    def step_once_broken() -> list:
        for exc in failures:
            raise exc
        return real_step()

    running.engine.step = step_once_broken  # type: ignore[method-assign]

    async def run(n: int) -> list:
        request = running.engine.make_request(PROMPT, max_new_tokens=n)
        return [out async for out in running.generate(request)]

    failed = asyncio.run(run(5))
    assert len(failed) == 1 and failed[0].finished and "injected" in (failed[0].error or "")
    assert held_count(running) == 0
    ok = asyncio.run(run(5))
    assert ok[-1].finished and ok[-1].error is None
    assert sum(len(out.events) for out in ok) == 5


def test_shutdown_ends_requests_in_flight_with_an_error(tiny_target):
    async_engine = AsyncEngine(engine_for(tiny_target))
    async_engine.start()

    async def run() -> list:
        request = async_engine.engine.make_request(PROMPT, max_new_tokens=400)
        stream = await async_engine.add(request)
        outputs = [await stream.__anext__()]
        await asyncio.to_thread(async_engine.shutdown)
        outputs.extend([out async for out in stream])
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].error == SHUTDOWN_MESSAGE
    assert not async_engine.alive

    async def add_after_shutdown() -> None:
        await async_engine.add(async_engine.engine.make_request(PROMPT, max_new_tokens=3))

    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(add_after_shutdown())
