"""``verispec bench`` (speedups on prompt sets), ``bench forward`` (the verify-cost curve), ``plan``,
``bench serve`` (the server under concurrent users, per depth policy) and ``bench soak`` (the server
under many requests with hang-ups: nothing lost, no memory growth).

The top-level CLI registers this subcommand (:mod:`verispec.bench.flags` holds the flags) and
calls :func:`run`; every flag maps onto :class:`~verispec.bench.settings.BenchSettings`, which
validates them all before a model is loaded. ``plan`` (:func:`run_plan`) reads the files the other
two write and loads no model; it is both ``verispec bench plan`` and ``verispec plan``.
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
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from verispec.bench.flags import add_parser, add_plan_parser  # re-exported: the CLI registers them
from verispec.bench.settings import PLAIN, BenchSettings
from verispec.config import NgramConfig
from verispec.errors import VerispecError
from verispec.settings import from_args, load_config

__all__ = ["add_parser", "add_plan_parser", "run", "run_plan"]

S = TypeVar("S")


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the parsed ``bench`` command; ``argv`` is recorded as the command line that made the results."""
    command = "verispec " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    subcommand = getattr(args, "bench_command", None)
    if subcommand == "plan":
        return run_plan(args)
    runs = {"forward": _forward, "quality": _quality, "serve": _serve, "soak": _soak, "load": _load}
    runs["suffix-cost"] = _suffix_cost
    return runs.get(subcommand, _bench)(args, command)


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
    if args.api_key:  # the command goes into results.json and report.md; the key must not
        command = command.replace(args.api_key, "***")
    from verispec.bench.report import text_table
    from verispec.bench.serve import ServeBenchSettings, results_dict, run_serve_bench, write_results
    from verispec.bench.serve_report import HEADER, report_markdown, table_rows, turn_table, write_plots

    settings = _from_flags(
        ServeBenchSettings,
        args,
        **_server_run(args),
        policies=tuple(args.policies),
        concurrency=tuple(args.concurrency),
    )
    if args.compare_replies is not None and not args.compare_replies.exists():
        raise VerispecError(f"--compare-replies: {args.compare_replies} does not exist")
    run = run_serve_bench(settings, command, args.out)
    run.check_replies(args.compare_replies)
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
    if settings.all_turns:
        header, rows = turn_table(summaries)
        print()
        print("TTFT by turn (s)")
        print(text_table(rows, header))
    for reply_check in run.replies:
        print(reply_check.line())
    differ = [c for c in run.replies if c.compared and not c.identical]
    if differ:
        print(f"replies differ where greedy decoding must repeat itself: {differ[0].line()}")
    failed = sum(level.failed for level in run.levels)
    if failed:
        print(f"{failed} request(s) failed: see {results}")
    print(f"wrote {results}, {report} and {len(plots)} plots", file=sys.stderr)
    return 1 if failed or differ else 0


def _from_flags(cls: type[S], args: argparse.Namespace, **converted: Any) -> S:
    """The settings dataclass ``cls`` with each field that has a flag of its name taken from ``args``,
    as parsed; ``converted`` holds the fields whose flag's value needs converting (or is named
    otherwise). Flags the dataclass has no field for are not its concern."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    given = {name: value for name, value in vars(args).items() if name in names}
    return cls(**{**given, **converted})


def _server_run(args: argparse.Namespace) -> dict[str, Any]:
    """The converted :class:`~verispec.bench.server_proc.ServerRun` fields of ``bench serve`` and ``soak``."""
    return {
        "categories": tuple(args.categories) if args.categories else None,
        "server_args": tuple(args.server_args),
    }


def _soak(args: argparse.Namespace, command: str) -> int:
    _need_http_client()
    from verispec.bench.soak import SoakSettings, run_soak, summary

    settings = _from_flags(SoakSettings, args, **_server_run(args), depth_policy=args.depth)
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
    from verispec.bench.report import (
        TURN_HEADER,
        table_rows,
        text_table,
        turn_rows,
        turn_summaries,
        write_outputs,
    )

    settings = _from_flags(
        BenchSettings,
        args,
        methods=tuple(PLAIN if m == "plain" else m for m in args.methods),
        baselines=tuple(args.baselines),
        ngram=from_args(NgramConfig, args),
        datasets=tuple(args.dataset),
        categories=tuple(args.categories) if args.categories else None,
        limit_per_category=args.limit,
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
    print()
    print(text_table(turn_rows(turn_summaries(run.records)), TURN_HEADER))
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
    settings = _from_flags(
        m.LoadBenchSettings,
        args,
        target=target.resolve(),
        threads=args.threads or os.cpu_count() or 1,
        ks=tuple(args.ks),
        sides=tuple(args.sides),
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


def _suffix_cost(args: argparse.Namespace, command: str) -> int:
    from verispec.bench.suffix_cost import run as run_suffix_cost

    return run_suffix_cost(args, command)


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
