"""Self-distillation data: the target's own replies, so that heads learn what *it* writes.

Heads trained on ShareGPT's replies learn to continue text written by another model (ChatGPT) and
by people (the standard library): at inference they continue the target's own text, whose hidden
states and next tokens look different. Medusa-2 and the EAGLE follow-ups (HASS, EAGLE-3's data)
regenerate the replies with the target for this reason. The prompts (chat, long, code and
JSON-mode) are :mod:`verispec.training.prompts`'.

The target answers each one greedily on verispec's own engine (speculation on: the output is the
same as plain decoding, only sooner) and every record keeps the exact token ids, so the training
sequence is what the target produced, not a re-tokenization of its text. The file is JSON lines
(:mod:`verispec.training.records`), appended as replies finish, and a rerun skips the prompts it
already holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from itertools import zip_longest
from pathlib import Path
from typing import Any

from verispec.errors import VerispecError
from verispec.heads.identity import identify
from verispec.structured import Structured
from verispec.training import pack
from verispec.training.keep import StoreKeeper, request_id
from verispec.training.prompts import (
    CODE_KINDS,
    JSON_SCHEMAS,
    LONG_CHARS,
    DistillPrompt,
    json_prompts,
    sharegpt_prompts,
    stdlib_prompts,
)
from verispec.training.records import read_records


def distill(
    engine: Any,
    prompts: list[DistillPrompt],
    out: Path,
    *,
    max_new_tokens: int = 256,
    chunk: int = 32,
    progress: bool = True,
    keeper: StoreKeeper | None = None,
) -> int:
    """Answer ``prompts`` greedily with ``engine`` and append the records to ``out``; returns how
    many were written now (prompts already in the file are skipped). With ``keeper``, the target's
    hidden states of each chunk's records go into the file's hidden-state store as they are written."""
    from tqdm import tqdm

    made_by = {"target": engine.target.name, "target_config_sha256": identify(engine.target).config_sha256}
    done = {r["id"] for r in read_records(out)}
    todo = [p for p in prompts if p.id not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file() and out.stat().st_size:
        with out.open("rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")  # end a line an interruption cut off, so the next record starts its own
    if keeper is not None:
        keeper.sync()  # records already in the file (an earlier run, --unpack) join the store unfilled
        engine.hidden_observer = keeper.recorder
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="prompt", disable=not progress)
    written = 0
    try:
        for a in range(0, len(todo), chunk):
            group = todo[a : a + chunk]
            ids = [_prompt_ids(engine, p) for p in group]
            each: list[dict[str, Any]] = [
                {"structured": Structured("json", JSON_SCHEMAS[p.schema])} if p.schema else {} for p in group
            ]
            each = [{**e, "request_id": request_id(p.id)} for e, p in zip(each, group, strict=True)]
            gens = engine.generate_batch(ids, each=each, max_new_tokens=max_new_tokens, temperature=0.0)
            with out.open("a", encoding="utf-8") as f:
                for prompt, prompt_ids, gen in zip(group, ids, gens, strict=True):
                    completion = list(gen.token_ids)  # the end-of-turn token included, where written
                    record = {
                        **asdict(prompt),
                        "prompt_ids": prompt_ids,
                        "completion_ids": completion,
                        "completion": gen.text,
                        "finish_reason": gen.finish_reason,
                        **made_by,
                    }
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                    written += 1
            if keeper is not None:
                keeper.sync()
                keeper.recorder.clear()  # the chunk's requests have all finished
            bar.update(len(group))
    finally:
        if keeper is not None:
            keeper.recorder.clear()
            engine.hidden_observer = None
    bar.close()
    return written


def _prompt_ids(engine: Any, prompt: DistillPrompt) -> list[int]:
    if prompt.kind == "chat":
        return engine.apply_chat_template([{"role": r, "content": c} for r, c in prompt.messages])
    return engine.encode(prompt.text)


def add_distill_flags(p: Any, default_target: str) -> None:
    """``verispec distill``: the flags (the command line module calls :func:`run_distill`)."""
    from verispec.settings import add_load_flags, add_target_flag

    p.description = (
        "Answer ShareGPT first turns (chat, and long ones), standard-library function signatures (raw "
        "completion) and JSON-mode prompts greedily with the target, appending the exact token ids to a "
        "JSON-lines file for `verispec train ... --sources distilled --distilled FILE`. Reruns resume."
    )
    add_target_flag(p, default_target)
    p.add_argument("--out", type=Path, required=True, help="JSON-lines file to append to")
    p.add_argument("--chat", type=int, default=600, help="ShareGPT prompts to answer")
    p.add_argument("--code", type=int, default=400, help="standard-library function prompts to complete")
    p.add_argument(
        "--long", type=int, default=0,
        help=f"long ShareGPT first turns ({LONG_CHARS[0]}-{LONG_CHARS[1]} characters, which --chat skips): "
        "articles to summarise, text to translate, passages to answer about, code to review",
    )  # fmt: skip
    p.add_argument(
        "--json", type=int, default=0,
        help="JSON-mode prompts (replies constrained to a schema): ShareGPT questions answered as JSON "
        "and standard-library functions described as JSON, alternating",
    )  # fmt: skip
    p.add_argument(
        "--code-per-file", type=int, default=2,
        help="functions taken from each standard-library file (2 gives 448 prompts in all, 4 729, 8 1027)",
    )  # fmt: skip
    p.add_argument(
        "--code-from", choices=CODE_KINDS, default="functions",
        help="complete top-level functions, or methods shown inside their class's header (new prompts "
        "once the functions are used up)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--method", default="ngram", choices=["ngram", "none"],
        help="speculation while answering (greedy output is the same; ngram is only faster)",
    )  # fmt: skip
    p.add_argument("--max-batch-size", type=int, default=24, help="prompts decoding together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--unpack", type=Path, default=None, metavar="PACK",
        help="first add a pack's replies (e.g. data/distill/<target>.jsonl.gz) to --out, prompts rebuilt "
        "and checked, so that the run answers only what the pack lacks",
    )  # fmt: skip
    p.add_argument(
        "--keep-hidden", action="store_true",
        help="keep the target's hidden states of every reply as it is written, in the store `verispec "
        "train --sources distilled --distilled OUT` opens (same --cache-dir, default data flags): "
        "training then needs no pass of the target over the replies",
    )  # fmt: skip
    p.add_argument("--cache-dir", type=Path, default=None, help="with --keep-hidden: the store's folder")
    p.add_argument(
        "--pack", type=Path, default=None, metavar="PACK",
        help="at the end, write --out's replies as a pack (token ids, no ShareGPT text) to keep in git",
    )  # fmt: skip
    add_load_flags(p)


def run_distill(args: Any) -> int:
    import verispec

    counts = (args.chat, args.code, args.json, args.long)
    if min(counts) < 0 or (sum(counts) == 0 and not (args.pack or args.unpack)):
        raise VerispecError(
            "--chat, --code, --json and --long must be >= 0 and not all 0 (unless packing or unpacking)"
        )
    if args.code_per_file < 1:
        raise VerispecError(f"--code-per-file must be >= 1, got {args.code_per_file}")
    if args.cache_dir is not None and not args.keep_hidden:
        raise VerispecError("--cache-dir names the store of --keep-hidden; give both or neither")
    if args.unpack is not None:
        pack.read_pack(args.unpack)  # not a pack: said before any model loads
    chat = sharegpt_prompts(args.chat, args.seed) if args.chat else []
    code = stdlib_prompts(args.code, args.seed, args.code_per_file, args.code_from) if args.code else []
    json_mode = json_prompts(args.json, args.seed) if args.json else []
    long = sharegpt_prompts(args.long, args.seed, LONG_CHARS) if args.long else []
    kinds = zip_longest(chat, code, json_mode, long)
    prompts = [p for each in kinds for p in each if p is not None]  # every kind early
    if prompts or args.unpack is not None:
        engine = verispec.load(
            args.target,
            method=None if args.method == "none" else args.method,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            quantization=args.quantization,
            max_batch_size=args.max_batch_size,
        )
        if args.unpack is not None:
            identity = identify(engine.target)
            added = pack.unpack(args.unpack, args.out, identity, lambda p: _prompt_ids(engine, p))
            print(f"{args.out}: {added} replies added from {args.unpack}")
        keeper = None
        if args.keep_hidden:
            keeper = StoreKeeper(engine.target, identify(engine.target), args.out, args.cache_dir)
        written = distill(
            engine,
            prompts,
            args.out,
            max_new_tokens=args.max_new_tokens,
            chunk=4 * args.max_batch_size,  # few short batches at each chunk's end (20 vs 12 prompts/min)
            progress=not args.quiet,
            keeper=keeper,
        )
        print(f"{args.out}: {written} replies written now")
        if keeper is not None:
            filled = keeper.store.filled()
            print(f"{keeper.store.folder}: hidden states of {int(filled.sum())} of {len(filled)} replies kept"
                  + ("" if filled.all() else "; `verispec train` computes the rest"))  # fmt: skip
    records = read_records(args.out)
    tokens = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in records)
    print(f"{args.out}: {len(records)} records, {tokens} tokens in all")
    if args.pack is not None:
        print(f"{args.pack}: {pack.write_pack(records, args.pack)} replies packed")
    return 0
