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
        tokens: list[int] = []
        started = time.perf_counter()
        self.llm.reset()  # full prefill every time, as for every other contender
        stream = self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        for token in stream:
            tokens.append(int(token))
            if token in self.eos_ids or len(tokens) >= max_new_tokens:
                break
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
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=min(target.max_context, MAX_CONTEXT),
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
