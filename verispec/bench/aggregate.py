"""From per-prompt records to the numbers in the tables: one :class:`Summary` per method and group.

Definitions, as Spec-Bench computes them:
- tokens/s of a method on a group = the *mean over prompts* of each prompt's tokens/s (new tokens of
  all its turns over the wall time of all its turns, prefill included);
- speedup = that mean divided by the same mean for plain decoding (``none``) on the same prompts in
  the same run;
- acceptance rate, mean accepted length (tau) and per-position acceptance pool the counts of every
  step of every prompt in the group (ratios of sums, so long generations weigh by their steps).

A group is a ``dataset/category`` or ``overall`` (every prompt of the run).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import fmean
from typing import Any

from verispec.bench.records import PromptRecord, SpecCounts
from verispec.bench.settings import PLAIN

OVERALL = "overall"


@dataclass(frozen=True)
class Summary:
    """One row of the results table: a method on a group of prompts."""

    method: str
    group: str
    prompts: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float | None
    """Over plain decoding (``none``) on the same prompts; None when ``none`` did not run them."""
    acceptance_rate: float | None
    """accepted / drafted; None when nothing was drafted (plain) or not counted (baselines)."""
    mean_accepted_length: float | None
    per_position_acceptance: list[float] | None
    time_split: dict[str, float] | None
    """Seconds spent drafting, verifying (target forward + verifier + commit) and on everything else."""
    reference: str | None
    """The plain decoding these outputs were compared with (the lossless check)."""
    speedup_over_reference: float | None
    """tokens/s over ``reference``'s, when that is another backend's plain decoding (e.g. hf)."""
    lossless_checked: int
    lossless_mismatches: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: list[PromptRecord]) -> list[Summary]:
    """One summary per (method, group), methods and groups in the order they first appear."""
    methods = list(dict.fromkeys(r.method for r in records))
    groups = [*dict.fromkeys(r.group for r in records), OVERALL]
    by_key = {(r.method, r.dataset, r.category, r.prompt_id): r for r in records}
    out = []
    for method in methods:
        for group in groups:
            rows = [r for r in records if r.method == method and group in (OVERALL, r.group)]
            if rows:
                out.append(_summary(method, group, rows, by_key))
    return out


def _mean_tps(rows: list[PromptRecord]) -> float:
    return fmean(r.tokens_per_second for r in rows)


def _ratio_over(method: str, rows: list[PromptRecord], by_key: dict) -> float | None:
    """Mean tokens/s of ``rows`` over that of ``method`` on exactly the same prompts."""
    others = [by_key.get((method, r.dataset, r.category, r.prompt_id)) for r in rows]
    if any(o is None for o in others):
        return None
    base = _mean_tps(others)  # type: ignore[arg-type]
    return _mean_tps(rows) / base if base > 0 else None


def _summary(method: str, group: str, rows: list[PromptRecord], by_key: dict) -> Summary:
    checked = [r for r in rows if r.matches_reference is not None]
    references = Counter(r.reference for r in checked)
    reference = references.most_common(1)[0][0] if references else None
    seconds = sum(r.seconds for r in rows)
    return Summary(
        method=method,
        group=group,
        prompts=len(rows),
        output_tokens=sum(r.output_tokens for r in rows),
        seconds=seconds,
        tokens_per_second=_mean_tps(rows),
        speedup=_ratio_over(PLAIN, rows, by_key),
        **_speculation(pooled([r.counts for r in rows]), seconds),
        reference=reference,
        speedup_over_reference=(
            _ratio_over(reference, rows, by_key) if reference not in (None, PLAIN, method) else None
        ),
        lossless_checked=len(checked),
        lossless_mismatches=sum(1 for r in checked if not r.matches_reference),
    )


def _speculation(counts: SpecCounts | None, seconds: float) -> dict[str, Any]:
    """Acceptance, tau, per-position acceptance and the time split; None where nothing was counted."""
    if counts is None:
        return dict(
            acceptance_rate=None, mean_accepted_length=None, per_position_acceptance=None, time_split=None
        )
    stats = counts.to_stats()
    return dict(
        acceptance_rate=stats.acceptance_rate if stats.num_drafted else None,
        mean_accepted_length=stats.mean_accepted_length if stats.num_steps else None,
        per_position_acceptance=stats.per_position_acceptance,
        time_split={
            "draft": counts.draft_seconds,
            "verify": counts.verify_seconds,
            "other": max(0.0, seconds - counts.draft_seconds - counts.verify_seconds),
        },
    )


def pooled(counts: Sequence[SpecCounts | None]) -> SpecCounts | None:
    """Sum of the counts, or None if any record has none (a method without speculation counters)."""
    if not counts or any(c is None for c in counts):
        return None
    total = SpecCounts()
    for c in counts:
        total = total + c  # type: ignore[operator]
    return total
