"""What one method did on one prompt: the raw, per-prompt facts every table is computed from.

Records hold additive counts (tokens, seconds, drafted and accepted tokens), never ratios, so any
grouping (a category, a dataset, everything) is aggregated exactly by summing, and a results file
can be re-aggregated later (``verispec plan`` reads it) without loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from typing import Any

from verispec.metrics import SpecStats


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
        return cls(
            target_forward_passes=stats.num_steps,
            committed=stats.num_committed,
            drafted=stats.num_drafted,
            accepted=stats.num_accepted,
            drafted_at=list(stats.drafted_at),
            accepted_at=list(stats.accepted_at),
            draft_seconds=stats.draft_seconds,
            verify_seconds=stats.verify_seconds,
        )

    def __add__(self, other: SpecCounts) -> SpecCounts:
        def add_lists(a: list[int], b: list[int]) -> list[int]:
            return [x + y for x, y in zip_longest(a, b, fillvalue=0)]

        return SpecCounts(
            target_forward_passes=self.target_forward_passes + other.target_forward_passes,
            committed=self.committed + other.committed,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            drafted_at=add_lists(self.drafted_at, other.drafted_at),
            accepted_at=add_lists(self.accepted_at, other.accepted_at),
            draft_seconds=self.draft_seconds + other.draft_seconds,
            verify_seconds=self.verify_seconds + other.verify_seconds,
        )


@dataclass
class Turn:
    """One generation: the answer to one user turn (or to a completion prompt)."""

    prompt_tokens: int
    token_ids: list[int]
    seconds: float
    """Wall time of the whole generation, prefill included, measured around the call."""
    counts: SpecCounts | None = None
    text: str = ""


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
        )
