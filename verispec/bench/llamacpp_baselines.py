"""llama.cpp (through llama-cpp-python) as a baseline: plain greedy, and its prompt-lookup draft.

It runs the GGUF file the target was converted from, as shipped (4-bit kernels), so it measures the
tool a CPU user would most likely pick instead. llama-cpp-python is an optional extra (it builds
from source in minutes): it is looked for only when asked for, and its absence is a
:class:`Skipped` note in the report, never an error.

Each baseline runs in a process of its own (:mod:`verispec.bench.llamacpp_worker`): a build that
crashes (a native llama-cpp-python build has segfaulted in its AMX backend) then fails the prompt it
crashed on, with the signal and the last lines llama.cpp wrote, and the next prompt starts a fresh process;
one that can't even load is skipped with that reason. Every generation starts from an empty KV cache.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import IO, Any

import torch

from verispec.bench.contenders import Contender, Skipped
from verispec.bench.records import Turn
from verispec.bench.settings import BenchSettings
from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM

LLAMACPP_BASELINES = ("llamacpp", "llamacpp-pld")
LLAMACPP_MISSING = "llama-cpp-python not installed (pip install verispec[llamacpp])"
MAX_CONTEXT = 8192
"""llama.cpp preallocates its KV cache for the whole context: enough for any benchmark prompt + answer."""
PLD_MAX_CONTEXT = 4096
"""Prompt lookup keeps all logits (4096 x 152k floats = 2.5 GB for Qwen); longer prompts fail."""
WORKER = Path(__file__).with_name("llamacpp_worker.py")


class LlamaCppWorker:
    """One llama.cpp process: started with the ``Llama`` settings, asked for one generation at a time."""

    def __init__(self, settings: dict[str, Any], command: list[str] | None = None) -> None:
        self.settings = settings
        self.command = command or [sys.executable, str(WORKER)]
        self.proc: subprocess.Popen[str] | None = None
        self.log: IO[str] | None = None
        self.ready: dict[str, int] = {}
        self._ended: weakref.finalize | None = None
        """Ends ``proc`` once: on :meth:`stop`, or when this worker is garbage-collected."""

    def start(self) -> None:
        """Start the process and load the model; a :class:`VerispecError` says why it failed."""
        # The process's standard error, read back when it dies; it lives as long as the process.
        self.log = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self._ended = weakref.finalize(self, _stop, self.proc)
        try:
            reply = self._ask(self.settings)
        except VerispecError as exc:  # it died while loading
            reply = {"error": str(exc)}
        if "error" in reply:
            self.stop()
            raise VerispecError(f"llama.cpp could not load {self.settings['model_path']}: {reply['error']}")
        self.ready = reply["ready"]

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int]
    ) -> tuple[list[int], float]:
        """Greedy tokens and their seconds; a crash ends this process (the next call starts another)."""
        if self.proc is None:
            self.start()
        reply = self._ask(
            {"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, "eos_ids": sorted(eos_ids)}
        )
        if "error" in reply:
            raise VerispecError(f"llama.cpp failed on this prompt: {reply['error']}")
        return [int(t) for t in reply["tokens"]], float(reply["seconds"])

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if line:
            return json.loads(line)
        raise VerispecError(self._died())

    def _died(self) -> str:
        """What ended the process, with the last lines it wrote, and forget it."""
        assert self.proc is not None and self.log is not None
        code = self.proc.wait()
        how = f"exit status {code}"
        if code < 0:
            how = f"signal {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
        self.log.seek(0)
        tail = " | ".join(self.log.read().strip().splitlines()[-3:])
        self.stop()
        return f"llama.cpp's process died ({how})" + (f": {tail}" if tail else "")

    def stop(self) -> None:
        if self._ended is not None:
            self._ended()  # a finalizer runs once, so a restarted worker leaves none behind
            self._ended = None
        self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


def _stop(proc: subprocess.Popen[str]) -> None:
    """End a worker: closing its input ends its loop; kill it if it does not go."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):  # a dead process's pipe can't take the buffered rest
                stream.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LlamaCppContender:
    """Greedy decoding in a :class:`LlamaCppWorker`, stopping at the target's EOS ids or the length limit."""

    def __init__(
        self,
        name: str,
        worker: LlamaCppWorker,
        eos_ids: frozenset[int],
        references: tuple[str, ...],
        description: dict,
    ) -> None:
        self.name = name
        self.worker = worker
        self.eos_ids = eos_ids
        self.references = references
        self.description: dict[str, object] = description

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Turn:
        n_ctx = self.worker.settings["n_ctx"]
        if len(prompt_ids) + max_new_tokens > n_ctx:
            # A failed record, not a crash: llama-cpp-python overruns its logits buffer past n_ctx.
            raise VerispecError(
                f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed llama.cpp's context of "
                f"{n_ctx} set for this benchmark"
            )
        tokens, seconds = self.worker.generate(prompt_ids, max_new_tokens, self.eos_ids)
        return Turn(prompt_tokens=len(prompt_ids), token_ids=tokens, seconds=seconds)


def gguf_source(target: str) -> Path | None:
    """The GGUF file behind ``target`` (a bundled name, a .gguf path or a folder verispec converted)."""
    from verispec.models.cache import SOURCE_FILE
    from verispec.models.registry import BUNDLED, ensure_gguf, get_bundled

    if target in BUNDLED:
        return ensure_gguf(get_bundled(target))
    path = Path(target).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    source = path / SOURCE_FILE
    if source.is_file():
        origin = json.loads(source.read_text())
        if "bundled" in origin:
            return ensure_gguf(get_bundled(origin["bundled"]))
        if "gguf" in origin and Path(origin["gguf"]).is_file():
            return Path(origin["gguf"])
    return None


def llamacpp_contender(name: str, settings: BenchSettings, target: HFCausalLM) -> Contender | Skipped:
    """The llama.cpp baseline ``name`` (one of :data:`LLAMACPP_BASELINES`), or why it can't run."""
    if name not in LLAMACPP_BASELINES:
        raise ValueError(f"not a llama.cpp baseline: {name}")
    if importlib.util.find_spec("llama_cpp") is None:
        return Skipped(name, LLAMACPP_MISSING)
    try:
        gguf = gguf_source(settings.target)
    except VerispecError as exc:  # a bundled model whose weight packages are gone, a bad checksum
        return Skipped(name, f"no GGUF file for {settings.target}: {exc}")
    if gguf is None:
        return Skipped(name, f"no GGUF file for {settings.target} (llama.cpp needs one; pass a .gguf target)")

    pld = name == "llamacpp-pld"
    description: dict[str, object] = {"backend": "llama.cpp", "gguf": str(gguf), "greedy": True}
    if pld:
        description["num_pred_tokens"] = settings.prompt_lookup_tokens
    threads = torch.get_num_threads()  # the same threads as the PyTorch contenders
    # With a draft model llama-cpp-python keeps logits for every position, in a buffer of n_batch
    # rows: a prompt longer than n_batch overruns it, so the whole context must fit one batch there
    # (which costs context x vocabulary floats: a smaller context for that mode).
    n_ctx = min(target.max_context, PLD_MAX_CONTEXT if pld else MAX_CONTEXT)
    worker = LlamaCppWorker(
        {
            "model_path": str(gguf),
            "n_ctx": n_ctx,
            "n_batch": n_ctx if pld else 512,
            "n_threads": threads,
            "num_pred_tokens": settings.prompt_lookup_tokens if pld else None,
        }
    )
    try:
        worker.start()
    except VerispecError as exc:
        return Skipped(name, str(exc))
    description.update(threads=threads, version=importlib.metadata.version("llama-cpp-python"))
    # llama.cpp's arithmetic differs from the fp32 model's, so only its own modes are compared.
    references = ("llamacpp",) if pld else ()
    eos = frozenset(target.eos_token_ids | {worker.ready["eos"]})
    return LlamaCppContender(name, worker, eos, references, description)
