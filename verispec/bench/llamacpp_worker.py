"""llama.cpp in a process of its own, so that a crash fails one benchmark record, not the whole run.

A llama-cpp-python wheel built for another CPU dies with SIGILL, and a bug in its C++ code with
SIGSEGV; in the benchmark's own process either would end a run of many contenders with nothing
written. :mod:`verispec.bench.llamacpp_baselines` starts this file as a script (it imports only the
standard library and ``llama_cpp``: no torch, no verispec) and talks to it in JSON lines:

- first line in: the ``llama_cpp.Llama`` settings (``model_path``, ``n_ctx``, ``n_batch``,
  ``n_threads``, ``num_pred_tokens`` for prompt lookup or null); reply ``{"ready": {"n_ctx": ...,
  "eos": ...}}`` or ``{"error": "..."}``;
- then per generation: ``{"prompt_ids": [...], "max_new_tokens": N, "eos_ids": [...]}``; reply
  ``{"tokens": [...], "seconds": S}`` (wall time of the generation alone, measured here so the pipe
  costs nothing) or ``{"error": "..."}`` for a prompt llama.cpp refuses.

End of input ends the process. The protocol owns the real standard output; anything llama.cpp's C
code prints goes to standard error instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO


def load(settings: dict[str, Any]) -> Any:
    """The ``llama_cpp.Llama`` the settings describe (with prompt lookup as its draft model if asked)."""
    import llama_cpp

    draft = None
    if settings.get("num_pred_tokens"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=settings["num_pred_tokens"])
    return llama_cpp.Llama(
        model_path=settings["model_path"],
        n_ctx=settings["n_ctx"],
        n_batch=settings["n_batch"],
        n_threads=settings["n_threads"],
        n_threads_batch=settings["n_threads"],
        draft_model=draft,
        verbose=False,
    )


def generate(
    llm: Any, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]
) -> tuple[list[int], float]:
    """Greedy tokens after ``prompt_ids`` from an empty KV cache, and the seconds they took.

    ``reset()`` first: llama-cpp-python otherwise reuses the longest common prefix of the previous
    call, which would skip most of a second turn's prefill and make its numbers incomparable with
    the other contenders'.
    """
    tokens: list[int] = []
    started = time.perf_counter()
    llm.reset()
    stream = llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    try:
        for token in stream:
            tokens.append(int(token))
            if token in eos_ids or len(tokens) >= max_new_tokens:
                break
    finally:
        stream.close()
    return tokens, time.perf_counter() - started


def _reply(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(requests: TextIO, out: TextIO) -> int:
    """Load from the first line of ``requests``, then answer each further line until it ends."""
    try:
        llm = load(json.loads(requests.readline()))
    except Exception as exc:  # any failure to load is reported, then the process ends
        _reply(out, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _reply(out, {"ready": {"n_ctx": int(llm.n_ctx()), "eos": int(llm.token_eos())}})
    for line in requests:
        request = json.loads(line)
        try:
            tokens, seconds = generate(
                llm, request["prompt_ids"], request["max_new_tokens"], set(request["eos_ids"])
            )
        except (RuntimeError, ValueError) as exc:
            _reply(out, {"error": str(exc)})
            continue
        _reply(out, {"tokens": tokens, "seconds": seconds})
    return 0


def main() -> int:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # C-level prints can't corrupt the protocol
    return serve(sys.stdin, protocol)


if __name__ == "__main__":
    sys.exit(main())
