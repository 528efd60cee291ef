"""The engine on its own thread, for asyncio callers (the HTTP server).

PyTorch releases the GIL inside its kernels, so one thread runs :meth:`SpecEngine.step` in a loop
while the event loop keeps accepting connections and streaming tokens. All engine state is touched
by that thread only: callers hand it commands (add, abort) that it applies between steps, and it
hands each request's outputs back through an ``asyncio.Queue`` on the caller's loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from verispec.engine import Request, RequestOutput, SpecEngine

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs a :class:`SpecEngine` on a background thread; :meth:`generate` streams one request."""

    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)
        self.alive = False

    def start(self) -> None:
        self.alive = True
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.alive = False

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` and yield its outputs until it finishes.

        Raises :class:`~verispec.errors.QueueFullError` before yielding anything when the queue is
        full. If the caller stops iterating (a client disconnected), the request is aborted and its
        memory freed.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        accepted: Future[None] = Future()

        def add() -> None:
            try:
                self.engine.add(request)
            except Exception as exc:
                accepted.set_exception(exc)
            else:
                self._queues[request.request_id] = (loop, queue)
                accepted.set_result(None)

        self._submit(add)
        await asyncio.wrap_future(accepted)
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        def drop() -> None:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(drop)

    def call(self, fn: Callable[[SpecEngine], object]) -> Future[object]:
        """Run ``fn(engine)`` on the engine thread between steps (reading its state safely)."""
        done: Future[object] = Future()

        def run() -> None:
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
        while not self._stop:
            self._wake.clear()  # before reading commands: a command added later sets it again
            while self._commands:
                self._commands.popleft()()
            if not self.engine.has_work():
                self._wake.wait(timeout=1.0)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine guards its batches, so this is a bug: fail the
                log.exception("engine step failed")  # requests in flight and keep serving
                outputs = [
                    RequestOutput(rid, finished=True, error=f"internal error: {exc!r}")
                    for rid in self._queues
                ]
                for output in outputs:
                    self.engine.abort(output.request_id)
            for output in outputs:
                target = self._queues.get(output.request_id)
                if target is None:
                    continue
                loop, queue = target
                if output.finished:
                    del self._queues[output.request_id]
                loop.call_soon_threadsafe(queue.put_nowait, output)
