"""What one method did on one prompt: the raw, per-prompt facts every table is computed from.

Records hold additive counts (tokens, seconds, drafted and accepted tokens), never ratios, so any
grouping (a category, a dataset, everything) is aggregated exactly by summing, and a results file
can be re-aggregated later (``verispec plan`` reads it) without loss.

:class:`RecordLog` appends each record to ``records.jsonl`` the moment it exists, so a long run that
crashes or is interrupted keeps what it measured and can be resumed by a later process.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import IO, Any

from verispec.errors import VerispecError
from verispec.metrics import SpecStats

RECORDS_FILE = "records.jsonl"
LOG_SCHEMA = "verispec-bench-records/1"


@dataclass
class SpecCounts:
    """Speculation counters of one or more generations, as defined in :mod:`verispec.metrics`.

    Only verispec's own methods have them; the baselines' libraries don't expose these numbers.
    """

    target_forward_passes: int = 0
    committed: int = 0
    """Tokens committed by those passes, the recovered or bonus token included (tau's numerator)."""
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @classmethod
    def from_stats(cls, stats: SpecStats) -> SpecCounts:
        return cls(**{mine: _copy(getattr(stats, theirs)) for mine, theirs in _STATS_NAMES.items()})

    def to_stats(self) -> SpecStats:
        """The counts as :class:`SpecStats`, whose properties hold the one definition of acceptance
        rate, mean accepted length and per-position acceptance."""
        return SpecStats(**{theirs: _copy(getattr(self, mine)) for mine, theirs in _STATS_NAMES.items()})

    def __add__(self, other: SpecCounts) -> SpecCounts:
        """Field by field; the per-position lists add up position by position."""
        sums: dict[str, Any] = {}
        for name in _STATS_NAMES:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, list):
                sums[name] = [a + b for a, b in zip_longest(mine, theirs, fillvalue=0)]
            else:
                sums[name] = mine + theirs
        return SpecCounts(**sums)


_STATS_NAMES = {
    "target_forward_passes": "num_steps",
    "committed": "num_committed",
    "drafted": "num_drafted",
    "accepted": "num_accepted",
    "drafted_at": "drafted_at",
    "accepted_at": "accepted_at",
    "draft_seconds": "draft_seconds",
    "verify_seconds": "verify_seconds",
}
"""Each :class:`SpecCounts` field (its name in ``records.jsonl``) and the :class:`SpecStats` field
it carries."""


def _copy(value: Any) -> Any:
    """A list copied (the counts must not share a list with the stats they came from), else as is."""
    return list(value) if isinstance(value, list) else value


@dataclass
class Turn:
    """One generation: the answer to one user turn (or to a completion prompt)."""

    prompt_tokens: int
    token_ids: list[int]
    seconds: float
    """Wall time of the whole generation, prefill included, measured around the call."""
    counts: SpecCounts | None = None
    text: str = ""
    ttft: float | None = None
    """Seconds from submitting the turn to its first token (prefill and the first step: what a
    prefix cache shortens); None where the contender cannot tell (other tools' baselines)."""
    cached_prompt_tokens: int | None = None
    """Prompt tokens the prefix cache supplied instead of a prefill (verispec's methods only)."""


@dataclass
class PromptRecord:
    """One method on one prompt: every turn, timed, and the outcome of the lossless check."""

    method: str
    dataset: str
    category: str
    prompt_id: str
    turns: list[Turn]
    reference: str | None = None
    """The plain decoding whose output this one must equal token for token (None: not checked)."""
    matches_reference: bool | None = None
    first_mismatch: int | None = None
    """Index, in the concatenated output of all turns, of the first token that differs."""
    error: str | None = None
    """Why this generation failed (a :class:`VerispecError`, e.g. a prompt longer than the context);
    a failed record keeps the turns it finished but counts in no table."""

    @property
    def key(self) -> tuple[str, str, str, str]:
        """(method, dataset, category, prompt id): what a resumed run must not measure again."""
        return (self.method, self.dataset, self.category, self.prompt_id)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def group(self) -> str:
        return f"{self.dataset}/{self.category}"

    @property
    def output_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def output_tokens(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns)

    @property
    def seconds(self) -> float:
        return sum(turn.seconds for turn in self.turns)

    @property
    def tokens_per_second(self) -> float:
        """Spec-Bench's per-prompt speed: new tokens of all turns over the wall time of all turns."""
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def counts(self) -> SpecCounts | None:
        if any(turn.counts is None for turn in self.turns):
            return None
        total = SpecCounts()
        for turn in self.turns:
            assert turn.counts is not None
            total = total + turn.counts
        return total

    def check_against(self, reference: PromptRecord) -> None:
        """Record whether this output equals ``reference``'s (the lossless check)."""
        mine, theirs = self.output_ids, reference.output_ids
        self.reference = reference.method
        self.matches_reference = mine == theirs
        self.first_mismatch = None
        if not self.matches_reference:
            self.first_mismatch = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["output_tokens"] = self.output_tokens
        out["seconds"] = self.seconds
        out["tokens_per_second"] = self.tokens_per_second
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PromptRecord:
        turns = [
            Turn(
                prompt_tokens=t["prompt_tokens"],
                token_ids=list(t["token_ids"]),
                seconds=t["seconds"],
                counts=SpecCounts(**t["counts"]) if t.get("counts") is not None else None,
                text=t.get("text", ""),
                ttft=t.get("ttft"),
                cached_prompt_tokens=t.get("cached_prompt_tokens"),
            )
            for t in data["turns"]
        ]
        return cls(
            method=data["method"],
            dataset=data["dataset"],
            category=data["category"],
            prompt_id=data["prompt_id"],
            turns=turns,
            reference=data.get("reference"),
            matches_reference=data.get("matches_reference"),
            first_mismatch=data.get("first_mismatch"),
            error=data.get("error"),
        )


class RecordLog:
    """``records.jsonl``: a header line with the run's settings, then one line per finished record.

    Each line is flushed as soon as it is written, so only the generation in flight is lost when a
    process dies. ``--resume`` reads the file back; it refuses a file made with other settings,
    because records measured under different settings must not be mixed into one table.
    """

    def __init__(self, path: Path, stream: IO[str]) -> None:
        self.path = path
        self._stream = stream

    @classmethod
    def start(
        cls, path: Path, settings: dict[str, Any], command: str = "", resume: bool = False
    ) -> tuple[RecordLog, list[PromptRecord]]:
        """Open the log for appending; with ``resume``, also return the records it already holds.

        Without ``resume`` an existing log is kept as ``records.jsonl.previous`` rather than lost.
        """
        settings = json.loads(json.dumps(settings))  # the form it takes in the file (lists, str)
        previous: list[PromptRecord] = []
        if resume and path.is_file():
            previous = _read_log(path, settings)
        elif path.is_file():
            backup = path.with_name(path.name + ".previous")
            path.replace(backup)
            print(
                f"verispec: moved the records of an earlier run to {backup} (use --resume to continue a run)",
                file=sys.stderr,
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        # Rewritten whole even when resuming (this drops a line cut short by a killed process), into
        # a temporary file first, so that dying right now loses nothing.
        lines = [{"schema": LOG_SCHEMA, "settings": settings, "command": command}]
        lines += [record.to_dict() for record in previous]
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
        temporary.replace(path)
        return cls(path, path.open("a", encoding="utf-8")), previous

    def append(self, record: PromptRecord) -> None:
        self._stream.write(json.dumps(record.to_dict()) + "\n")
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()


def _read_log(path: Path, settings: dict[str, Any]) -> list[PromptRecord]:
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        header = {}
    if header.get("schema") != LOG_SCHEMA:
        raise VerispecError(f"{path} is not a verispec bench records log; remove it or use another --out")
    if header.get("settings") != settings:
        theirs = header.get("settings") or {}
        diff = ", ".join(
            f"{k}: {theirs.get(k)!r} there, {settings.get(k)!r} now"
            for k in sorted(set(theirs) | set(settings))
            if theirs.get(k) != settings.get(k)
        )
        raise VerispecError(
            f"can't resume: {path} was recorded with other settings ({diff}); "
            "run with the same settings, or without --resume to start afresh"
        )
    records = []
    for number, line in enumerate(lines[1:], 2):
        try:
            records.append(PromptRecord.from_dict(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError):
            if number < len(lines):  # only the last line may be cut short (a killed process)
                raise VerispecError(f"{path} line {number} is corrupt; remove that line to resume") from None
    return records
