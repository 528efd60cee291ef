"""Build models on a thread that ends, so the thread that steps an engine holds the only OpenMP team.

Loading a model and measuring its step costs run OpenMP regions (torch's ``parallel_for``,
verispec's kernels), and a thread that has run one keeps a team of OpenMP workers while it lives.
An engine stepped on another thread (the server's engine thread, :class:`~verispec.async_engine.
AsyncEngine`, a caller's worker thread) then makes a team of its own: with more OpenMP threads
alive than cores, GNU OpenMP (torch's wheels use it) stops letting its workers spin between
regions, and each region wakes them through the kernel. On 2 cores a 1.5B decode step took 60-70 ms
on the server's engine thread instead of ~40 ms. A loading thread that has ended leaves no team
behind, so whichever thread steps the engine next has the only one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def off_main_thread(build: Callable[[], T]) -> T:
    """``build()`` on a thread of its own that ends with it; its result or its error comes back."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = build()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=run, name="verispec-load", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
