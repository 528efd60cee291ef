"""The llama.cpp side of ``verispec bench load``, run as a script in a process of its own.

It imports only the standard library and ``llama_cpp`` (no torch, no verispec), so its peak memory
is llama.cpp's and the Python interpreter's, nothing of verispec's. Usage:

    python model_load_llamacpp.py SETTINGS_JSON RESULT_FILE

``SETTINGS_JSON`` holds ``model_path``, ``threads``, ``context``, ``ks`` and ``repeats``; the result
file gets the fields of :class:`verispec.bench.model_load.SideResult` that a worker measures, or
``{"error": ...}``. Anything llama.cpp's C code prints goes to this process's output, which the
parent writes to a log.

The cost of appending k tokens is timed the way :func:`verispec.bench.forward.measure_curve` times
it: the context evaluated once, one untimed ``eval`` of each k, then ``repeats`` rounds that time
one ``eval`` of every k in turn, each starting from the same ``context``-token cache. Setting
``Llama.n_tokens`` back to the context is the rollback: ``eval`` first removes every cache cell
from ``n_tokens`` on.
The model is asked for logits at every position (``logits_all``), as a speculative check of k
tokens needs them; a llama-cpp-python too new or old to take that flag computes only the last row,
and the result says so.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB, file pages it mapped included.

    On Linux, ``VmHWM``: the high-water mark of the memory of the program this process runs. Not
    ``ru_maxrss``, which Linux carries across fork and exec: a worker started by a parent holding
    300 MB of imports would report at least those 300 MB, whatever it used itself. Elsewhere
    ``ru_maxrss`` (KiB on Linux, bytes on macOS) is all there is. (Both sides of the benchmark use
    this one: it lives here because this module may import nothing but the standard library.)
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def current_rss_mb() -> float | None:
    """Resident memory now, in MiB (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def timed_load(load: Callable[[], T]) -> tuple[T, dict[str, float | None]]:
    """What ``load()`` returns, and the :class:`~verispec.bench.model_load.SideResult` fields of what
    it cost: the seconds, and this process's resident memory before, after and at its peak."""
    rss_before = current_rss_mb()
    started = time.perf_counter()
    loaded = load()
    load_seconds = time.perf_counter() - started
    return loaded, {
        "load_seconds": load_seconds,
        "peak_rss_after_load_mb": peak_rss_mb(),
        "rss_before_load_mb": rss_before,
        "rss_after_load_mb": current_rss_mb(),
    }


def run_worker(measure: Callable[[dict[str, Any]], dict[str, Any]], argv: Sequence[str]) -> int:
    """A side's worker process: ``measure`` the settings ``argv[0]`` (JSON) and write the result to the
    file ``argv[1]``: the fields on success or ``{"error": ...}`` for an exception, with the process's
    peak memory either way (a crash leaves the file absent, and the parent reports the exit instead)."""
    settings, result_path = json.loads(argv[0]), Path(argv[1])
    try:
        result = measure(settings)
    except Exception as exc:  # reported as the side's failure; the parent decides what it means
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["peak_rss_mb"] = peak_rss_mb()
    result_path.write_text(json.dumps(result))
    return 0 if "error" not in result else 1


def load(settings: dict[str, Any]) -> tuple[Any, bool]:
    """The ``llama_cpp.Llama`` for the file, and whether it computes logits at every position."""
    import llama_cpp

    threads = settings["threads"]
    common = {
        "model_path": settings["model_path"],
        "n_ctx": settings["context"] + max(settings["ks"]),
        "n_batch": max(512, settings["context"]),
        "n_threads": threads,
        "n_threads_batch": threads,
        "verbose": False,
    }
    try:
        return llama_cpp.Llama(logits_all=True, **common), True
    except TypeError:  # a version without the flag
        return llama_cpp.Llama(**common), False


def _uses_mmap(llama_cpp: Any, llm: Any) -> bool | None:
    """Whether llama.cpp maps the file (the default) rather than reading it: older versions say so
    with ``use_mmap``, newer ones with a ``load_mode``."""
    params = getattr(llm, "model_params", None)
    if hasattr(params, "use_mmap"):
        return bool(params.use_mmap)
    mapped = [
        getattr(llama_cpp, name, None) for name in ("LLAMA_LOAD_MODE_MMAP", "LLAMA_LOAD_MODE_MMAP_MLOCK")
    ]
    return params.load_mode in mapped if hasattr(params, "load_mode") else None


def measure(settings: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    (llm, all_logits), loaded = timed_load(lambda: load(settings))

    context, ks, repeats = settings["context"], settings["ks"], settings["repeats"]
    rng = random.Random(1)
    ids = [rng.randrange(llm.n_vocab()) for _ in range(context + max(ks))]
    started = time.perf_counter()
    llm.eval(ids[:context])
    first_forward = time.perf_counter() - started
    # Without logits_all, newer versions leave ``scores`` unwritten: nothing to check then.
    finite = all(math.isfinite(float(x)) for x in llm.scores[llm.n_tokens - 1]) if all_logits else None

    for k in ks:  # warm-up of each shape
        llm.n_tokens = context
        llm.eval(ids[context : context + k])
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):  # rounds over every k, as measure_curve takes them
        for k in ks:
            llm.n_tokens = context  # eval removes the cache cells from here on: the same context each time
            began = time.perf_counter()
            llm.eval(ids[context : context + k])
            times[k].append((time.perf_counter() - began) * 1000)
    points = [{"k": k, "median_ms": statistics.median(times[k]), "ms": times[k]} for k in ks]
    return {
        **loaded,
        "first_forward_seconds": first_forward,
        "logits_finite": finite,
        "curve": {"role": "llama.cpp", "model": settings["model_path"], "context": context, "points": points},
        "details": {
            "llama_cpp_python": getattr(llama_cpp, "__version__", None),
            "threads": settings["threads"],
            "logits": "every position" if all_logits else "last position only",
            "mmap": _uses_mmap(llama_cpp, llm),
            "n_ctx": int(llm.n_ctx()),
        },
    }


if __name__ == "__main__":
    sys.exit(run_worker(measure, sys.argv[1:]))
