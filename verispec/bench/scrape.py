"""The server's ``/metrics`` as numbers: a Prometheus text parser and the deltas a benchmark needs.

Counters only grow, so what happened during one level is the difference of two scrapes taken
before and after it (the server runs nothing else meanwhile). Parsing here, rather than with
``prometheus_client``'s parser, keeps the benchmark free of the server's dependencies and makes
the few rules explicit: a sample is ``name{labels} value``; a name with several label sets sums
over them unless labels are given.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

DRAFTED = "verispec_draft_tokens_total"
ACCEPTED = "verispec_accepted_tokens_total"
SEQUENCE_STEPS = "verispec_sequence_steps_total"
DEPTH_SUM = "verispec_step_depth_sum"
DEPTH_COUNT = "verispec_step_depth_count"
BATCH_SIZE = "verispec_batch_size"
WAITING = "verispec_waiting_requests"
FINISHED = "verispec_requests_finished_total"


Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """One ``/metrics`` answer: ``samples[(name, labels)] = value`` with labels sorted by name."""

    samples: dict[tuple[str, Labels], float]

    def get(self, name: str, **labels: str) -> float | None:
        """The sum of ``name`` over the samples whose labels include ``labels``; None if there are none."""
        wanted = set(labels.items())
        values = [v for (n, ls), v in self.samples.items() if n == name and wanted <= set(ls)]
        return sum(values) if values else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: sample value}`` of ``name`` (e.g. finished requests by reason)."""
        out: dict[str, float] = {}
        for (n, labels), value in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out


def parse_metrics(text: str) -> Scrape:
    """Parse the Prometheus text format (comments and unparsable lines are skipped)."""
    samples: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, raw_labels, raw_value = match.groups()
        try:
            value = float(raw_value)
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(raw_labels or "")))
        samples[(name, labels)] = value
    return Scrape(samples)


@dataclass(frozen=True)
class SpecDelta:
    """What the server's counters say about the steps between two scrapes."""

    drafted: float | None
    accepted: float | None
    sequence_steps: float | None
    mean_depth: float | None
    """Draft tokens per sequence and step: the depth the policy chose, averaged (0 = plain)."""

    @property
    def acceptance_rate(self) -> float | None:
        if self.drafted is None or self.accepted is None or self.drafted <= 0:
            return None
        return self.accepted / self.drafted

    def to_dict(self) -> dict[str, float | None]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "sequence_steps": self.sequence_steps,
            "mean_depth": self.mean_depth,
            "acceptance_rate": self.acceptance_rate,
        }


def spec_delta(before: Scrape, after: Scrape) -> SpecDelta:
    """Draft/accept counts and mean depth between two scrapes.

    The depth comes from the per-sequence depth histogram (sum / count) where the server exposes it,
    else from drafted tokens per sequence-step; None when neither moved.
    """

    def diff(name: str) -> float | None:
        a, b = before.get(name), after.get(name)
        return None if a is None or b is None else b - a

    drafted, accepted, steps = diff(DRAFTED), diff(ACCEPTED), diff(SEQUENCE_STEPS)
    depth_sum, depth_count = diff(DEPTH_SUM), diff(DEPTH_COUNT)
    depth: float | None = None
    if depth_sum is not None and depth_count:
        depth = depth_sum / depth_count
    elif drafted is not None and steps:
        depth = drafted / steps
    if depth is not None and not math.isfinite(depth):
        depth = None
    return SpecDelta(drafted, accepted, steps, depth)
