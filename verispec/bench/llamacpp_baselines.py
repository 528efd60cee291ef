"""llama.cpp (through llama-cpp-python) as a baseline: plain greedy, and its prompt-lookup draft.

It runs the GGUF file the target was converted from, as shipped (4-bit kernels), so it measures the
tool a CPU user would most likely pick instead. llama-cpp-python is an optional extra (it builds
from source in minutes): it is imported only here, only when asked for, and its absence is a
:class:`Skipped` note in the report, never an error.

Each generation starts from an empty KV cache (``reset()``): llama-cpp-python otherwise reuses the
longest common prefix of the previous call, which would skip most of a second turn's prefill and
make its numbers incomparable with the other contenders'.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

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


class LlamaCppContender:
    """Greedy decoding with a ``llama_cpp.Llama``, stopping at the target's EOS ids or the length limit."""

    def __init__(
        self, name: str, llm: Any, eos_ids: frozenset[int], references: tuple[str, ...], description: dict
    ) -> None:
        self.name = name
        self.llm = llm
        self.eos_ids = eos_ids
        self.references = references
        self.description: dict[str, object] = description

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Turn:
        if len(prompt_ids) + max_new_tokens > self.llm.n_ctx():
            # A failed record, not a crash: llama-cpp-python overruns its logits buffer past n_ctx.
            raise VerispecError(
                f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed llama.cpp's context of "
                f"{self.llm.n_ctx()} set for this benchmark"
            )
        tokens: list[int] = []
        started = time.perf_counter()
        self.llm.reset()  # full prefill every time, as for every other contender
        stream = self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        try:
            for token in stream:
                tokens.append(int(token))
                if token in self.eos_ids or len(tokens) >= max_new_tokens:
                    break
        except (RuntimeError, ValueError) as exc:
            raise VerispecError(f"llama.cpp failed on this prompt: {exc}") from exc
        finally:
            stream.close()
        seconds = time.perf_counter() - started
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

    import llama_cpp

    draft_model = None
    description: dict[str, object] = {"backend": "llama.cpp", "gguf": str(gguf), "greedy": True}
    if name == "llamacpp-pld":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft_model = LlamaPromptLookupDecoding(num_pred_tokens=settings.prompt_lookup_tokens)
        description["num_pred_tokens"] = settings.prompt_lookup_tokens
    threads = torch.get_num_threads()  # the same threads as the PyTorch contenders
    # With a draft model llama-cpp-python keeps logits for every position, in a buffer of n_batch
    # rows: a prompt longer than n_batch overruns it, so the whole context must fit one batch there
    # (which costs context x vocabulary floats: a smaller context for that mode).
    n_ctx = min(target.max_context, MAX_CONTEXT if draft_model is None else PLD_MAX_CONTEXT)
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_batch=n_ctx if draft_model is not None else 512,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft_model,
        verbose=False,
    )
    description.update(threads=threads, version=getattr(llama_cpp, "__version__", None))
    # llama.cpp's arithmetic differs from the fp32 model's, so only its own modes are compared.
    references = ("llamacpp",) if name == "llamacpp-pld" else ()
    eos = frozenset(target.eos_token_ids | {int(llm.token_eos())})
    return LlamaCppContender(name, llm, eos, references, description)
