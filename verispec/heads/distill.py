"""Self-distillation data: the target's own replies, so that heads learn what *it* writes.

Heads trained on ShareGPT's replies learn to continue text written by another model (ChatGPT) and
by people (the standard library): at inference they continue the target's own text, whose hidden
states and next tokens look different. Medusa-2 and the EAGLE follow-ups (HASS, EAGLE-3's data)
regenerate the replies with the target for this reason. Here:

- chat prompts: the first user turn of ShareGPT conversations, taken from the *end* of the seeded
  order that :mod:`verispec.heads.data` consumes from the start, so the two never share a prompt;
- long prompts (``--long``): the first turns too long for a chat prompt (:data:`LONG_CHARS`), so
  that the heads also learn to draft a reply from a long input (summaries, translation, RAG);
- code prompts: a function's signature and docstring from the standard library (raw completion,
  the way HumanEval prompts are given; never HumanEval itself, nor any ``shared/data`` prompt), or a
  method's, shown inside its class's header (``--code-from methods``);
- JSON-mode prompts (``--json``): ShareGPT first turns to answer, and standard-library functions to
  describe, as JSON objects of fixed schemas (:data:`JSON_SCHEMAS`), the reply constrained by the
  engine's structured output as a served ``response_format`` would be.

The target answers each one greedily on verispec's own engine (speculation on: the output is the
same as plain decoding, only sooner) and every record keeps the exact token ids, so the training
sequence is what the target produced, not a re-tokenization of its text. The file is JSON lines,
appended as replies finish, and a rerun skips the prompts it already holds.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any, TypeGuard

from verispec.errors import VerispecError
from verispec.heads.data import iter_sharegpt, iter_stdlib_files, sharegpt_file
from verispec.heads.identity import TargetIdentity, identify
from verispec.heads.keep import StoreKeeper, request_id
from verispec.structured import Structured

KINDS = ("chat", "text")


@dataclass(frozen=True)
class DistillPrompt:
    """One prompt to answer: ``chat`` (user messages through the chat template) or ``text`` (raw).

    ``schema`` names a :data:`JSON_SCHEMAS` entry the reply is constrained to (JSON mode), or is
    empty; ``text`` is a raw prompt, or the code a JSON-mode prompt describes."""

    id: str
    kind: str
    messages: tuple[tuple[str, str], ...] = ()
    text: str = ""
    schema: str = ""


CHAT_CHARS = (16, 2000)
"""``--chat`` prompts: first turns of this many characters (a question, a short task)."""
LONG_CHARS = (2001, 3000)
"""``--long`` prompts: the first turns ``--chat`` skips for length (an article to summarise, text to
translate, a passage to answer about, code to review), up to what leaves a reply room in a training
sequence (3000 characters are ~700 tokens of the 1024 a store keeps). Heads trained only on short
prompts never learn to draft from a long input, which summaries, RAG and translation lean on."""


def sharegpt_prompts(limit: int, seed: int = 0, chars: tuple[int, int] = CHAT_CHARS) -> list[DistillPrompt]:
    """First user turns of ShareGPT conversations (of ``chars`` characters) from the end of the seeded
    order (see module doc)."""
    conversations = list(iter_sharegpt(sharegpt_file()))
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)  # the same permutation data.py applies to the same list
    out: list[DistillPrompt] = []
    for i in reversed(order):
        prompt = sharegpt_prompt(i, conversations[i], chars)
        if prompt is not None:
            out.append(prompt)
        if len(out) >= limit:
            break
    return out


def sharegpt_prompt(
    index: int, conversation: list[dict[str, str]], chars: tuple[int, int] = CHAT_CHARS
) -> DistillPrompt | None:
    """The prompt ``sharegpt:<index>``: the conversation's first turn where it is a user's of
    ``chars`` characters, else none. Its id is enough to make it again (:mod:`verispec.heads.pack`)."""
    first = conversation[0]
    if first["role"] != "user" or not chars[0] <= len(first["content"]) <= chars[1]:
        return None
    return DistillPrompt(f"sharegpt:{index}", "chat", messages=(("user", first["content"]),))


JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "answer": {
        "type": "object",
        "properties": {
            "topic": {"type": "string"},
            "answer": {"type": "string"},
            "key_points": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["topic", "answer", "key_points"],
        "additionalProperties": False,
    },
    "function": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "summary": {"type": "string"},
            "parameters": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {n: {"type": "string"} for n in ("name", "type", "description")},
                    "required": ["name", "type", "description"],
                    "additionalProperties": False,
                },
            },
            "returns": {"type": "string"},
            "raises": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "summary", "parameters", "returns", "raises"],
        "additionalProperties": False,
    },
}
"""JSON-mode prompts' schemas: a chat question answered as an object, and a function described as
one. The heads meet JSON in serving (``response_format``, tool calls) where the grammar writes the
keys (:meth:`~verispec.structured.Constraint.forced`) and the heads must guess the values, text they
never see in ordinary replies."""

_ANSWER_ASK = (
    '\n\nReply with a JSON object: "topic" (a few words), "answer" (your full answer) and '
    '"key_points" (a list of short strings).'
)
_FUNCTION_ASK = (
    "Describe this Python function as a JSON object: its name, a one-line summary, its parameters "
    "(name, type, description), what it returns and the exceptions it raises.\n\n```python\n{code}```"
)


def json_answer_prompt(question: DistillPrompt) -> DistillPrompt:
    """A ShareGPT first turn (:func:`sharegpt_prompt`) asked to be answered in JSON (``answer``)."""
    (role, text), *_ = question.messages
    return DistillPrompt(f"json-answer:{question.id}", "chat", ((role, text + _ANSWER_ASK),), schema="answer")


def json_function_prompt(code: DistillPrompt) -> DistillPrompt:
    """A standard-library code prompt (:func:`stdlib_prompts`) to describe in JSON (``function``)."""
    ask = _FUNCTION_ASK.format(code=code.text if code.text.endswith("\n") else code.text + "\n")
    return DistillPrompt(
        f"json-function:{code.id}", "chat", (("user", ask),), text=code.text, schema="function"
    )


def json_prompts(limit: int, seed: int = 0) -> list[DistillPrompt]:
    """``limit`` JSON-mode prompts, alternating: ShareGPT first turns in an order seeded apart from
    the chat prompts' (so mostly other conversations), and standard-library functions (two per
    file, files in an order seeded apart from the code prompts')."""
    answers = [json_answer_prompt(p) for p in sharegpt_prompts((limit + 1) // 2, seed + 1)]
    functions = [json_function_prompt(p) for p in stdlib_prompts(limit // 2, seed + 1)]
    return [p for pair in zip_longest(answers, functions) for p in pair if p is not None][:limit]


def sharegpt_index(id: str) -> int | None:
    """The ShareGPT conversation a chat prompt's id names (``sharegpt:<i>``, ``json-answer:sharegpt:<i>``)."""
    for prefix in ("sharegpt:", "json-answer:sharegpt:"):
        if id.startswith(prefix) and id.removeprefix(prefix).isdigit():
            return int(id.removeprefix(prefix))
    return None


def made_of_code(id: str, kind: str) -> bool:
    """Whether this prompt is rebuilt from code a pack keeps as ``text`` (a raw completion, or a
    function described in JSON), rather than from a ShareGPT conversation named by its id."""
    return kind == "text" or id.startswith("json-function:")


def rebuildable(id: str, kind: str, text: str) -> bool:
    """Whether :func:`rebuild_prompt` can make this prompt again from what a pack keeps."""
    if made_of_code(id, kind):
        return bool(text)
    return sharegpt_index(id) is not None


def rebuild_prompt(
    id: str, kind: str, text: str, conversation: Callable[[int], list[dict[str, str]] | None]
) -> DistillPrompt | None:
    """The prompt with this id again (None if it cannot be): a raw ``text`` prompt, a ShareGPT one
    (``conversation(index)`` gives that conversation, None past the end), or a JSON-mode one made
    of either (:mod:`verispec.heads.pack` keeps ids and code, never ShareGPT text)."""
    if made_of_code(id, kind) and not text:
        return None
    if kind == "text":
        return DistillPrompt(id, "text", text=text)
    if id.startswith("json-function:"):
        return json_function_prompt(DistillPrompt(id.removeprefix("json-function:"), "text", text=text))
    index = sharegpt_index(id)
    found = conversation(index) if index is not None else None
    if found is None:
        return None
    question = sharegpt_prompt(index, found, (CHAT_CHARS[0], LONG_CHARS[1]))  # --chat's or --long's
    if question is None:
        return None
    return json_answer_prompt(question) if id.startswith("json-answer:") else question


CODE_KINDS = ("functions", "methods")
"""What a code prompt completes: a top-level function, or a method inside its class's header."""


def _completable(node: ast.stmt) -> TypeGuard[ast.FunctionDef | ast.AsyncFunctionDef]:
    """An undecorated function with a docstring long enough to say what it does and a body after it."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
        return False
    doc = ast.get_docstring(node)
    return bool(doc) and len(doc) >= 40 and len(node.body) >= 2 and node.body[0].end_lineno is not None


def _parsed(source: str) -> tuple[ast.Module, list[str]]:
    """The module's syntax tree and lines; an empty module where the source does not parse."""
    try:
        return ast.parse(source), source.splitlines(keepends=True)
    except (SyntaxError, ValueError):
        return ast.Module(body=[], type_ignores=[]), []


def _up_to_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return "".join(lines[node.lineno - 1 : node.body[0].end_lineno])


def function_prompts(source: str) -> Iterator[tuple[str, str]]:
    """(name, prompt) for each top-level, undecorated function with a docstring: its source from the
    ``def`` line to the docstring's end, as a HumanEval-style completion prompt."""
    tree, lines = _parsed(source)
    for node in tree.body:
        if _completable(node):
            yield node.name, _up_to_docstring(lines, node)


def method_prompts(source: str) -> Iterator[tuple[str, str]]:
    """(``Class.method``, prompt) for each undecorated method with a docstring of a top-level class:
    the class's header (its ``class`` line(s), without the class body) followed by the method from its
    ``def`` line to the docstring's end. Python 3.11's standard library has about twice as many
    documented methods (3235) as top-level functions (1544), so this is where more code prompts come
    from; the header gives the method the context (``self``, the base classes) its body needs."""
    tree, lines = _parsed(source)
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef) or cls.decorator_list:
            continue
        header = "".join(lines[cls.lineno - 1 : _header_end(lines, cls)]).rstrip() + "\n"
        for node in cls.body:
            if _completable(node):
                yield f"{cls.name}.{node.name}", header + _up_to_docstring(lines, node)


def _header_end(lines: list[str], cls: ast.ClassDef) -> int:
    """The index after the line that ends the ``class`` statement (its bases may span lines; comments
    and the class docstring after it are left out)."""
    for i in range(cls.lineno - 1, cls.body[0].lineno - 1):
        if lines[i].split("#", 1)[0].rstrip().endswith(":"):
            return i + 1
    return cls.lineno


def stdlib_prompts(
    limit: int, seed: int = 0, per_file: int = 2, kind: str = "functions"
) -> list[DistillPrompt]:
    """Code prompts from the standard library's source (tests excluded), files in a seeded order: up to
    ``per_file`` top-level functions (``kind="functions"``) or methods (``"methods"``) from each."""
    if kind not in CODE_KINDS:
        raise VerispecError(f"code prompts complete {' or '.join(CODE_KINDS)}, not {kind!r}")
    prompts_of = function_prompts if kind == "functions" else method_prompts
    out: list[DistillPrompt] = []
    for module, source in iter_stdlib_files(f"distill:{seed}", skip=frozenset({"idlelib"})):
        for name, prompt in list(prompts_of(source))[:per_file]:
            if len(prompt) <= 3000:
                out.append(DistillPrompt(f"stdlib:{module}:{name}", "text", text=prompt))
        if len(out) >= limit:
            break
    return out[:limit]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a distillation file; a line cut off by an interruption is dropped.

    Lines end at ``\\n`` only: records are written with ``ensure_ascii=False``, so a prompt's U+2028
    (LINE SEPARATOR) or U+0085 stays raw inside its line, where ``str.splitlines`` would cut it and the
    record would be lost: answered, then never trained on, packed or seen as done."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") in KINDS and record.get("completion_ids"):
            records.append(record)
    return records


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


def check_file(path: Path, identity: TargetIdentity | None = None) -> list[dict[str, Any]]:
    """The records of ``path``, or a clear error where there are none or (with ``identity``) where
    another model wrote them: its token ids would mean other tokens, or none, to this target."""
    records = read_records(path)
    if not records:
        raise VerispecError(f"{path} holds no distillation records; make it with `verispec distill`")
    if identity is not None:
        for r in records:
            other = r.get("target_config_sha256") not in (None, identity.config_sha256)
            if other or max(r["prompt_ids"] + r["completion_ids"]) >= identity.vocab_size:
                raise VerispecError(
                    f"{path} holds replies of {r.get('target', 'another model')}, not of {identity.name}; "
                    f"make them with `verispec distill --target {identity.name}`"
                )
    return records


def add_distill_parser(sub: Any, default_target: str) -> None:
    """``verispec distill``: the flags (the command line module calls :func:`run_distill`)."""
    from verispec.cli import add_load_flags

    p = sub.add_parser(
        "distill",
        help="write the target's own replies, as training data for its heads",
        description="Answer ShareGPT first turns (chat, and long ones), standard-library function signatures "
        "(raw completion) and JSON-mode prompts greedily with the target, appending the exact token ids "
        "to a JSON-lines file for `verispec train ... --sources distilled --distilled FILE`. Reruns resume.",
    )
    p.add_argument("--target", default=default_target, help="registry name, HF folder or .gguf file")
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
    from verispec.heads import pack

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
