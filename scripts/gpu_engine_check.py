"""verispec's own engine on a GPU: exactness and speed of every proposer, on random weights of real shapes.

Why random weights: the GPU machine lent to this project reaches no registry and takes 64 MB of
files, so no real checkpoint goes there (see ``gpu_forward_curve.py``). What random weights can
show is still what matters first on a new device: that the engine runs there at all (every tensor
where it belongs), that greedy speculative output equals greedy plain output token for token
(the batch-invariance the CPU paths were built for, now under CUDA's kernels), and what a step
costs. Acceptance rates on random weights say nothing about real text, so the draft model is the
target itself (every draft accepted: the engine's cost at full acceptance) and EAGLE/Medusa use
the heads shipped for the 1.5B (trained on the real model: they draft badly here, which exercises
rejection and tree rollback).

Checks, each recorded in ``gpu_engine.json`` (a failure is recorded with its traceback and the
next check runs):

- ``invariance``: logits of 8 positions decoded one at a time vs verified in one forward, from the
  same cache (max |difference|, argmax agreement);
- ``curve``: ms of one engine forward appending k tokens to a 512-token cache, k = 1..16;
- ``generate``: each method over the same prompts, greedy: tokens equal to plain, tokens/s, mean
  accepted length; then sampled (temperature 0.8) and a batch of 8 sequences.

Runs under the GPU machine's own python3 with the repository on the path:
``PYTHONPATH=. python3 scripts/gpu_engine_check.py --out $OUT``; ``--device cpu --shape tiny``
checks it here.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_forward_curve import SHAPES, build

from verispec.config import SpecConfig
from verispec.engine import SpecEngine
from verispec.heads.io import load_heads, shipped_heads
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.hybrid import HybridProposer
from verispec.proposers.medusa import MedusaProposer
from verispec.proposers.ngram import NgramProposer

HEADS_FOR = "qwen2.5-coder-1.5b-instruct"


def log(*parts: object) -> None:
    print(*parts, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def target_model(shape: str, device: str, dtype: torch.dtype) -> HFCausalLM:
    model = build(shape, device, dtype)
    model.config.eos_token_id = None  # random weights: run every generation to its length
    if model.generation_config is not None:
        model.generation_config.eos_token_id = None
    return HFCausalLM(model, name=shape)


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """Random token prompts with a repeated stretch in each, so prompt lookup finds something."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        out.append(ids + ids[length // 2 : length // 2 + 16])
    return out


def invariance(target: HFCausalLM, prompt: list[int]) -> dict[str, Any]:
    """The same 8 positions scored one token a forward and all in one forward."""
    base = target.new_cache()
    target.forward_batch([base], [prompt], logits_to_keep=[1])
    follow = prompt[:8]
    alone_cache = base.clone()
    alone = torch.cat(
        [target.forward_batch([alone_cache], [[t]], logits_to_keep=[1]).logits[0] for t in follow]
    )
    together = target.forward_batch([base.clone()], [follow], logits_to_keep=[len(follow)]).logits[0]
    diff = (alone - together).abs()
    return {
        "positions": len(follow),
        "max_abs_diff": float(diff.max()),
        "logit_scale": float(alone.abs().max()),
        "argmax_agree": int((alone.argmax(-1) == together.argmax(-1)).sum()),
    }


def curve(target: HFCausalLM, context: int, ks: list[int], repeats: int) -> dict[str, float]:
    """Median ms of one forward appending k tokens to a ``context``-token cache."""
    gen = torch.Generator().manual_seed(1)
    base = target.new_cache()
    target.forward_batch(
        [base], [torch.randint(0, 1000, (context,), generator=gen).tolist()], logits_to_keep=[1]
    )
    out = {}
    for k in ks:
        times = []
        for r in range(repeats + 2):
            cache = base.clone()
            sync(target.device)
            start = time.perf_counter()
            target.forward_batch([cache], [list(range(10, 10 + k))], logits_to_keep=[k])
            sync(target.device)
            if r >= 2:
                times.append((time.perf_counter() - start) * 1e3)
        out[str(k)] = sorted(times)[len(times) // 2]
        log(f"  k={k}: {out[str(k)]:.2f} ms")
    return out


def engine_for(target: HFCausalLM, method: str | None, k: int, depth: str) -> SpecEngine:
    spec = SpecConfig(method=method, num_speculative_tokens=k, depth=depth)  # type: ignore[arg-type]
    if method is None:
        return SpecEngine(target, None, spec)
    if method == "draft":
        draft = HFCausalLM(target.model, name=target.name + "-as-draft")  # every draft accepted
        return SpecEngine(target, build_proposer(spec, target, draft), spec, draft=draft)
    if method in ("eagle", "medusa", "eagle+ngram"):
        kind = method.split("+")[0]
        folder = shipped_heads(HEADS_FOR, kind)
        assert folder is not None, f"no shipped {kind} heads"
        loaded = load_heads(folder, None, kind=kind)  # trained for the real 1.5B: no identity check
        cls = EagleProposer if kind == "eagle" else MedusaProposer
        heads = cls.from_loaded(loaded, target, spec)
        proposer = HybridProposer(heads, NgramProposer(spec)) if "+" in method else heads
        return SpecEngine(target, proposer, spec)
    return SpecEngine(target, build_proposer(spec, target, None), spec)


def run_method(
    target: HFCausalLM,
    method: str | None,
    k: int,
    depth: str,
    batch: list[list[int]],
    max_new: int,
    **kw: Any,
) -> dict[str, Any]:
    engine = engine_for(target, method, k, depth)
    engine.generate(batch[0], max_new_tokens=4, **kw)  # warm-up (and the adaptive policy's cost probe)
    sync(target.device)
    outs = []
    start = time.perf_counter()
    for p in batch:
        outs.append(engine.generate(p, max_new_tokens=max_new, **kw))
    sync(target.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in outs)
    steps = sum(g.stats.num_steps for g in outs)
    drafted = sum(g.stats.num_drafted for g in outs)
    accepted = sum(g.stats.num_accepted for g in outs)
    return {
        "method": method or "none",
        "k": k,
        "depth": depth,
        "tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "steps": steps,
        "tokens_per_step": tokens / max(steps, 1),
        "drafted": drafted,
        "accepted": accepted,
        "outputs": [g.token_ids for g in outs],
    }


def guarded(results: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    log(f"== {key}")
    try:
        value = fn()
    except Exception as exc:  # recorded, and the next check runs
        results[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        log(results[key]["traceback"])
        return None
    results[key] = value
    return value


def check_dtype(args: argparse.Namespace, dtype_name: str) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    results: dict[str, Any] = {}
    target = target_model(args.shape, args.device, dtype)
    batch = prompts(target.vocab_size, args.prompts, args.prompt_length, seed=0)
    guarded(results, "invariance", lambda: invariance(target, batch[0]))
    log(json.dumps(results.get("invariance")))
    guarded(results, "curve", lambda: curve(target, args.context, [1, 2, 4, 8, 16], args.repeats))
    runs = [
        (None, 1, "fixed"),
        ("ngram", 8, "fixed"),
        ("ngram", 8, "adaptive"),
        ("draft", 5, "fixed"),
        ("eagle", 5, "fixed"),
        ("medusa", 5, "fixed"),
        ("eagle+ngram", 8, "adaptive"),
    ]
    plain: list[list[int]] | None = None
    for method, k, depth in runs:
        if args.shape != HEADS_FOR and method in ("eagle", "medusa", "eagle+ngram"):
            continue
        key = f"greedy/{method or 'none'}/k{k}/{depth}"
        res = guarded(
            results, key, lambda m=method, k=k, d=depth: run_method(target, m, k, d, batch, args.max_new)
        )
        if res is None:
            continue
        if method is None:
            plain = res["outputs"]
        elif plain is not None:
            res["equal_to_plain"] = sum(a == b for a, b in zip(res["outputs"], plain, strict=True))
            res["first_divergence"] = [
                next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                for a, b in zip(res["outputs"], plain, strict=True)
            ]
        log({k2: v for k2, v in res.items() if k2 != "outputs"})
    for method in ("ngram", "draft"):
        key = f"sampled/{method}"
        res = guarded(
            results,
            key,
            lambda m=method: run_method(
                target, m, 5, "fixed", batch[:2], args.max_new, temperature=0.8, seed=3
            ),
        )
        if res is not None:
            log({k2: v for k2, v in res.items() if k2 != "outputs"})

    def batched() -> dict[str, Any]:
        engine = engine_for(target, "ngram", 8, "fixed")
        many = prompts(target.vocab_size, 8, args.prompt_length, seed=5)
        start = time.perf_counter()
        spec = engine.generate_batch(many, max_new_tokens=args.max_new)
        sync(target.device)
        seconds = time.perf_counter() - start
        plain_engine = engine_for(target, None, 1, "fixed")
        ref = plain_engine.generate_batch(many, max_new_tokens=args.max_new)
        return {
            "sequences": len(many),
            "tok_per_s": sum(len(g.token_ids) for g in spec) / seconds,
            "equal_to_plain": sum(a.token_ids == b.token_ids for a, b in zip(spec, ref, strict=True)),
        }

    guarded(results, "batch8/ngram", batched)
    log(json.dumps(results.get("batch8/ngram")))
    for value in results.values():
        if isinstance(value, dict):
            value.pop("outputs", None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default=HEADS_FOR, choices=sorted(SHAPES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)  # an engine step's failure logs its traceback
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "shape": args.shape,
        "argv": sys.argv,
    }
    log(env)
    report: dict[str, Any] = {"environment": env}
    for name in args.dtypes.split(","):
        log(f"#### {name}")
        report[name] = check_dtype(args, name)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        (args.out / "gpu_engine.json").write_text(json.dumps(report, indent=1))
    summary = {
        dtype: {key: {k: v for k, v in val.items() if k != "traceback"} for key, val in res.items()}
        for dtype, res in report.items()
        if dtype != "environment"
    }
    log(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
