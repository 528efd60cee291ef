"""``verispec bench`` (speedups on prompt sets), ``bench forward`` (the verify-cost curve), ``plan``,
``bench serve`` (the server under concurrent users, per depth policy) and ``bench soak`` (the server
under many requests with hang-ups: nothing lost, no memory growth).

The top-level CLI only registers this subcommand (:func:`add_parser`) and calls :func:`run`; every
flag maps onto :class:`~verispec.bench.settings.BenchSettings`, which validates them all before a
model is loaded. ``plan`` (:func:`add_plan_parser`, :func:`run_plan`) reads the files the other two
write and loads no model; it is both ``verispec bench plan`` and ``verispec plan``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verispec.bench.datasets import DATASETS
from verispec.bench.settings import BASELINES, PLAIN
from verispec.cli import add_load_flags, load_config
from verispec.config import METHODS
from verispec.errors import VerispecError
from verispec.models.quant import QUANTIZATIONS


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
        "--depth-policy",
        choices=["fixed", "adaptive"],
        default="fixed",
        help="fixed (default): k drafts (trees: all their nodes) every step; adaptive: the policy chooses",
    )
    bench.add_argument(
        "--heads",
        default=None,
        metavar="PATH",
        help="heads for medusa/eagle methods (from `verispec train`; default: the target's shipped heads)",
    )
    bench.add_argument("--tree-nodes", type=int, default=None, help="medusa/eagle: tree nodes per step")
    bench.add_argument("--tree-width", type=int, default=None, help="medusa/eagle: candidates per level")
    bench.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE|object",
        help="JSON mode: every answer constrained to this JSON schema file ('object': any JSON object), "
        "each user turn asking for it (chat datasets; baselines are skipped)",
    )
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

    steps = bench.add_subparsers(dest="bench_command", metavar="{forward,load,plan,quality,serve,soak}")
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
        help="what verispec's weights cost: against float32 (default) or against llama.cpp on the same GGUF",
        description="--reference float32 (default): teacher-forced comparison of the quantized and the "
        "float32 model: agreement of their greedy next tokens over HumanEval prompts with their reference "
        "solutions, and perplexity on a held-out text (a Python standard-library module's source). "
        "--reference llamacpp: llama.cpp (llama-cpp-python) writes greedy replies from the GGUF the "
        "target comes from, and both it and verispec's model teacher-force them over the same token ids: "
        "the share of reply positions where verispec's top token is llama.cpp's, and both perplexities "
        "of the replies. Writes quality.json to --out.",
    )
    quality.add_argument("--target", default=default_target, help="registry name, HF folder or .gguf file")
    quality.add_argument(
        "--reference",
        default="float32",
        choices=["float32", "llamacpp"],
        help="what verispec's model is compared with: the same weights in float32, or llama.cpp "
        "running the target's GGUF (needs verispec[llamacpp])",
    )
    quality.add_argument(
        "--quantization",
        default="int8",
        choices=list(QUANTIZATIONS),
        help="verispec's weights under test (as --quantization of `verispec serve`)",
    )
    quality.add_argument(
        "--limit",
        type=int,
        default=None,
        help="float32: HumanEval prompts (default 20); llamacpp: prompts per dataset, spread over its "
        "categories (default 10)",
    )
    quality.add_argument(
        "--dataset",
        type=_csv,
        default=None,
        help=f"llamacpp only: comma list of {', '.join(DATASETS)} (default humaneval,spec_bench; a chat "
        "prompt's first turn is sent through the chat template)",
    )
    quality.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="llamacpp only: tokens of each llama.cpp reply (default 96)",
    )
    quality.add_argument("--threads", type=int, default=None)
    quality.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="folder holding humaneval/ (and spec_bench/) (default ../shared/data)",
    )
    quality.add_argument(
        "--out", type=Path, default=Path("results"), help="output folder (created if needed)"
    )
    _add_serve_parser(steps, default_target)
    _add_soak_parser(steps, default_target)
    _add_load_parser(steps)


def _served_bench_flags(parser: argparse.ArgumentParser, default_target: str, out: str) -> None:
    """Flags shared by ``bench serve`` and ``bench soak``: the server's models and the prompts."""
    parser.add_argument("--target", default=default_target, help="registry name, HF folder or .gguf file")
    parser.add_argument("--draft", default=None, help="draft model (same vocabulary as the target)")
    parser.add_argument(
        "-k", "--num-speculative-tokens", type=int, default=5, help="most draft tokens per step"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="the server's CPU threads (default: PyTorch's)"
    )
    parser.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS))
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="the server's --max-batch-size (default: the most users)",
    )
    parser.add_argument(
        "--dataset",
        default="spec_bench",
        choices=DATASETS,
        help="prompt set (a chat prompt's first turn is sent)",
    )
    parser.add_argument("--categories", type=_csv, default=None, help="comma list of categories to keep")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt order")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="folder with spec_bench/, mt_bench/, humaneval/"
    )
    parser.add_argument(
        "--server-args",
        type=shlex.split,
        default=[],
        help="more `verispec serve` flags, one quoted string: --server-args='--draft-p-min 0.2'",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for the server's /health"
    )
    parser.add_argument("--out", type=Path, default=Path(out), help="output folder (created if needed)")


def _add_load_parser(sub: argparse._SubParsersAction) -> None:
    load = sub.add_parser(
        "load",
        help="peak memory, load time and the verify-cost curve of a GGUF, through verispec and llama.cpp",
        description="Each side (verispec; llama.cpp where llama-cpp-python is installed) runs in a fresh "
        "process of its own, one after the other, with the same threads: peak RSS of that process, load "
        "time, the first forward over --context tokens, and the median time of one forward appending k "
        "tokens to a --context-token cache. The file is read once first, so neither side's load time "
        "includes the disk. Prints a table and writes load.json (and each side's log) to --out.",
    )
    load.add_argument("--target", type=Path, default=None, help=".gguf file to load")
    load.add_argument(
        "--build-llama-8b",
        type=Path,
        default=None,
        metavar="PATH",
        help="first write a random-weight GGUF with Llama-3.1-8B's shapes in Q4_K_M's type mix to PATH "
        "(4.9 GB; skipped if PATH exists), and use it as --target",
    )
    load.add_argument(
        "--sides", type=_csv, default=["verispec", "llama.cpp"], help="comma list of verispec, llama.cpp"
    )
    load.add_argument(
        "--quantization",
        default="gguf",
        choices=list(QUANTIZATIONS),
        help="verispec's weights (default gguf: the file's own blocks)",
    )
    load.add_argument(
        "--threads", type=int, default=None, help="CPU threads of both sides (default: all cores)"
    )
    load.add_argument("--ks", type=_ints, default=[1, 2, 4, 8, 16], help="comma list of k")
    load.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    load.add_argument("--repeats", type=int, default=5, help="timed forwards per k (the median is reported)")
    load.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds one side may take before it is killed"
    )
    load.add_argument(
        "--out", type=Path, default=Path("results/load"), help="output folder (created if needed)"
    )


def _add_serve_parser(sub: argparse._SubParsersAction, default_target: str) -> None:
    serve = sub.add_parser(
        "serve",
        help="throughput, TTFT and per-user tok/s of `verispec serve` under 1..N users, per depth policy",
        description="For each policy, start `verispec serve` in a separate process on a free loopback port "
        "(plain = --method none; fixed and adaptive = --depth-policy with -k), warm it up, and send "
        "--requests-per-level streaming greedy requests from each number of concurrent users in "
        "--concurrency. Writes results.json, report.md, PNG plots and the servers' logs to --out.",
    )
    _served_bench_flags(serve, default_target, "results/serve")
    serve.add_argument("--method", default=None, choices=["ngram", "draft"], help="default: draft if --draft")
    serve.add_argument(
        "--policies",
        type=_csv,
        default=["plain", "fixed", "adaptive"],
        help="comma list of plain, fixed, adaptive",
    )
    serve.add_argument(
        "--concurrency", type=_ints, default=[1, 2, 4, 8, 16], help="comma list of user counts"
    )
    serve.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="requests sent at each level (default: max(12, 2 x users))",
    )
    serve.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    serve.add_argument(
        "--repeats", type=int, default=1, help="runs of every level (their spread is the noise)"
    )
    serve.add_argument("--warmup", type=int, default=4, help="untimed requests per server before the levels")
    serve.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds a request may wait for its next chunk"
    )


def _add_soak_parser(sub: argparse._SubParsersAction, default_target: str) -> None:
    soak = sub.add_parser(
        "soak",
        help="many requests, some clients hanging up: nothing lost, server idle and no RSS growth after",
        description="Start `verispec serve`, send --requests streaming requests from --concurrency users, "
        "a random --disconnect-fraction of which close the connection after a few chunks; check that every "
        "other request finished, the server is healthy and idle, and its RSS did not grow after the warm-up. "
        "Writes soak.json to --out; exits 1 if a check fails.",
    )
    _served_bench_flags(soak, default_target, "results/soak")
    soak.add_argument(
        "--method", default=None, choices=["ngram", "draft", "none"], help="default: draft if --draft"
    )
    soak.add_argument("--depth-policy", default="adaptive", choices=["adaptive", "fixed"])
    soak.add_argument("--requests", type=int, default=400, help="requests after the warm-up")
    soak.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    soak.add_argument("--concurrency", type=int, default=8, help="concurrent users")
    soak.add_argument("--disconnect-fraction", type=float, default=0.25, help="share of clients that hang up")
    soak.add_argument(
        "--warmup", type=int, default=None, help="requests before the RSS baseline (default 2 per user)"
    )
    soak.add_argument(
        "--rss-tolerance-pct", type=float, default=10.0, help="RSS growth allowed, in %% (as below)"
    )
    soak.add_argument(
        "--rss-tolerance-mb",
        type=float,
        default=100.0,
        help="RSS growth allowed, in MB; the larger one applies, and the soak's second half may grow by half",
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
    if getattr(args, "bench_command", None) == "serve":
        return _serve(args, command)
    if getattr(args, "bench_command", None) == "soak":
        return _soak(args, command)
    if getattr(args, "bench_command", None) == "load":
        return _load(args, command)
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
    if args.reference == "llamacpp":
        return _quality_llamacpp(args, command)
    llamacpp_flags = {"--dataset": args.dataset, "--max-new-tokens": args.max_new_tokens}
    given = [flag for flag, value in llamacpp_flags.items() if value is not None]
    if given:  # refused rather than ignored: the float32 comparison has no replies to choose
        raise VerispecError(f"{' and '.join(given)} go with --reference llamacpp only")
    from verispec.bench.quality import measure_quality

    report = measure_quality(
        args.target,
        args.quantization,
        limit=20 if args.limit is None else args.limit,
        threads=args.threads,
        data_dir=args.data_dir,
    )
    _write_quality(args.out, {"command": command, "reference": "float32", **report.to_dict()})
    print(report.summary())
    return 0


def _quality_llamacpp(args: argparse.Namespace, command: str) -> int:
    from verispec.bench import quality_llamacpp as q

    report = q.measure_against_llamacpp(
        args.target,
        args.quantization,
        datasets=args.dataset or q.DEFAULT_DATASETS,
        limit=10 if args.limit is None else args.limit,
        max_new_tokens=q.DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens,
        threads=args.threads,
        data_dir=args.data_dir,
    )
    _write_quality(args.out, {"command": command, **report.to_dict()})
    print(report.summary())
    return 0


def _write_quality(out: Path, report: dict[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=1) + "\n")


def _need_http_client() -> None:
    """``bench serve`` and ``bench soak`` talk to the server with httpx: say so before anything starts."""
    if importlib.util.find_spec("httpx") is None:
        raise VerispecError("bench serve and bench soak need httpx: pip install httpx (or verispec[all])")


def _serve(args: argparse.Namespace, command: str) -> int:
    _need_http_client()
    from verispec.bench.report import text_table
    from verispec.bench.serve import ServeBenchSettings, results_dict, run_serve_bench, write_results
    from verispec.bench.serve_report import HEADER, report_markdown, table_rows, write_plots

    settings = ServeBenchSettings(
        **_server_run(args),
        policies=tuple(args.policies),
        concurrency=tuple(args.concurrency),
        requests_per_level=args.requests_per_level,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        request_timeout=args.request_timeout,
    )
    run = run_serve_bench(settings, command, args.out)
    summaries = run.summaries
    plots = []
    if importlib.util.find_spec("matplotlib") is not None:
        title = f"{settings.target}, {settings.speculative_method}, k={settings.num_speculative_tokens}"
        plots = write_plots(summaries, args.out, title)
    else:
        print(
            "verispec: matplotlib is not installed, no plots (pip install verispec[bench])", file=sys.stderr
        )
    results = write_results(run, args.out)
    report = args.out / "report.md"
    report.write_text(report_markdown(results_dict(run), summaries, plots))
    print(text_table(table_rows(summaries), HEADER))
    failed = sum(level.failed for level in run.levels)
    if failed:
        print(f"{failed} request(s) failed: see {results}")
    print(f"wrote {results}, {report} and {len(plots)} plots", file=sys.stderr)
    return 1 if failed else 0


def _server_run(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~verispec.bench.server_proc.ServerRun` fields shared by ``bench serve`` and ``soak``."""
    return {
        "target": args.target,
        "draft": args.draft,
        "method": args.method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "dataset": args.dataset,
        "categories": tuple(args.categories) if args.categories else None,
        "seed": args.seed,
        "data_dir": args.data_dir,
        "threads": args.threads,
        "quantization": args.quantization,
        "max_batch_size": args.max_batch_size,
        "server_args": tuple(args.server_args),
        "startup_timeout": args.startup_timeout,
    }


def _soak(args: argparse.Namespace, command: str) -> int:
    _need_http_client()
    from verispec.bench.soak import SoakSettings, run_soak, summary

    settings = SoakSettings(
        **_server_run(args),
        depth_policy=args.depth_policy,
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        disconnect_fraction=args.disconnect_fraction,
        warmup=args.warmup,
        rss_tolerance_pct=args.rss_tolerance_pct,
        rss_tolerance_mb=args.rss_tolerance_mb,
    )
    result = run_soak(settings, command, args.out)
    print(summary(result))
    print(f"wrote {args.out / 'soak.json'}", file=sys.stderr)
    return 0 if result["passed"] else 1


def _read_json(path: Path, made_by: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise VerispecError(f"{path} not found; write it with `{made_by} --out FOLDER`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise VerispecError(f"cannot read {path}: {exc}") from None


def _json_schema(arg: str | None) -> dict[str, Any] | None:
    """``--json-schema``: a schema file's object, or any object for ``object``."""
    if arg is None:
        return None
    if arg == "object":
        return {"type": "object"}
    try:
        schema = json.loads(Path(arg).read_text())
    except (OSError, ValueError) as exc:
        raise VerispecError(f"--json-schema {arg}: not a readable JSON file ({exc})") from exc
    if not isinstance(schema, dict):
        raise VerispecError(f"--json-schema {arg}: the file must hold a JSON object (a schema)")
    return schema


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
        depth=args.depth_policy,
        ngram=NgramConfig(max_ngram=args.ngram_max, min_ngram=args.ngram_min),
        heads=args.heads,
        tree_nodes=args.tree_nodes,
        tree_width=args.tree_width,
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        datasets=tuple(args.dataset),
        categories=tuple(args.categories) if args.categories else None,
        limit_per_category=args.limit,
        seed=args.seed,
        data_dir=args.data_dir,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        json_schema=_json_schema(args.json_schema),
        load=load_config(args),
    )
    run = run_bench(settings, command, out_dir=args.out, resume=args.resume)
    plots = []
    if importlib.util.find_spec("matplotlib") is not None:
        from verispec.bench.plots import write_plots

        k = f"k={settings.num_speculative_tokens} ({settings.depth})"
        title = f"{settings.target}, {k}, {', '.join(settings.datasets)}"
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


def _load(args: argparse.Namespace, command: str) -> int:
    from verispec.bench import model_load as m
    from verispec.bench import synthetic_gguf

    target = args.target or args.build_llama_8b
    if target is None:
        raise VerispecError("bench load needs --target FILE.gguf or --build-llama-8b PATH")
    if args.build_llama_8b is not None:
        if args.target is not None and args.target.resolve() != args.build_llama_8b.resolve():
            raise VerispecError(
                "--build-llama-8b writes the target: leave out --target or give the same path"
            )
        if not args.build_llama_8b.exists():
            size = synthetic_gguf.file_size(synthetic_gguf.LLAMA_3_1_8B) / 1e9
            print(f"writing {args.build_llama_8b} ({size:.1f} GB, random weights) ...", file=sys.stderr)
            synthetic_gguf.write_llama_gguf(args.build_llama_8b, shape=synthetic_gguf.LLAMA_3_1_8B)
    if not target.is_file():
        raise VerispecError(f"{target} is not a file")
    settings = m.LoadBenchSettings(
        target=target.resolve(),
        threads=args.threads or os.cpu_count() or 1,
        context=args.context,
        ks=tuple(args.ks),
        repeats=args.repeats,
        quantization=args.quantization,
        sides=tuple(args.sides),
        timeout=args.timeout,
    )
    sides, warm = m.run_load_bench(settings, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "load.json"
    path.write_text(json.dumps(m.results_dict(settings, sides, command, warm), indent=1) + "\n")
    print(f"{settings.target.name}, {settings.threads} threads, k tokens appended to {settings.context}")
    print(m.load_table(sides))
    costs = m.cost_table(sides)
    if costs is not None:
        print()
        print(costs)
    print(f"wrote {path}", file=sys.stderr)
    return 0 if all(side.status != "failed" for side in sides) else 1


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
