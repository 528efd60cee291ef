"""The flags of ``verispec bench`` and its subcommands (``forward``, ``quality``, ``serve``, ``soak``,
``load``, ``plan``, ``suffix-cost``), kept apart from :mod:`verispec.bench.cli`, which runs them.

The speculation and load flags come from the settings' one definition (:mod:`verispec.settings`);
what is here is the bench's own: prompt sets, baselines, sweeps and output folders.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from verispec.bench.datasets import DATASETS
from verispec.bench.settings import BASELINES, CACHE_SCOPES, PLAIN, SERVE_METHODS, BenchSettings
from verispec.bench.suffix_cost import add_suffix_cost_parser
from verispec.config import METHODS
from verispec.settings import add_flags, add_load_flags, add_target_flag, setting

QUANTIZATIONS: tuple[str, ...] = setting("quantization").choices or ()


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _ints(value: str) -> list[int]:
    try:
        return [int(item) for item in _csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _out_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--out", type=Path, default=Path(default), help="output folder (created if needed)")


def _data_dir_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="folder with spec_bench/, mt_bench/, humaneval/"
    )


def _curve_flags(parser: argparse.ArgumentParser, context: int) -> None:
    """The verify-cost curve's flags (``bench forward`` and ``bench load``)."""
    parser.add_argument("--ks", type=_ints, default=[1, 2, 4, 8, 16], help="comma list of k")
    parser.add_argument("--context", type=int, default=context, help="tokens already in the KV cache")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed forwards per k (the median is reported)"
    )


def _model_flags(parser: argparse.ArgumentParser, default_target: str) -> None:
    add_target_flag(parser, default_target)
    add_flags(parser, ("draft",))
    add_load_flags(parser)
    _out_flag(parser, "results")


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
    add_flags(
        bench,
        ("num_speculative_tokens", "depth", "heads", "tree_nodes", "tree_width", "ngram_max", "ngram_min"),
        restated_by=BenchSettings,
    )
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
    _data_dir_flag(bench)
    bench.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per turn")
    bench.add_argument("--warmup", type=int, default=1, help="untimed generations per method before timing")
    bench.add_argument(
        "--cache-scope",
        default="shared",
        choices=CACHE_SCOPES,
        help="shared: each method's requests share one cache scope, so earlier prompts and turns can "
        "be reused (prompt KV, outputs to draft from); private: nothing is reused across requests",
    )
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

    steps = bench.add_subparsers(
        dest="bench_command", metavar="{forward,load,plan,quality,serve,soak,suffix-cost}"
    )
    forward = steps.add_parser(
        "forward",
        help="time one forward pass appending k tokens to a KV cache (the verify-cost curve)",
        description="Median time of one target (and draft) forward that appends k tokens to a KV cache "
        "of --context tokens. Prints a table and writes forward.json to --out.",
    )
    _model_flags(forward, default_target)
    _curve_flags(forward, context=120)
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
    add_target_flag(quality, default_target)
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
        help="folder holding humaneval/ (and spec_bench/) (default: the packaged data)",
    )
    _out_flag(quality, "results")
    _add_serve_parser(steps, default_target)
    _add_soak_parser(steps, default_target)
    _add_load_parser(steps)
    add_suffix_cost_parser(steps)


def _served_bench_flags(parser: argparse.ArgumentParser, default_target: str, out: str) -> None:
    """Flags shared by ``bench serve`` and ``bench soak``: the server's models and the prompts."""
    add_target_flag(parser, default_target)
    add_flags(parser, ("draft", "num_speculative_tokens", "threads", "quantization"))  # the server's
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
        help="prompt set (bench serve: see --turns; bench soak sends a chat prompt's first turn)",
    )
    parser.add_argument("--categories", type=_csv, default=None, help="comma list of categories to keep")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt order")
    _data_dir_flag(parser)
    parser.add_argument(
        "--server-args",
        type=shlex.split,
        default=[],
        help="more `verispec serve` flags, one quoted string: --server-args='--draft-p-min 0.2'",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for the server's /health"
    )
    _out_flag(parser, out)


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
    _curve_flags(load, context=128)
    load.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds one side may take before it is killed"
    )
    _out_flag(load, "results/load")


def _add_serve_parser(sub: argparse._SubParsersAction, default_target: str) -> None:
    serve = sub.add_parser(
        "serve",
        help="throughput, TTFT and per-user tok/s of `verispec serve` under 1..N users, per depth policy",
        description="For each policy, start `verispec serve` in a separate process on a free loopback port "
        "(plain = --method none; fixed and adaptive = --depth-policy with -k), warm it up, and run "
        "--requests-per-level conversations (a streaming greedy request per turn; see --turns) from each "
        "number of concurrent users in --concurrency. Writes results.json, report.md, PNG plots and the "
        "servers' logs to --out.",
    )
    _served_bench_flags(serve, default_target, "results/serve")
    serve.add_argument(
        "--method", default=None, choices=list(SERVE_METHODS), help="default: draft if --draft, else ngram"
    )
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
        "--compare-replies",
        type=Path,
        default=None,
        metavar="RUN",
        help="another bench serve run (its --out folder or results.json) whose replies this run's must "
        "equal, policy by policy (the same prompts with the other --cache-scope, say); the report counts "
        "the matches, as it does across this run's own policies",
    )
    serve.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="conversations run at each level, a request per turn sent (default: max(12, 2 x users))",
    )
    serve.add_argument(
        "--turns",
        default=None,
        choices=["all", "first"],
        help="all: each user runs its conversation turn by turn, each turn a request with the whole "
        "history; first: a prompt's first turn only (default: all for code_edit, tool_calls and "
        "mt_bench_6turn, first for the others)",
    )
    serve.add_argument(
        "--cache-scope",
        default="shared",
        choices=["shared", "private"],
        help="shared: the requests of a level share cached prompts and outputs (servers without a key "
        "start with --shared-cache); private: nothing is reused across requests",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("VERISPEC_API_KEY") or None,
        metavar="KEY",
        help="send this API key (Authorization: Bearer) and start the servers requiring it, through "
        "their environment (default: $VERISPEC_API_KEY); its requests share the key's cache scope",
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
    add_flags(soak, ("depth",))
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
