"""``verispec serve`` as a child process on loopback, for the serving benchmarks.

The server runs in its own process, as in production: its engine thread, event loop and memory are
its own, and the load generator's Python work does not share its GIL. The price is that the child
must never outlive the benchmark, so :class:`ServerProcess` kills it on every exit path: the
``with`` block's end, an exception, Ctrl-C, SIGTERM to the benchmark (turned into an exception so
that ``finally`` runs) and, on Linux, even SIGKILL to the benchmark (``PR_SET_PDEATHSIG`` makes the
kernel send the child SIGTERM when its parent dies).

Its output goes to a log file, not a pipe: a pipe nobody reads fills up and blocks the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from verispec.bench.datasets import DATASETS
from verispec.config import MAX_SPECULATIVE_TOKENS
from verispec.errors import VerispecError

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ServerRun:
    """What both ``bench serve`` and ``bench soak`` need: the server to start and the prompts to send."""

    target: str
    draft: str | None = None
    method: str | None = None
    """The server's ``--method`` (one of :data:`~verispec.bench.settings.SERVE_METHODS`); None means
    ``draft`` with a draft model, else ``ngram``."""
    num_speculative_tokens: int = 5
    dataset: str = "spec_bench"
    categories: tuple[str, ...] | None = None
    seed: int = 0
    data_dir: Path | None = None
    threads: int | None = None
    quantization: str = "auto"
    max_batch_size: int | None = None
    """The server's ``--max-batch-size``; None means every user decodes at once."""
    server_args: tuple[str, ...] = ()
    """More ``verispec serve`` flags, passed to every server started."""
    startup_timeout: float = 900.0

    @property
    def speculative_method(self) -> str:
        return self.method or ("draft" if self.draft else "ngram")

    def validate_server(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise VerispecError(f"-k must be between 1 and {MAX_SPECULATIVE_TOKENS}")
        if self.speculative_method == "draft" and not self.draft:
            raise VerispecError("--method draft needs --draft")
        if self.dataset not in DATASETS:
            raise VerispecError(f"--dataset: choose one of {', '.join(DATASETS)}")

    def server_flags(self, method: str, depth_policy: str, users: int) -> list[str]:
        """``verispec serve`` flags for one configuration serving at most ``users`` concurrent users
        (host and port are added by the process); ``method="none"`` is plain decoding, which loads no
        draft model (so ``draft`` is left out) and has no depth. Logs at warning level: an access line
        per request is work the server would do only because it is being measured."""
        args = ["--target", self.target, "--quantization", self.quantization, "--log-level", "warning"]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        max_batch_size = self.max_batch_size or users
        max_waiting = max(64, users)  # never more requests in flight than users
        args += ["--max-batch-size", str(max_batch_size), "--max-waiting", str(max_waiting)]
        if method == "none":
            args += ["--method", "none"]
        else:
            if self.draft:
                args += ["--draft", self.draft]
            k = str(self.num_speculative_tokens)
            args += ["--method", method, "-k", k, "--depth-policy", depth_policy]
        return args + list(self.server_args)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["data_dir"] = str(self.data_dir) if self.data_dir else None
        out["method"] = self.speculative_method
        return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; another process could take it later,
    which the health check then reports as a server that did not start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve_command(args: Sequence[str], host: str, port: int) -> list[str]:
    """The argv that starts ``verispec serve`` with ``args`` on ``host:port``, with this interpreter."""
    return [sys.executable, "-m", "verispec.cli", "serve", *args, "--host", host, "--port", str(port)]


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` from ``/proc/PID/status`` (VmRSS), or None where that is unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel for SIGTERM when the parent dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwind like Ctrl-C (which the CLI reports as an interruption), stopping the
    server on the way out."""


class ServerProcess:
    """A ``verispec serve`` child: started by ``with``, healthy when the block runs, killed after it."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 900.0,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.command = serve_command(args, self.host, self.port)
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self.models: object = None
        """What the server's ``GET /v1/models`` answered, where a caller asked (its speculation setup)."""
        self._old_sigterm: object = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server is not running"
        return self.process.pid

    def __enter__(self) -> ServerProcess:
        self._catch_sigterm()
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            self._restore_sigterm()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # Its own session: a Ctrl-C in the terminal reaches only the benchmark, which then
                # stops the server in order instead of both racing to exit.
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )

    def wait_healthy(self) -> None:
        """Poll ``/health`` until it answers 200; a dead child or a timeout is an error with its log."""
        start = time.perf_counter()
        deadline = start + self.startup_timeout
        with httpx.Client(base_url=self.base_url, timeout=5.0, trust_env=False) as client:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise VerispecError(
                        f"verispec serve exited with status {self.process.returncode} before it was "
                        f"healthy; its log ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health").status_code == 200:
                        self.startup_seconds = time.perf_counter() - start
                        return
                if time.perf_counter() > deadline:
                    raise VerispecError(
                        f"verispec serve was not healthy after {self.startup_timeout:.0f} s; its log "
                        f"({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                time.sleep(0.25)

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM (uvicorn shuts down in order), then SIGKILL after ``grace`` seconds; the exit status."""
        process = self.process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            return process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            return process.wait()
        except KeyboardInterrupt:  # a second Ctrl-C while waiting: do not wait any more
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()
            raise

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rss_bytes(self) -> int | None:
        return rss_bytes(self.pid) if self.alive() else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _catch_sigterm(self) -> None:
        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            raise Terminated("terminated by SIGTERM")

        with contextlib.suppress(ValueError):  # signals can only be set from the main thread
            self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._old_sigterm)  # type: ignore[arg-type]
            self._old_sigterm = None


class RssSampler:
    """Samples a process's resident memory every ``interval`` seconds on the event loop.

    ``samples`` holds ``(seconds since start, bytes)``; reading ``/proc`` takes microseconds, so
    sampling does not disturb what it measures.
    """

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._start = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> int | None:
        """Take one sample now (also usable without the background task)."""
        value = rss_bytes(self.pid)
        if value is not None:
            self.samples.append((round(time.perf_counter() - self._start, 3), value))
        return value

    @property
    def peak(self) -> int | None:
        return max((b for _, b in self.samples), default=None)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)
