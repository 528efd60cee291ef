"""``verispec bench`` (speedups on prompt sets), ``bench forward`` (the verify-cost curve) and ``plan``.

The top-level CLI only registers this subcommand (:func:`add_parser`) and calls :func:`run`; every
flag maps onto :class:`~verispec.bench.settings.BenchSettings`, which validates them all before a
model is loaded. ``plan`` (:func:`add_plan_parser`, :func:`run_plan`) reads the files the other two
write and loads no model; it is both ``verispec bench plan`` and ``verispec plan``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from verispec.bench.datasets import DATASETS
from verispec.bench.settings import BASELINES, PLAIN
from verispec.cli import add_load_flags, load_config
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
    add_load_flags(parser)
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
        "--seed", type=int, default=None, help="sample prompts in a seeded random order (default: file order)"
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
    bench.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run: keep the records in --out/records.jsonl (same settings) "
        "and measure only the rest",
    )

    steps = bench.add_subparsers(dest="bench_command", metavar="{forward,plan}")
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
    add_plan_parser(steps)
    quality = steps.add_parser(
        "quality",
        help="what int8 costs against float32: greedy agreement and perplexity change",
        description="Teacher-forced comparison of the quantized and the float32 model: agreement of their "
        "greedy next tokens over HumanEval prompts with their reference solutions, and perplexity on a "
        "held-out text (a Python standard-library module's source). Writes quality.json to --out.",
    )
    quality.add_argument("--target", default=default_target, help="registry name, HF folder or .gguf file")
    quality.add_argument("--quantization", default="int8", choices=["int8"])
    quality.add_argument("--limit", type=int, default=20, help="HumanEval prompts")
    quality.add_argument("--threads", type=int, default=None)
    quality.add_argument(
        "--data-dir", type=Path, default=None, help="folder holding humaneval/ (default ../shared/data)"
    )
    quality.add_argument(
        "--out", type=Path, default=Path("results"), help="output folder (created if needed)"
    )


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` on ``sub`` (bench's subcommands, or the top-level ones)."""
    plan = sub.add_parser(
        "plan",
        help="expected tokens/s of each method and k, from a cost curve and measured acceptance",
        description="Combine the verify-cost curve (forward.json from `verispec bench forward`) with the "
        "acceptance measured by `verispec bench` (results.json) or an assumed one (--acceptance), print "
        "expected tau, step time and tokens/s per method and k, the best choice and why, and check the "
        "prediction against the measured run.",
    )
    plan.add_argument(
        "--forward", type=Path, default=Path("results/forward.json"), help="forward.json (the cost curve)"
    )
    plan.add_argument(
        "--results", type=Path, default=None, help="results.json: measured acceptance and the run to check"
    )
    plan.add_argument(
        "--acceptance", type=float, default=None, help="assume this per-token acceptance (0..1) instead"
    )
    plan.add_argument(
        "--group", default="overall", help="overall or a dataset/category of results.json (acceptance source)"
    )
    plan.add_argument("--max-k", type=int, default=16, help="plan k = 1..this")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the parsed ``bench`` command; ``argv`` is recorded as the command line that made the results."""
    command = "verispec " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    if getattr(args, "bench_command", None) == "forward":
        return _forward(args, command)
    if getattr(args, "bench_command", None) == "plan":
        return run_plan(args)
    if getattr(args, "bench_command", None) == "quality":
        return _quality(args, command)
    return _bench(args, command)


def run_plan(args: argparse.Namespace) -> int:
    """Print (or ``--json``) the plan; see :mod:`verispec.bench.plan` for the model."""
    from verispec.bench import plan as p
    from verispec.config import MAX_SPECULATIVE_TOKENS

    if not 1 <= args.max_k <= MAX_SPECULATIVE_TOKENS:
        raise VerispecError(f"--max-k must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {args.max_k}")
    forward = _read_json(args.forward, "verispec bench forward")
    results = _read_json(args.results, "verispec bench") if args.results else None
    target, draft = p.curves_from_forward(forward)
    draft_ms = draft.ms(1) if draft is not None else None
    methods, notes = p.methods_from_results(results, args.group, draft_ms, args.acceptance)
    plan = p.make_plan(methods, target, range(1, args.max_k + 1))
    explanation = p.explain(plan, target, methods)
    pairs = p.check(methods, target, p.measured_from_results(results, args.group)) if results else []
    warnings = p.provenance_warnings(forward, results)
    if args.json:
        print(json.dumps(p.plan_dict(plan, methods, explanation, pairs, notes, warnings), indent=1))
        return 0
    context = forward.get("settings", {}).get("context")
    print(f"cost curve: {target.model or 'target'}, {context} tokens in the KV cache ({args.forward})")
    if draft is not None:
        print(f"draft: {draft.model}, {draft_ms:.1f} ms per token")
    source = f"{args.results}, group {args.group}" if results else "none"
    print(
        "acceptance: " + (f"assumed {args.acceptance} per token" if args.acceptance is not None else source)
    )
    for line in warnings:
        print(f"warning: {line}")
    print()
    print(p.plan_table(plan))
    for line in notes:
        print(f"note: {line}")
    print()
    print(f"best: {p.choice(plan)}")
    print(textwrap.fill(explanation, width=100, break_on_hyphens=False))
    if pairs:
        print()
        print(f"prediction vs the measured run ({args.results}, group {args.group}):")
        print(p.check_table(pairs))
        print(
            textwrap.fill(
                "Measured tok/s include what the model leaves out: prefill, per-step overhead (sampling, "
                "detokenizing, Python) and a KV cache longer or shorter than the curve's; meas/pred shows "
                "how much that weighs.",
                width=100,
                break_on_hyphens=False,
            )
        )
    return 0


def _quality(args: argparse.Namespace, command: str) -> int:
    from verispec.bench.quality import measure_quality

    report = measure_quality(
        args.target, args.quantization, limit=args.limit, threads=args.threads, data_dir=args.data_dir
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(
        json.dumps({"command": command, **report.to_dict()}, indent=1) + "\n"
    )
    print(report.summary())
    return 0


def _read_json(path: Path, made_by: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise VerispecError(f"{path} not found; write it with `{made_by} --out FOLDER`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise VerispecError(f"cannot read {path}: {exc}") from None


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
        seed=args.seed,
        data_dir=args.data_dir,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        load=load_config(args),
    )
    run = run_bench(settings, command, out_dir=args.out, resume=args.resume)
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
    for failed in run.failed:
        print(f"FAILED {failed.method} on {failed.dataset} {failed.prompt_id}: {failed.error}")
    if run.resumed:
        print(f"resumed: {run.resumed} generation(s) came from {args.out / 'records.jsonl'}", file=sys.stderr)
    print(f"wrote {results}, {report} and {len(plots)} plots", file=sys.stderr)
    return 0


def _forward(args: argparse.Namespace, command: str) -> int:
    from verispec.bench import environment
    from verispec.bench.forward import curve_table, measure_curve
    from verispec.models import load_model

    if args.repeats < 1 or args.context < 1 or not args.ks or min(args.ks) < 1:
        raise VerispecError("--repeats and --context must be >= 1, and every k in --ks >= 1")
    load = load_config(args)
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
                     "dtype": load.dtype, "threads": load.threads, "quantization": load.quantization},
        "curves": [curve.to_dict() for curve in curves],
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "forward.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(curve_table(curves))
    print(f"wrote {path}", file=sys.stderr)
    return 0
