"""The engine on its own thread, for asyncio callers (the HTTP server).

PyTorch releases the GIL inside its kernels, so one thread runs :meth:`SpecEngine.step` in a loop
while the event loop keeps accepting connections and streaming tokens. All engine state is touched
by that thread only: callers hand it commands (add, abort, any function through :meth:`call`) that
it applies between steps, and it hands each request's outputs back through an ``asyncio.Queue`` on
the caller's loop.

Nothing a caller does can stop the thread: a failing command or step is logged and answered with
an error for the requests concerned, and outputs for a caller whose loop has closed are dropped
(and the request aborted) rather than raised on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TypeVar

from verispec.engine import Request, RequestOutput, SpecEngine

log = logging.getLogger(__name__)
T = TypeVar("T")

SHUTDOWN_MESSAGE = "the server is shutting down"


class RequestStream:
    """The outputs of one or more queued requests (the choices of one API request), in the order
    they came, until each has sent the one marked ``finished``.

    Iterate it with ``async for`` (``RequestOutput.request_id`` tells the requests apart). Leaving
    early (``break``, an exception, cancellation when the client disconnects) must abort the
    requests so that their sequences stop using batch slots and KV memory: use it as ``async with
    stream:`` or call :meth:`abort`, which is idempotent.
    """

    def __init__(
        self, owner: AsyncEngine, request_ids: list[str], queue: asyncio.Queue[RequestOutput]
    ) -> None:
        self._owner = owner
        self.request_ids = request_ids
        self._queue = queue
        self._open = set(request_ids)

    @property
    def request_id(self) -> str:
        return self.request_ids[0]

    @property
    def finished(self) -> bool:
        return not self._open

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._queue.get()
        if output.finished:
            self._open.discard(output.request_id)
        return output

    def abort(self) -> None:
        """Stop generating (no-op once finished): frees the sequences on the engine thread."""
        for request_id in [r for r in self.request_ids if r in self._open]:
            self._open.discard(request_id)
            self._owner.abort(request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()


class AsyncEngine:
    """Runs a :class:`SpecEngine` on a background thread; :meth:`add` queues a request and returns
    its :class:`RequestStream`."""

    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and takes requests (false before start and after shutdown)."""
        return self._thread.is_alive() and not self._stop

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight end with an error."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    async def add(self, request: Request) -> RequestStream:
        """Queue ``request``; returns once the engine has accepted it.

        Raises :class:`~verispec.errors.QueueFullError` (or another
        :class:`~verispec.errors.VerispecError`) when the engine refuses it, and ``RuntimeError`` when
        the engine thread is not running. Cancelled while waiting, it withdraws the request.
        """
        return await self.add_all([request])

    async def add_all(self, requests: list[Request]) -> RequestStream:
        """Queue ``requests`` all or none (:meth:`SpecEngine.add_all`), with one stream for their
        outputs; raises and withdraws as :meth:`add` does."""
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        accepted: Future[None] = Future()
        ids = [r.request_id for r in requests]

        def add() -> None:
            if not accepted.set_running_or_notify_cancel():
                return  # the caller gave up before the engine got to it
            try:
                self.engine.add_all(requests)
            except Exception as exc:
                accepted.set_exception(exc)
            else:
                for request_id in ids:
                    self._queues[request_id] = (loop, queue)
                accepted.set_result(None)

        self._submit(add)
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            for request_id in ids:  # runs after `add` on the engine thread, if that added them
                self.abort(request_id)
            raise
        return RequestStream(self, ids, queue)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` and yield its outputs until it finishes.

        Raises :class:`~verispec.errors.QueueFullError` before yielding anything when the queue is
        full. If the caller stops iterating (a client disconnected), the request is aborted and its
        memory freed.
        """
        async with await self.add(request) as stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        """Drop a request and free its sequence, between steps; unknown ids are ignored."""

        def drop() -> None:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(drop)

    def call(self, fn: Callable[[SpecEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps (reading its state safely).

        The future never completes if the thread is not running; wait on it with a timeout.
        """
        done: Future[T] = Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(self.engine))
            except Exception as exc:
                done.set_exception(exc)

        self._submit(run)
        return done

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()  # before reading commands: a command added later sets it again
                while self._commands:
                    command = self._commands.popleft()
                    try:
                        command()
                    except Exception:
                        log.exception("engine command failed")
                if not self.engine.has_work():
                    self._wake.wait(timeout=1.0)
                    continue
                self._deliver(self._step())
        finally:
            self._stop = True
            while self._commands:  # adds that raced with the stop: run them so their callers get an answer
                try:
                    self._commands.popleft()()
                except Exception:
                    log.exception("engine command failed")
            self._fail_all(SHUTDOWN_MESSAGE)

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # the engine guards its batches, so this is a bug: fail the
            log.exception("engine step failed")  # requests in flight and keep serving
            outputs = [
                RequestOutput(rid, finished=True, error=f"internal error: {exc!r}") for rid in self._queues
            ]
            for output in outputs:
                self.engine.abort(output.request_id)
            return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is None:
                continue
            loop, queue = target
            if output.finished:
                del self._queues[output.request_id]
            try:
                loop.call_soon_threadsafe(queue.put_nowait, output)
            except RuntimeError:  # the caller's event loop is closed: nobody will read this request
                self._queues.pop(output.request_id, None)
                self.engine.abort(output.request_id)

    def _fail_all(self, message: str) -> None:
        """End every request still waiting for outputs with ``message`` (the thread is stopping)."""
        outputs = [RequestOutput(rid, finished=True, error=message) for rid in self._queues]
        for output in outputs:
            self.engine.abort(output.request_id)
        self._deliver(outputs)
