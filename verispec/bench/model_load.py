"""``verispec bench load``: what a GGUF costs to load and to run, through verispec and through llama.cpp.

Whether a 7-8B model is usable on a small machine comes down to three numbers: the memory the
process peaks at while loading and running (it must fit the RAM, with room for the KV cache and the
rest of the system), the time from start to a loaded model, and the time of one forward that
appends k tokens to a short context (the verify-cost curve of :mod:`verispec.bench.forward`: what a
decoding step and a speculative check of k tokens cost). This module measures them for each side in
a fresh process of its own, one side after the other:

- the peak is ``ru_maxrss`` of that process, which covers everything it ever held at once
  (imports, the file's pages it touched, the weights, the caches) and nothing of the other side;
  a side that crashes or is killed for memory is reported with the exit reason and the peak it
  reached (from ``wait4``), never as a missing row;
- both sides run with the same CPU thread count, never at the same time;
- the file is read once before either side starts, so both find it in the page cache and neither
  load time includes the disk (a cold first side would otherwise look slower for the machine's
  reasons, not its own).

The verispec side loads with ``load_model(path, ModelLoadConfig(quantization=..., threads=...))``
("gguf": the file's own quantized blocks) and times the curve with
:func:`~verispec.bench.forward.measure_curve`. The llama.cpp side (llama-cpp-python,
:mod:`verispec.bench.model_load_llamacpp`) appends the same k tokens with ``Llama.eval`` and rolls the
cache back the same way; where llama-cpp-python is not installed it is reported as skipped, with
the reason. Each side also times its first forward (the prefill of the context) and checks that its
logits are finite: llama.cpp maps the file and reads most of it only then, so load time alone would
flatter it, and a random-weight model whose activations overflowed would time nothing meaningful.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verispec.bench.model_load_llamacpp import run_worker, timed_load

SCHEMA = "verispec-bench-load/1"
SIDES = ("verispec", "llama.cpp")
LLAMACPP_WORKER = Path(__file__).with_name("model_load_llamacpp.py")
"""The llama.cpp side, run as a script; its memory and worker helpers are stdlib-only, so both sides
share them."""
WAIT4_PEAK = "wait4: the worker died before reporting; at least this benchmark's own memory at the fork"
"""Where the peak of a side that crashed comes from (``ru_maxrss`` of ``wait4``, which Linux carries
over from the parent, so a small number here says little)."""


@dataclass(frozen=True)
class LoadBenchSettings:
    """What ``verispec bench load`` measures; every side gets the same values."""

    target: Path
    threads: int
    context: int = 128
    """Tokens in the KV cache before the k appended ones."""
    ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 5
    """Timed forwards per k; the median is reported."""
    quantization: str = "gguf"
    """verispec's ``ModelLoadConfig.quantization`` (llama.cpp always runs the file's own blocks)."""
    sides: tuple[str, ...] = SIDES
    timeout: float = 3600.0
    """Seconds one side may take, load and curve together, before it is killed."""

    def __post_init__(self) -> None:
        from verispec.errors import VerispecError

        if self.context < 1 or self.repeats < 1 or self.threads < 1 or not self.ks or min(self.ks) < 1:
            raise VerispecError("--context, --repeats, --threads and every k in --ks must be >= 1")
        unknown = [side for side in self.sides if side not in SIDES]
        if unknown or not self.sides:
            raise VerispecError(
                f"--sides: expected a comma list of {', '.join(SIDES)}, got {list(self.sides)}"
            )

    def worker_settings(self) -> dict[str, Any]:
        """The JSON a worker process receives (its only input)."""
        return {
            "model_path": str(self.target),
            "threads": self.threads,
            "context": self.context,
            "ks": list(self.ks),
            "repeats": self.repeats,
            "quantization": self.quantization,
        }


@dataclass
class SideResult:
    """One side's measurements; ``status`` is ok, skipped (with ``reason``) or failed (``reason``)."""

    side: str
    status: str
    reason: str | None = None
    load_seconds: float | None = None
    """From the load call to a model ready to run (imports excluded)."""
    first_forward_seconds: float | None = None
    """The first forward, over the ``context`` tokens: the prefill, and for llama.cpp the first read
    of most of the mapped file."""
    peak_rss_mb: float | None = None
    """The process's peak resident memory over its whole life (MiB)."""
    peak_rss_after_load_mb: float | None = None
    """The peak once the model was loaded, before any forward: the load's own cost."""
    rss_before_load_mb: float | None = None
    """After the imports, before the load: what the runtime itself holds."""
    rss_after_load_mb: float | None = None
    """Resident memory just after the load (not the peak: what stays)."""
    logits_finite: bool | None = None
    curve: dict[str, Any] | None = None
    """A :class:`~verispec.bench.forward.CostCurve` as a dict (role = the side)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Side-specific settings and versions (llama.cpp: mmap, which logits rows it computes)."""
    wall_seconds: float | None = None
    """The whole worker process, start to exit."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- measuring, inside a worker process -------------------------------------------------------------


def measure_verispec(settings: dict[str, Any]) -> dict[str, Any]:
    """Load ``settings['model_path']`` with verispec and time it; a :class:`SideResult`'s fields."""
    import torch

    from verispec.bench.forward import measure_curve
    from verispec.config import ModelLoadConfig
    from verispec.models import load_model

    threads = settings["threads"]
    torch.set_num_threads(threads)
    cfg = ModelLoadConfig(quantization=settings["quantization"], threads=threads)
    model, loaded = timed_load(lambda: load_model(settings["model_path"], cfg))

    context = settings["context"]
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.vocab_size, (1, context), generator=generator)  # [1, context]
    cache = model.new_cache()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.forward(prompt, cache, logits_to_keep=1)
    first_forward = time.perf_counter() - started
    finite = bool(torch.isfinite(out.logits).all())
    del cache, out
    with torch.inference_mode():
        curve = measure_curve(model, "verispec", settings["ks"], context, settings["repeats"])
    return {
        **loaded,
        "first_forward_seconds": first_forward,
        "logits_finite": finite,
        "curve": curve.to_dict(),
        "details": {
            "quantization": settings["quantization"],
            "threads": threads,
            "torch_threads": torch.get_num_threads(),
            "model": model.name,
            "model_class": type(model).__name__,
            "gguf_layers": _gguf_layers(model),
        },
    }


def _gguf_layers(model: Any) -> int:
    """Modules that run a GGUF file's blocks: 0 under ``quantization="gguf"`` means the load took
    another path (a de-quantized copy), and the numbers are not the native path's."""
    module = getattr(model, "model", None)
    if module is None or not hasattr(module, "modules"):
        return 0
    return sum(type(m).__name__.startswith("GGUF") for m in module.modules())


def worker_main(argv: Sequence[str]) -> int:
    """``python -m verispec.bench.model_load SETTINGS_JSON RESULT_FILE``: measure, write the result
    (as the llama.cpp side does, :func:`~verispec.bench.model_load_llamacpp.run_worker`)."""
    return run_worker(measure_verispec, argv)


# -- running the sides ------------------------------------------------------------------------------


def llamacpp_missing() -> str | None:
    """Why the llama.cpp side cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    return None


def warm_page_cache(path: Path, chunk: int = 16 << 20) -> float:
    """Read ``path`` once so that both sides find it in the page cache; returns the seconds it took."""
    started = time.perf_counter()
    buffer = bytearray(chunk)
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buffer):
            pass
    return time.perf_counter() - started


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else ""
        hint = " (out of memory?)" if returncode == -signal.SIGKILL else ""
        return f"killed by signal {-returncode} {name}{hint}".replace("  ", " ")
    return f"exited with code {returncode}"


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _wait(pid: int, timeout: float) -> tuple[int, Any, bool]:
    """Wait for child ``pid``, killing it after ``timeout`` s: (wait status, its rusage, timed out).

    ``wait4``, not ``Popen.wait``: it also returns the child's resource usage, so even a side killed
    for memory reports the peak it reached. The child is first waited for without being reaped
    (``WNOWAIT``), so its pid cannot be reused by another process while the timer may still fire.
    """
    lock = threading.Lock()
    state = {"exited": False, "killed": False}

    def kill() -> None:
        with lock:
            if not state["exited"]:
                state["killed"] = True
                os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except BaseException:  # interrupted: the worker must not outlive the benchmark
        kill()
        os.wait4(pid, 0)
        raise
    finally:
        with lock:
            state["exited"] = True
        timer.cancel()
    _, status, usage = os.wait4(pid, 0)
    return status, usage, state["killed"]


def run_side(side: str, settings: LoadBenchSettings, log_dir: Path) -> SideResult:
    """Measure one side in a fresh process; never raises for what happens inside that process."""
    if side == "llama.cpp" and (missing := llamacpp_missing()) is not None:
        return SideResult(side, "skipped", reason=missing)
    if side == "verispec":
        command = [sys.executable, "-m", "verispec.bench.model_load"]
    else:
        command = [sys.executable, str(LLAMACPP_WORKER)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"load-{side.replace('.', '')}.log"
    with tempfile.TemporaryDirectory(prefix="verispec-load-") as tmp:
        result_path = Path(tmp) / "result.json"
        argv = [*command, json.dumps(settings.worker_settings()), str(result_path)]
        started = time.perf_counter()
        with open(log, "w") as log_file:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
            status, usage, timed_out = _wait(proc.pid, settings.timeout)
            proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        child_peak = usage.ru_maxrss / (1 << 20) if sys.platform == "darwin" else usage.ru_maxrss / 1024
        try:
            payload = json.loads(result_path.read_text())
        except (OSError, json.JSONDecodeError):
            payload = None
    if payload is not None and "error" not in payload:
        measured = set(SideResult.__dataclass_fields__) - {"side", "status", "reason", "wall_seconds"}
        fields = {name: payload[name] for name in measured if name in payload}
        return SideResult(side=side, status="ok", wall_seconds=wall, **fields)
    if payload is not None:  # the worker caught an exception and reported it
        peak = payload.get("peak_rss_mb")
        return SideResult(side, "failed", reason=payload["error"], peak_rss_mb=peak, wall_seconds=wall)
    if timed_out:
        reason = f"took longer than {settings.timeout:.0f} s and was killed"
    else:
        reason = _exit_reason(proc.returncode)
    if tail := _tail(log):
        reason += f"; last output ({log}):\n{tail}"
    details = {"peak_rss_source": WAIT4_PEAK}
    return SideResult(
        side, "failed", reason=reason, peak_rss_mb=child_peak, details=details, wall_seconds=wall
    )


def run_load_bench(settings: LoadBenchSettings, log_dir: Path) -> tuple[list[SideResult], float]:
    """Every side of ``settings`` in turn, after warming the page cache; and that warm-up's seconds."""
    warm = warm_page_cache(settings.target)
    return [run_side(side, settings, log_dir) for side in settings.sides], warm


def results_dict(
    settings: LoadBenchSettings, sides: Sequence[SideResult], command: str, page_cache_seconds: float
) -> dict[str, Any]:
    """The JSON ``verispec bench load`` writes: provenance, settings, the target file and each side."""
    from verispec.bench import environment

    return {
        "schema": SCHEMA,
        "command": command,
        "machine": environment.machine(),
        "versions": environment.versions(),
        "git_commit": environment.git_commit(),
        "settings": {
            "target": str(settings.target),
            "target_bytes": settings.target.stat().st_size,
            "threads": settings.threads,
            "context": settings.context,
            "ks": list(settings.ks),
            "repeats": settings.repeats,
            "quantization": settings.quantization,
            "page_cache_warmup_seconds": page_cache_seconds,
        },
        "sides": [side.to_dict() for side in sides],
    }


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def load_table(sides: Sequence[SideResult]) -> str:
    """One row per side: load time, first forward, memory; a skipped or failed side says why."""
    from verispec.bench.report import text_table

    header = ("side", "status", "load s", "1st fwd s", "peak RSS MiB", "after load", "finite")
    rows = []
    for s in sides:
        finite = "-" if s.logits_finite is None else ("yes" if s.logits_finite else "NO")
        rows.append((
            s.side, s.status, _number(s.load_seconds, 2), _number(s.first_forward_seconds, 2),
            _number(s.peak_rss_mb, 0), _number(s.peak_rss_after_load_mb, 0), finite,
        ))  # fmt: skip
    lines = [text_table(rows, header)]
    lines += [f"{s.side} {s.status}: {s.reason}" for s in sides if s.reason]
    for s in sides:
        if s.details.get("quantization") == "gguf" and s.details.get("gguf_layers") == 0:
            lines.append(
                f"note: {s.side} ran no GGUF layers: the load de-quantized the file instead of running "
                "its blocks, so these are not the native path's numbers"
            )
    return "\n".join(lines)


def cost_table(sides: Sequence[SideResult]) -> str | None:
    """The verify-cost curves of the sides that ran, side by side (None when none did)."""
    from verispec.bench.forward import CostCurve, CostPoint, curve_table

    curves = [
        CostCurve(
            role=s.side,
            model=Path(s.curve["model"]).name,
            context=s.curve["context"],
            points=[CostPoint(**p) for p in s.curve["points"]],
        )
        for s in sides
        if s.curve
    ]
    return curve_table(curves) if curves else None


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
