"""Verify-cost curves on a GPU, from random-weight models of the real shapes.

Why random weights: the GPU machine lent to this project reaches no registry and takes 64 MB of
files, so the real checkpoints cannot go there; a forward pass costs the same whatever the weights
hold, so a model of the same shape gives the same curve.

What it measures, per model, batch size B and k: the time of one forward that appends k tokens to
each of B sequences whose KV cache already holds ``--context`` tokens, in two modes:

- ``eager``: transformers' plain forward with a DynamicCache (rolled back with ``crop``), which on a
  GPU is bound by kernel launches for models this small;
- ``graphs``: the same forward over a StaticCache, captured once per shape as a CUDA graph and
  replayed, which is what a serving engine does (vLLM captures decode graphs) and what shows the
  memory-bound cost.

It writes ``gpu_curves.json`` (every point) and, per target/draft pair, a ``forward_<pair>.json`` in
the format of ``verispec bench forward`` (B=1, graphs mode), so that ``verispec plan --forward`` can
combine it with acceptance measured on the CPU and say what speculation would gain on this GPU.

Runs under the GPU machine's own python3 (PyTorch + transformers, no verispec install needed):
``python3 scripts/gpu_forward_curve.py --out $OUT``. ``--device cpu --models tiny`` checks it here.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config, StaticCache

# Shapes from the models' config.json (Qwen2.5-Coder family; vocab 151936 for <= 3B, 152064 above).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-0.5b-instruct": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                        tie_word_embeddings=True),
    "qwen2.5-coder-1.5b-instruct": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                        tie_word_embeddings=False),
    "qwen2.5-coder-7b-instruct": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                      num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                      tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
}  # fmt: skip
PAIRS = {  # target -> draft, each written as a forward_<target>.json
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-7b-instruct": "qwen2.5-coder-0.5b-instruct",
    "tiny": "tiny",
}


def build(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    config = Qwen2Config(**SHAPES[name], rope_theta=1e6, max_position_embeddings=32768)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def timed(fn: Callable[[], Any], device: str, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


@torch.inference_mode()
def eager_curve(model: torch.nn.Module, batch: int, ks: list[int], context: int, device: str,
                repeats: int) -> dict[int, list[float]]:  # fmt: skip
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    prompt = torch.randint(0, vocab, (batch, context), device=device)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = {}
    for k in ks:
        ids = torch.randint(0, vocab, (batch, k), device=device)

        def step(ids: torch.Tensor = ids, k: int = k) -> None:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.crop(-k)  # negative: drop the last k (both the 5.x APIs accept it)

        out[k] = timed(step, device, warmup=3, repeats=repeats)
    return out


def replayed(forward: Callable[[], Any], device: str, repeats: int) -> list[float]:
    """Times of CUDA-graph replays of ``forward`` (captured after two warm-up calls on a side
    stream); on a CPU, plain calls, so that the code path can be checked without a GPU."""
    if device != "cuda":
        return timed(forward, device, warmup=3, repeats=repeats)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return timed(graph.replay, device, warmup=3, repeats=repeats)


@torch.inference_mode()
def static_curve(model: torch.nn.Module, batch: int, ks: list[int], context: int, device: str,
                 repeats: int) -> dict[int, list[float]]:  # fmt: skip
    """Forwards over a StaticCache holding ``context`` tokens, as CUDA graphs.

    Recent transformers keep each layer's write position in a tensor (``cumulative_length``) and
    ignore ``cache_position``, so each forward ends by setting it back to ``context``: every replay
    then writes the same slots over the same cache. The reset is timed alone and subtracted.
    """
    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=context + max(ks))
    prompt = torch.randint(0, vocab, (batch, context), device=device)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
          cache_position=torch.arange(context, device=device))  # fmt: skip
    lengths = [t for t in (getattr(layer, "cumulative_length", None) for layer in cache.layers)
               if isinstance(t, torch.Tensor)]  # fmt: skip
    out = {}
    for k in ks:
        ids = torch.randint(0, vocab, (batch, k), device=device)
        position = torch.arange(context, context + k, device=device)

        def forward(ids: torch.Tensor = ids, position: torch.Tensor = position) -> None:
            model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=position)
            reset()

        def reset() -> None:
            for length in lengths:
                length.fill_(context)

        total = replayed(forward, device, repeats)
        resetting = statistics.median(replayed(reset, device, repeats)) if lengths else 0.0
        if int(cache.get_seq_length()) != context:
            raise RuntimeError(f"the static cache holds {int(cache.get_seq_length())} tokens, not {context}")
        out[k] = [t - resetting for t in total]
    return out


@torch.inference_mode()
def nocache_curve(model: torch.nn.Module, batch: int, ks: list[int], repeats: int, device: str
                  ) -> dict[int, list[float]]:  # fmt: skip
    """k-token forwards with no KV cache, as CUDA graphs: the weight-read floor (no context read)."""
    vocab = model.config.vocab_size
    out = {}
    for k in ks:
        ids = torch.randint(0, vocab, (batch, k), device=device)
        out[k] = replayed(lambda ids=ids: model(input_ids=ids, use_cache=False), device, repeats)
    return out


def forward_json(target: dict[str, Any], draft: dict[str, Any], context: int, command: str,
                 machine: dict[str, Any], mode: str) -> dict[str, Any]:  # fmt: skip
    """B=1 curves of one mode in `verispec bench forward`'s format (schema verispec-bench-forward/1)."""

    def curve(role: str, entry: dict[str, Any]) -> dict[str, Any]:
        points = [
            {"k": int(k), "median_ms": statistics.median(ms), "ms": ms} for k, ms in entry[mode]["1"].items()
        ]
        return {"role": role, "model": entry["model"], "context": context, "points": points}

    return {
        "schema": "verispec-bench-forward/1",
        "command": command,
        "machine": machine,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "git_commit": None,
        "settings": {
            "context": context,
            "device": "cuda",
            "dtype": "bfloat16",
            "mode": mode,
            "weights": "random",
        },
        "curves": [curve("target", target), curve("draft", draft)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default=",".join(name for name in SHAPES if name != "tiny"))
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--ks", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="eager,graphs_nocache,graphs", help="eager, graphs_nocache, graphs")
    p.add_argument("--tag", default="", help="suffix of the output files")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ks = [int(x) for x in args.ks.split(",")]
    modes = args.modes.split(",")
    batches = [int(x) for x in args.batches.split(",")]
    torch.manual_seed(0)
    machine = {"python": platform.python_version(), "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        machine |= {"gpu": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                    "multiprocessors": props.multi_processor_count}  # fmt: skip
    results: dict[str, Any] = {"machine": machine, "context": args.context, "models": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        t0 = time.perf_counter()
        model = build(name, device, dtype)
        params = sum(p.numel() for p in model.parameters())
        entry: dict[str, Any] = {"model": name, "parameters": params} | {mode: {} for mode in modes}
        for batch in batches:
            for mode in modes:
                try:
                    if mode == "eager":
                        curve = eager_curve(model, batch, ks, args.context, device, args.repeats)
                    elif mode == "graphs":
                        curve = static_curve(model, batch, ks, args.context, device, args.repeats)
                    else:
                        curve = nocache_curve(model, batch, ks, args.repeats, device)
                except Exception as exc:  # a mode that fails is reported; the others still run
                    entry.setdefault("errors", {})[mode] = f"{type(exc).__name__}: {exc}"
                    print(f"{name} B={batch} {mode} failed: {exc}", flush=True)
                    continue
                entry[mode][str(batch)] = curve
                row = " ".join(f"k={k}:{statistics.median(ms):7.2f}" for k, ms in curve.items())
                print(f"{name} B={batch:<3} {mode:14} ms {row}", flush=True)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        results["models"][name] = entry
        (args.out / f"gpu_curves{args.tag}.json").write_text(json.dumps(results) + "\n")
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    command = shlex.join(
        ["python3", "scripts/gpu_forward_curve.py", *(sys.argv[1:] if argv is None else argv)]
    )
    for target, draft in PAIRS.items():
        models = results["models"]
        if target in models and draft in models:
            for mode in modes:
                if models[target].get(mode, {}).get("1") and models[draft].get(mode, {}).get("1"):
                    doc = forward_json(models[target], models[draft], args.context, command, machine, mode)
                    (args.out / f"forward_{target}_{mode}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
