"""``verispec bench`` (speedups on prompt sets) and ``verispec bench forward`` (the verify-cost curve).

The top-level CLI only registers this subcommand (:func:`add_parser`) and calls :func:`run`; every
flag maps onto :class:`~verispec.bench.settings.BenchSettings`, which validates them all before a
model is loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from verispec.bench.datasets import DATASETS
from verispec.bench.settings import BASELINES, PLAIN
from verispec.config import METHODS
from verispec.errors import VerispecError


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(item) for item in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _model_flags(parser: argparse.ArgumentParser, default_target: str) -> None:
    parser.add_argument("--target", default=default_target, help="registry name, HF folder or .gguf file")
    parser.add_argument("--draft", default=None, help="draft model (same vocabulary as the target)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder (created if needed)")


def add_parser(sub: argparse._SubParsersAction, default_target: str) -> None:
    """Register ``bench`` (and its ``forward`` subcommand) on the top-level subparsers."""
    bench = sub.add_parser(
        "bench",
        help="measure speedups on Spec-Bench, MT-bench and HumanEval, side by side with other tools",
        description="Greedy, batch 1, warm-up before timing, wall time including prefill; speedups are "
        "over plain decoding (method none) in the same run. Writes results.json, report.md and PNG plots "
        "to --out.",
    )
    _model_flags(bench, default_target)
    bench.add_argument(
        "--methods", type=_csv, default=[PLAIN, "ngram"], help=f"comma list of {PLAIN}, {', '.join(METHODS)}"
    )
    bench.add_argument(
        "--baselines", type=_csv, default=[], help=f"comma list of {', '.join(BASELINES)} (each optional)"
    )
    bench.add_argument("-k", "--num-speculative-tokens", type=int, default=5, help="draft tokens per step")
    bench.add_argument(
        "--dataset", type=_csv, default=["humaneval"], help=f"comma list of {', '.join(DATASETS)}"
    )
    bench.add_argument(
        "--limit", type=int, default=None, help="first N prompts of each category (default: all)"
    )
    bench.add_argument(
        "--categories", type=_csv, default=None, help="comma list of categories (or dataset/category) to keep"
    )
    bench.add_argument(
        "--data-dir", type=Path, default=None, help="folder with spec_bench/, mt_bench/, humaneval/"
    )
    bench.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per turn")
    bench.add_argument("--warmup", type=int, default=1, help="untimed generations per method before timing")
    bench.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched by method ngram")
    bench.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched by method ngram")
    bench.add_argument(
        "--prompt-lookup-tokens",
        type=int,
        default=10,
        help="draft length of the hf-pld and llamacpp-pld baselines",
    )

    steps = bench.add_subparsers(dest="bench_command", metavar="{forward}")
    forward = steps.add_parser(
        "forward",
        help="time one forward pass appending k tokens to a KV cache (the verify-cost curve)",
        description="Median time of one target (and draft) forward that appends k tokens to a KV cache "
        "of --context tokens. Prints a table and writes forward.json to --out.",
    )
    _model_flags(forward, default_target)
    forward.add_argument("--ks", type=_ints, default=[1, 2, 4, 8, 16], help="comma list of k")
    forward.add_argument("--context", type=int, default=120, help="tokens already in the KV cache")
    forward.add_argument(
        "--repeats", type=int, default=5, help="timed forwards per k (the median is reported)"
    )


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the parsed ``bench`` command; ``argv`` is recorded as the command line that made the results."""
    command = "verispec " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    if getattr(args, "bench_command", None) == "forward":
        return _forward(args, command)
    return _bench(args, command)


def _load_config(args: argparse.Namespace):  # -> ModelLoadConfig
    from verispec.config import ModelLoadConfig

    return ModelLoadConfig(device=args.device, dtype=args.dtype, threads=args.threads)


def _bench(args: argparse.Namespace, command: str) -> int:
    from verispec.bench.harness import run_bench
    from verispec.bench.report import table_rows, text_table, write_outputs
    from verispec.bench.settings import BenchSettings
    from verispec.config import NgramConfig

    settings = BenchSettings(
        target=args.target,
        draft=args.draft,
        methods=tuple(PLAIN if m == "plain" else m for m in args.methods),
        baselines=tuple(args.baselines),
        num_speculative_tokens=args.num_speculative_tokens,
        ngram=NgramConfig(max_ngram=args.ngram_max, min_ngram=args.ngram_min),
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        datasets=tuple(args.dataset),
        categories=tuple(args.categories) if args.categories else None,
        limit_per_category=args.limit,
        data_dir=args.data_dir,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        load=_load_config(args),
    )
    run = run_bench(settings, command)
    plots = []
    if importlib.util.find_spec("matplotlib") is not None:
        from verispec.bench.plots import write_plots

        title = f"{settings.target}, k={settings.num_speculative_tokens}, {', '.join(settings.datasets)}"
        plots = write_plots(run.summaries, args.out, title)
    else:
        print(
            "verispec: matplotlib is not installed, no plots (pip install verispec[bench])", file=sys.stderr
        )
    results, report = write_outputs(run, args.out, plots)
    print(text_table(table_rows(run.summaries)))
    for skipped in run.skipped:
        print(f"skipped {skipped.name}: {skipped.reason}")
    mismatches = sum(1 for r in run.records if r.matches_reference is False)
    if mismatches:
        print(f"LOSSLESS CHECK FAILED for {mismatches} output(s): see {report}")
    print(f"wrote {results}, {report} and {len(plots)} plots", file=sys.stderr)
    return 0


def _forward(args: argparse.Namespace, command: str) -> int:
    from verispec.bench import environment
    from verispec.bench.forward import curve_table, measure_curve
    from verispec.models import load_model

    if args.repeats < 1 or args.context < 1 or not args.ks or min(args.ks) < 1:
        raise VerispecError("--repeats and --context must be >= 1, and every k in --ks >= 1")
    load = _load_config(args)
    models = [("target", args.target)] + ([("draft", args.draft)] if args.draft else [])
    curves = [
        measure_curve(load_model(source, load), role, args.ks, args.context, args.repeats)
        for role, source in models
    ]
    result = {
        "schema": "verispec-bench-forward/1",
        "command": command,
        "machine": environment.machine(),
        "versions": environment.versions(),
        "git_commit": environment.git_commit(),
        "settings": {"ks": args.ks, "context": args.context, "repeats": args.repeats, "device": load.device,
                     "dtype": load.dtype, "threads": load.threads},
        "curves": [curve.to_dict() for curve in curves],
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "forward.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(curve_table(curves))
    print(f"wrote {path}", file=sys.stderr)
    return 0
