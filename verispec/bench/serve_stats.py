"""Numbers of the serving benchmark: one level's statistics and their spread over repeats.

Definitions (also in the report's legend):

- throughput: output tokens of all successful requests / the level's wall time (first request sent
  to last one done), so queueing, prefill and the level's ramp-down all count;
- TTFT: client-side time from sending a request to its first token chunk; per turn too, where
  conversations run turn by turn (turn 2 onwards resends the conversation, so a prefix cache shortens
  its prefill);
- per-user tok/s: a request's output tokens / its whole time (what one user experiences); the
  decode rate leaves out the time to the first token;
- depth: draft tokens per sequence and step while the level ran, from the server's counters.

Repeats of a level give its noise: the mean and the sample standard deviation of each number over
the repeats (None for one repeat: one value says nothing about noise).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from verispec.bench.load import LevelRun
from verispec.bench.scrape import SpecDelta


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def stdev(values: Iterable[float | None]) -> float | None:
    """Sample standard deviation (n - 1) of the values that are not None; None for fewer than two."""
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return None
    m = sum(present) / len(present)
    return math.sqrt(sum((v - m) ** 2 for v in present) / (len(present) - 1))


@dataclass(frozen=True)
class LevelStats:
    """One run of one concurrency level."""

    policy: str
    concurrency: int
    repeat: int
    requests: int
    failed: int
    output_tokens: int
    wall_seconds: float
    throughput: float
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    user_tps_mean: float | None
    decode_tps_mean: float | None
    mean_depth: float | None
    acceptance_rate: float | None
    depth_source: str
    """``metrics`` (the server's counters), ``usage`` (the requests' own stats) or ``none``."""
    conversations: int = 0
    """Conversations the level ran (each one request per turn sent; ``requests`` counts them all)."""
    ttft_by_turn: dict[int, float | None] = field(default_factory=dict)
    """Mean TTFT of the successful requests of each turn (1-based) of the conversations."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def level_stats(policy: str, repeat: int, run: LevelRun, delta: SpecDelta | None) -> LevelStats:
    """Summarise one level. Only successful requests count towards tokens and latencies."""
    ok = [r for r in run.results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    depth, acceptance, source = _depth(run, delta)
    return LevelStats(
        policy=policy,
        concurrency=run.concurrency,
        repeat=repeat,
        requests=len(run.results),
        failed=len(run.results) - len(ok),
        output_tokens=tokens,
        wall_seconds=run.wall_seconds,
        throughput=tokens / run.wall_seconds if run.wall_seconds > 0 else 0.0,
        ttft_mean=mean(ttfts),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        user_tps_mean=mean(r.tokens_per_second for r in ok),
        decode_tps_mean=mean(r.decode_tokens_per_second for r in ok),
        mean_depth=depth,
        acceptance_rate=acceptance,
        depth_source=source,
        conversations=sum(1 for r in run.results if r.turn == 1),
        ttft_by_turn=_by_turn([(r.turn, r.ttft) for r in ok]),
    )


def _by_turn(pairs: Iterable[tuple[int, float | None]]) -> dict[int, float | None]:
    """The mean of each turn's values, turns in order."""
    turns: dict[int, list[float | None]] = {}
    for turn, value in pairs:
        turns.setdefault(turn, []).append(value)
    return {turn: mean(turns[turn]) for turn in sorted(turns)}


def _depth(run: LevelRun, delta: SpecDelta | None) -> tuple[float | None, float | None, str]:
    """Depth and acceptance from the server's counters, else from the usage chunks' stats
    (drafted tokens per target pass: the prefill pass counts too, so this reads a little low)."""
    if delta is not None and delta.mean_depth is not None:
        return delta.mean_depth, delta.acceptance_rate, "metrics"
    stats = [r.stats for r in run.results if r.ok and r.stats]
    drafted = sum(int(s.get("drafted", 0)) for s in stats)
    accepted = sum(int(s.get("accepted", 0)) for s in stats)
    passes = sum(int(s.get("target_forward_passes", 0)) for s in stats)
    if not passes:
        return None, None, "none"
    return drafted / passes, (accepted / drafted if drafted else None), "usage"


SPREAD_FIELDS = ("throughput", "ttft_mean", "ttft_p50", "ttft_p90", "user_tps_mean", "decode_tps_mean",
                 "mean_depth", "acceptance_rate")  # fmt: skip


@dataclass(frozen=True)
class Spread:
    """A number over the repeats of one level."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)


def spread(values: Sequence[float | None]) -> Spread:
    present = [v for v in values if v is not None]
    return Spread(
        mean(present), stdev(present), min(present) if present else None, max(present) if present else None
    )


@dataclass(frozen=True)
class LevelSummary:
    """One policy at one concurrency, over its repeats."""

    policy: str
    concurrency: int
    repeats: int
    requests: int
    failed: int
    values: dict[str, Spread]
    ttft_by_turn: dict[int, Spread] = field(default_factory=dict)
    """Each turn's mean TTFT over the repeats (turn 1 only where conversations are single requests)."""

    def get(self, name: str) -> float | None:
        return self.values[name].mean

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "concurrency": self.concurrency,
            "repeats": self.repeats,
            "requests": self.requests,
            "failed": self.failed,
            **{name: s.to_dict() for name, s in self.values.items()},
            "ttft_by_turn": {str(turn): s.to_dict() for turn, s in self.ttft_by_turn.items()},
        }


def summarize(levels: Sequence[LevelStats]) -> list[LevelSummary]:
    """One summary per (policy, concurrency), in the order they first appear."""
    groups: dict[tuple[str, int], list[LevelStats]] = {}
    for level in levels:
        groups.setdefault((level.policy, level.concurrency), []).append(level)
    return [
        LevelSummary(
            policy=policy,
            concurrency=concurrency,
            repeats=len(runs),
            requests=sum(r.requests for r in runs),
            failed=sum(r.failed for r in runs),
            values={name: spread([getattr(r, name) for r in runs]) for name in SPREAD_FIELDS},
            ttft_by_turn={
                turn: spread([r.ttft_by_turn.get(turn) for r in runs])
                for turn in sorted({t for r in runs for t in r.ttft_by_turn})
            },
        )
        for (policy, concurrency), runs in groups.items()
    ]
