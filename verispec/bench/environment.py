"""Where a measurement was taken: machine, library versions, git commit.

Tokens per second mean nothing without the machine and the code that produced them, so every
results file carries these. Everything here is best effort: a missing value is None, never a crash.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def machine(*, busy: bool = False) -> dict[str, object]:
    """CPU model, core count, RAM, the threads PyTorch uses and how busy the machine is right now;
    ``busy`` adds other processes' CPU use over the next second (:func:`cpu_busy`), which the timed
    runs' reports warn by."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    reading = {"cpu_busy": cpu_busy()} if busy else {}
    return {
        "cpu": _cpu_model(),
        "isa": vector_isa(_cpuinfo_field("flags") or ""),
        "cores": os.cpu_count(),
        "ram_gb": _ram_gb(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "gpu": gpu,
        "load_average": load_average(),
        **reading,
    }


def describe_busy(machine: dict[str, object]) -> str:
    """``; other processes' CPU use in the second before the run: 3%`` where it was measured."""
    busy = machine.get("cpu_busy")
    if not isinstance(busy, float):
        return ""
    return f"; other processes' CPU use in the second before the run: {busy:.0%}"


def describe_cpu(machine: dict[str, object]) -> str:
    """``AMD EPYC (avx2), 2 cores``: the processor as reports print it."""
    isa = machine.get("isa") or "vector ISA unknown"
    return f"{machine.get('cpu')} ({isa}), {machine.get('cores')} cores"


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: other work on a shared machine slows every contender unevenly."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def cpu_busy(window: float = 1.0) -> float | None:
    """The share of the machine's CPU time spent outside idle over the next ``window`` seconds,
    while this process sleeps: how much other work runs now. The 1-minute load average lags by a
    minute, so right after another benchmark it reports a machine that has since gone quiet; this
    is the reading the reports' warning goes by. None where ``/proc/stat`` cannot be read."""

    def ticks() -> tuple[int, int] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
        return sum(fields[:8]), idle  # guest time is already counted in user time

    before = ticks()
    time.sleep(window)
    after = ticks()
    if before is None or after is None or after[0] <= before[0]:
        return None
    total, idle = after[0] - before[0], after[1] - before[1]
    return round(1.0 - idle / total, 3)


def versions() -> dict[str, str | None]:
    """Versions of Python and of every library that can change the numbers."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "verispec", "llama-cpp-python"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """``git rev-parse HEAD`` of the repository, or None (not a checkout, no commit yet, no git)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` line's value in /proc/cpuinfo (None: no such line or file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str | None:
    return _cpuinfo_field("model name") or platform.processor() or None


def vector_isa(flags: str) -> str | None:
    """The widest vector extension of the CPU flags ``flags`` that verispec's kernels use: the same
    "AMD EPYC" name covers machines with and without AVX-512, and the int8 and int4 paths run at
    about half the speed without it, so a report that omits it cannot be compared with another."""
    have = set(flags.split())
    if {"avx512f", "avx512_vnni", "amx_tile", "amx_int8"} <= have:
        return "avx512-vnni+amx"  # the int4 and int8 paths then verify on AMX tiles
    if {"avx512f", "avx512_vnni"} <= have:
        return "avx512-vnni"
    if "avx512f" in have:
        return "avx512"
    if "avx2" in have:
        return "avx2"
    return None


def _ram_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None
