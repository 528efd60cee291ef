"""The evaluation prompt sets: Spec-Bench, MT-bench and HumanEval, read from the packaged data, and
the workloads generated from them (``code_edit``, ``tool_calls``, ``mt_bench_6turn``:
:mod:`verispec.bench.workloads`).

Each prompt is a :class:`BenchPrompt`. A chat prompt is a list of user turns: turn ``i + 1`` is sent
after the model's own answer to turn ``i`` has been added to the conversation, so the answers are
generated, never read from the file. A workload may put a system message first and, between an
answer and the next user turn, messages made from that answer (``tool_calls``: the tool's result);
:meth:`BenchPrompt.before_turn` is the one place both the offline and the served benchmark build a
conversation from. HumanEval is raw code completion (``chat=False``, one turn: the function
signature and docstring).

Categories. Spec-Bench reports six tasks, and :func:`load_dataset` uses those as its categories:
``mt_bench`` (its 80 two-turn rows, whose ``category`` field in the file is one of MT-bench's
eight), ``translation``, ``summarization``, ``qa``, ``math_reasoning`` and ``rag``. MT-bench keeps
its own eight categories; HumanEval has one, ``code``. ``mt_bench_6turn`` keeps MT-bench's;
``code_edit`` and ``tool_calls`` have one each, named after them.

Selection is deterministic: filters keep file order, ``limit_per_category`` takes the first N rows
of each category and ``limit`` the first N of what remains. Nothing is shuffled or hand-picked.
The data folder is the copy shipped inside the package (:mod:`verispec.data`), so a clone or an
install benchmarks the same prompts with nothing else to fetch. ``--data-dir`` (or
``$VERISPEC_DATA_DIR``) points elsewhere, to a folder with the same layout.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from verispec.data import DATASETS, WORKLOADS, DatasetName, packaged_data_dir
from verispec.errors import VerispecError

DATA_DIR_ENV = "VERISPEC_DATA_DIR"

MT_BENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")

CATEGORIES: dict[str, tuple[str, ...]] = {
    "spec_bench": SPEC_BENCH_TASKS,
    "mt_bench": MT_BENCH_CATEGORIES,
    "humaneval": ("code",),
    "code_edit": ("code_edit",),
    "tool_calls": ("tool_calls",),
    "mt_bench_6turn": MT_BENCH_CATEGORIES,
}
"""The valid categories of each dataset, in the order they appear in the file."""

CONVERSATIONS = frozenset(WORKLOADS)
"""Datasets made to be run turn by turn: ``bench serve`` sends every turn of theirs by default, and
only the first turn of the others (as it always has)."""

Message = dict[str, str]
"""A chat message, ``{"role": ..., "content": ...}``."""


@dataclass(frozen=True)
class BenchPrompt:
    """One evaluation prompt.

    ``turns`` are the user messages, in order (a completion prompt has exactly one). ``chat`` says
    whether to wrap them in the model's chat template (True) or feed the text raw (False).
    """

    dataset: str
    category: str
    id: str
    turns: list[str]
    chat: bool
    system: str | None = None
    """A system message before the first turn (``tool_calls``: the tools); None leaves the
    template's default."""
    feedback: Callable[[str], list[Message]] | None = None
    """The messages a conversation gets after the model's answer to a turn and before the next user
    turn, made from that answer alone (``tool_calls``: the tool's result), so equal answers give
    equal conversations; None: nothing in between."""

    def before_turn(self, index: int, answer: str | None = None) -> list[Message]:
        """The messages that come before user turn ``index`` (0-based): before the first, the system
        message, if any; before a later one, the model's ``answer`` to the previous turn as the
        assistant's message and the feedback on it."""
        if index == 0:
            return [{"role": "system", "content": self.system}] if self.system is not None else []
        if answer is None:
            raise ValueError(f"turn {index} of {self.dataset} {self.id} needs the answer to turn {index - 1}")
        messages = [{"role": "assistant", "content": answer}]
        if self.feedback is not None:
            messages += self.feedback(answer)
        return messages


def default_data_dir() -> Path:
    """``$VERISPEC_DATA_DIR`` if set, else the packaged data (:mod:`verispec.data`)."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else packaged_data_dir()


def load_dataset(
    name: DatasetName,
    data_dir: Path | None = None,
    limit_per_category: int | None = None,
    categories: list[str] | None = None,
    limit: int | None = None,
    seed: int | None = None,
) -> list[BenchPrompt]:
    """The prompts of dataset ``name``, filtered and truncated deterministically.

    ``categories`` keeps only those categories (see :data:`CATEGORIES`); ``limit_per_category``
    keeps the first N of each category; ``limit`` then keeps the first N overall. Rows are taken in
    file order, or in an order shuffled by ``seed`` (a reproducible random sample: the first rows of
    a file are not always representative, e.g. Spec-Bench's MT-bench rows start with "writing").
    """
    if name not in DATASETS:
        raise VerispecError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    valid = CATEGORIES[name]
    if categories is not None:
        unknown = [c for c in categories if c not in valid]
        if unknown:
            raise VerispecError(
                f"unknown {name} category: {', '.join(unknown)}; valid categories: {', '.join(valid)}"
            )
    for value, what in ((limit_per_category, "limit_per_category"), (limit, "limit")):
        if value is not None and value < 0:
            raise VerispecError(f"{what} must be >= 0, got {value}")

    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if not root.is_dir():
        raise VerispecError(
            f"benchmark data folder {root} does not exist; pass --data-dir (or set ${DATA_DIR_ENV}) "
            "to the folder holding spec_bench/, mt_bench/ and humaneval/ (the workloads are made from them)"
        )

    rows = list(_READERS[name](root))
    if seed is not None:
        random.Random(seed).shuffle(rows)
    prompts: list[BenchPrompt] = []
    taken: dict[str, int] = {}
    for prompt in rows:
        if limit is not None and len(prompts) >= limit:
            break
        if categories is not None and prompt.category not in categories:
            continue
        if limit_per_category is not None and taken.get(prompt.category, 0) >= limit_per_category:
            continue
        taken[prompt.category] = taken.get(prompt.category, 0) + 1
        prompts.append(prompt)
    return prompts


def read_jsonl(path: Path) -> Iterator[dict]:
    if not path.is_file():
        raise VerispecError(f"benchmark file {path} is missing; check --data-dir")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise VerispecError(f"{path}:{line_number}: not valid JSON ({e.msg})") from None


def _chat_rows(dataset: str, path: Path, category_of: Callable[[str], str]) -> Iterator[BenchPrompt]:
    for row in read_jsonl(path):
        category = category_of(row["category"])
        if category not in CATEGORIES[dataset]:
            raise VerispecError(f"{path}: question {row['question_id']} has unknown category {category!r}")
        yield BenchPrompt(
            dataset=dataset,
            category=category,
            id=str(row["question_id"]),
            turns=list(row["turns"]),
            chat=True,
        )


def _spec_bench(root: Path) -> Iterator[BenchPrompt]:
    # The file labels its MT-bench rows with MT-bench's own categories; Spec-Bench reports them as one task.
    def task(category: str) -> str:
        return "mt_bench" if category in MT_BENCH_CATEGORIES else category

    return _chat_rows("spec_bench", root / "spec_bench" / "question.jsonl", task)


def _mt_bench(root: Path) -> Iterator[BenchPrompt]:
    return _chat_rows("mt_bench", root / "mt_bench" / "question.jsonl", lambda category: category)


def _humaneval(root: Path) -> Iterator[BenchPrompt]:
    for row in read_jsonl(root / "humaneval" / "HumanEval.jsonl.gz"):
        yield BenchPrompt(
            dataset="humaneval", category="code", id=row["task_id"], turns=[row["prompt"]], chat=False
        )


def _workload(name: str) -> Callable[[Path], Iterator[BenchPrompt]]:
    """The reader of workload ``name``, imported when first used (the workloads import this module)."""

    def read(root: Path) -> Iterator[BenchPrompt]:
        from verispec.bench import workloads

        return workloads.READERS[name](root)

    return read


_READERS: dict[str, Callable[[Path], Iterator[BenchPrompt]]] = {
    "spec_bench": _spec_bench,
    "mt_bench": _mt_bench,
    "humaneval": _humaneval,
    **{name: _workload(name) for name in WORKLOADS},
}
