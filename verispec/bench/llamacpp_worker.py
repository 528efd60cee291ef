"""llama.cpp in a process of its own, so that a crash fails one benchmark record, not the whole run.

A llama-cpp-python wheel built for another CPU dies with SIGILL, and a bug in its C++ code with
SIGSEGV; in the benchmark's own process either would end a run of many contenders with nothing
written. :mod:`verispec.bench.llamacpp_baselines` starts this file as a script (it imports only the
standard library and ``llama_cpp``: no torch, no verispec) and talks to it in JSON lines:

- first line in: the ``llama_cpp.Llama`` settings (``model_path``, ``n_ctx``, ``n_batch``,
  ``n_threads``, ``num_pred_tokens`` for prompt lookup or null, and optionally ``logits_all``);
  reply ``{"ready": {"n_ctx": ..., "eos": ...}}`` or ``{"error": "..."}``;
- then per generation: ``{"prompt_ids": [...], "max_new_tokens": N, "eos_ids": [...]}``; reply
  ``{"tokens": [...], "seconds": S}`` (wall time of the generation alone, measured here so the pipe
  costs nothing) or ``{"error": "..."}`` for a prompt llama.cpp refuses;
- ``{"kind": "tokenize", "text": "...", "add_special": bool}``: llama.cpp's own token ids of the
  text (special tokens in it parsed as such), reply ``{"ids": [...]}``, so a caller can check that
  both tokenizers agree;
- ``{"kind": "score", "prompt_ids": [...], "reply_ids": [...]}``: the reply teacher-forced after
  the prompt, reply ``{"nll": [...], "top": [...]}``, llama.cpp's negative log-likelihood of each
  reply token and its own most likely token at that position (needs ``logits_all`` in the
  settings, which sizes llama.cpp's logits array for the whole context).

End of input ends the process. The protocol owns the real standard output; anything llama.cpp's C
code prints goes to standard error instead. Besides the standard library it imports numpy, which
llama-cpp-python itself depends on.
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
    logits_all = bool(settings.get("logits_all"))
    llm = llama_cpp.Llama(
        model_path=settings["model_path"],
        n_ctx=settings["n_ctx"],
        n_batch=settings["n_batch"],
        n_threads=settings["n_threads"],
        n_threads_batch=settings["n_threads"],
        draft_model=draft,
        logits_all=logits_all,
        verbose=False,
    )
    if logits_all and hasattr(llm, "_logits_all"):
        # ``logits_all`` at construction sizes ``scores`` for the whole context, which scoring
        # needs; computing every position's logits is only worth it for the rows scored, so it
        # stays off (and generation stays as fast as without it) until :func:`score` asks.
        llm._logits_all = False
    return llm


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


def tokenize(llm: Any, text: str, add_special: bool) -> list[int]:
    """llama.cpp's token ids of ``text``: special tokens written in it (a chat template's) are parsed,
    ``add_special`` adds the ones the GGUF says a sequence starts with (a BOS, for some models)."""
    return [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)]


def score(llm: Any, prompt_ids: list[int], reply_ids: list[int]) -> tuple[list[float], list[int]]:
    """Each reply token's negative log-likelihood under llama.cpp, and llama.cpp's top token there.

    Teacher-forced from an empty KV cache: the prompt but its last token is evaluated without
    logits, then the last prompt token and the reply but its last token in one pass with logits for
    every row, whose row i predicts reply token i. The log-softmax is taken in float64 here, so the
    caller gets the same arithmetic whatever llama.cpp's own precision.
    """
    import numpy as np

    if not prompt_ids or not reply_ids:
        raise ValueError("scoring needs a prompt and a reply of at least one token each")
    vocab = int(llm.n_vocab())
    outside = [t for t in (*prompt_ids, *reply_ids) if not 0 <= t < vocab]
    if outside:  # checked here: llama.cpp's C code would read past its embedding table
        raise ValueError(f"token ids outside llama.cpp's vocabulary of {vocab}: {outside[:5]}")
    span = [prompt_ids[-1], *reply_ids[:-1]]
    llm.reset()
    if len(prompt_ids) > 1:
        llm.eval(prompt_ids[:-1])
    toggled = hasattr(llm, "_logits_all")
    if toggled:
        llm._logits_all = True
    try:
        llm.eval(span)
    finally:
        if toggled:
            llm._logits_all = False
    start = len(prompt_ids) - 1
    logits = np.asarray(llm.scores[start : start + len(span)], dtype=np.float64)
    top = logits.max(axis=1)
    log_total = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    nll = log_total - logits[np.arange(len(reply_ids)), reply_ids]
    return [float(x) for x in nll], [int(t) for t in logits.argmax(axis=1)]


def answer(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The reply to one request after loading (see the module docstring for the kinds)."""
    kind = request.get("kind", "generate")
    if kind == "tokenize":
        return {"ids": tokenize(llm, request["text"], bool(request["add_special"]))}
    if kind == "score":
        nll, top = score(llm, request["prompt_ids"], request["reply_ids"])
        return {"nll": nll, "top": top}
    if kind != "generate":
        raise ValueError(f"unknown request kind {kind!r}")
    tokens, seconds = generate(llm, request["prompt_ids"], request["max_new_tokens"], set(request["eos_ids"]))
    return {"tokens": tokens, "seconds": seconds}


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
        try:
            message = answer(llm, json.loads(line))
        except KeyError as exc:  # a request without a field its kind needs
            message = {"error": f"the request has no {exc}"}
        except (RuntimeError, ValueError) as exc:
            message = {"error": str(exc)}
        _reply(out, message)
    return 0


def main() -> int:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # C-level prints can't corrupt the protocol
    return serve(sys.stdin, protocol)


if __name__ == "__main__":
    sys.exit(main())
