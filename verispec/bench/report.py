"""A run's outputs: ``results.json`` for machines, ``report.md`` and a printed table for people.

The JSON holds everything needed to recompute every number (per-prompt records with their counts
and timings) plus what is needed to trust them (machine, versions, commit, settings, command). The
report shows the same tables and never hides a failed lossless check, a failed generation or a
skipped baseline. A table per turn index shows what later turns of a conversation gain from what
earlier ones left (a prefix cache makes their time to first token shorter, earlier answers give
drafts).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from statistics import fmean, median
from typing import Any

from verispec.bench.aggregate import Summary
from verispec.bench.environment import describe_busy, describe_cpu
from verispec.bench.harness import BenchRun
from verispec.bench.records import PromptRecord, Turn
from verispec.bench.settings import PLAIN

SCHEMA = "verispec-bench/1"
HEADER = ("method", "category", "prompts", "tok/s", "speedup", "vs ref", "accept", "tau",
          "draft/verify/other", "lossless")  # fmt: skip
TURN_HEADER = ("method", "dataset", "turn", "prompts", "prompt tokens", "cached", "TTFT mean", "TTFT p50",
               "tok/s", "speedup", "decode tok/s", "decode speedup")  # fmt: skip


@dataclass(frozen=True)
class TurnSummary:
    """A method on the ``turn``-th turn (1-based) of every conversation of a dataset that has one."""

    method: str
    dataset: str
    turn: int
    prompts: int
    prompt_tokens: float
    """Mean prompt length at this turn: the whole conversation so far."""
    cached_prompt_tokens: float | None
    """Mean prompt tokens the prefix cache supplied (None: not reported by the contender)."""
    ttft_mean: float | None
    """Mean seconds from submitting the turn to its first token (None: the contender can't tell)."""
    ttft_p50: float | None
    tokens_per_second: float
    """Mean over prompts of this turn's new tokens / its wall time (prefill included)."""
    speedup: float | None
    """tokens/s over plain decoding's (``none``) on the same prompts' same turn."""
    decode_tokens_per_second: float | None = None
    """Tokens after the first over the time after the first, all of the turn's prompts together:
    the decoding speed, without the prefill that the prefix cache shortens (None: no TTFT)."""
    decode_speedup: float | None = None
    """That over plain decoding's on the same prompts' same turn."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def turn_summaries(records: Sequence[PromptRecord]) -> list[TurnSummary]:
    """One :class:`TurnSummary` per (method, dataset, turn), in run order, and one of every turn
    together (turn 0, shown as ``all``); successful records only."""
    turns: dict[tuple[str, str, int], dict[tuple[str, str, int], Turn]] = {}
    for record in records:
        if not record.ok:
            continue
        for index, turn in enumerate(record.turns, 1):
            key = (record.category, record.prompt_id, index)
            turns.setdefault((record.method, record.dataset, index), {})[key] = turn
            turns.setdefault((record.method, record.dataset, 0), {})[key] = turn
    out = []
    for (method, dataset, index), by_prompt in turns.items():
        ttfts = [t.ttft for t in by_prompt.values() if t.ttft is not None]
        cached = [t.cached_prompt_tokens for t in by_prompt.values() if t.cached_prompt_tokens is not None]
        plain = turns.get((PLAIN, dataset, index), {})
        speedup = decode_speedup = None
        decode = _decode_tps(list(by_prompt.values()))
        if method != PLAIN and plain and all(key in plain for key in by_prompt):
            base = _turn_tps([plain[key] for key in by_prompt])
            speedup = _turn_tps(list(by_prompt.values())) / base if base > 0 else None
            base_decode = _decode_tps([plain[key] for key in by_prompt])
            decode_speedup = decode / base_decode if decode and base_decode else None
        out.append(
            TurnSummary(
                method=method,
                dataset=dataset,
                turn=index,
                prompts=len(by_prompt),
                prompt_tokens=fmean(t.prompt_tokens for t in by_prompt.values()),
                cached_prompt_tokens=fmean(cached) if cached else None,
                ttft_mean=fmean(ttfts) if ttfts else None,
                ttft_p50=median(ttfts) if ttfts else None,
                tokens_per_second=_turn_tps(list(by_prompt.values())),
                speedup=1.0 if method == PLAIN else speedup,
                decode_tokens_per_second=decode,
                decode_speedup=1.0 if method == PLAIN and decode else decode_speedup,
            )
        )
    datasets = list(dict.fromkeys(s.dataset for s in out))
    # stable: methods in run order; every turn together after the turns
    return sorted(out, key=lambda s: (datasets.index(s.dataset), s.turn or len(out) + 1))


def _turn_tps(turns: Sequence[Turn]) -> float:
    return fmean(len(t.token_ids) / t.seconds if t.seconds > 0 else 0.0 for t in turns)


def _decode_tps(turns: Sequence[Turn]) -> float | None:
    """Tokens after each turn's first over the time after its first, summed over ``turns``."""
    timed = [t for t in turns if t.ttft is not None and len(t.token_ids) > 1 and t.seconds > t.ttft]
    seconds = sum(t.seconds - (t.ttft or 0.0) for t in timed)
    return sum(len(t.token_ids) - 1 for t in timed) / seconds if seconds > 0 else None


def turn_rows(summaries: Sequence[TurnSummary]) -> list[tuple[str, ...]]:
    """One row of :data:`TURN_HEADER` per turn summary; TTFT in seconds."""
    return [
        (
            s.method,
            s.dataset,
            str(s.turn) if s.turn else "all",
            str(s.prompts),
            f"{s.prompt_tokens:.0f}",
            _num(s.cached_prompt_tokens, "{:.0f}"),
            _num(s.ttft_mean, "{:.3f}"),
            _num(s.ttft_p50, "{:.3f}"),
            f"{s.tokens_per_second:.2f}",
            _num(s.speedup, "{:.2f}x"),
            _num(s.decode_tokens_per_second, "{:.2f}"),
            _num(s.decode_speedup, "{:.2f}x"),
        )
        for s in summaries
    ]


def results_dict(run: BenchRun) -> dict[str, Any]:
    lossless = [s for s in run.summaries if s.group == "overall"]
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": run.command,
        **run.environment,
        "settings": run.settings.to_dict(),
        "models": run.models,
        "contenders": run.contenders,
        "skipped": [{"name": s.name, "reason": s.reason} for s in run.skipped],
        "lossless": {
            "checked": sum(s.lossless_checked for s in lossless),
            "mismatches": sum(s.lossless_mismatches for s in lossless),
        },
        "wall_seconds": run.wall_seconds,
        "resumed_records": run.resumed,
        "failed": [
            {k: getattr(r, k) for k in ("method", "dataset", "category", "prompt_id", "error")}
            for r in run.failed
        ],
        "summary": [s.to_dict() for s in run.summaries],
        "turns": [s.to_dict() for s in turn_summaries(run.records)],
        "records": [r.to_dict() for r in run.records],
    }


def table_rows(summaries: Sequence[Summary]) -> list[tuple[str, ...]]:
    """One row of :data:`HEADER` per summary; "-" where a number does not apply."""
    rows = []
    for s in summaries:
        split = "-"
        if s.time_split is not None and s.seconds > 0:
            split = (
                "/".join(f"{100 * s.time_split[k] / s.seconds:.0f}" for k in ("draft", "verify", "other"))
                + " %"
            )
        rows.append(
            (
                s.method,
                s.group,
                str(s.prompts),
                f"{s.tokens_per_second:.2f}",
                _num(s.speedup, "{:.2f}x"),
                f"{_num(s.speedup_over_reference, '{:.2f}x')} {s.reference}"
                if s.speedup_over_reference
                else "-",
                _num(s.acceptance_rate, "{:.1%}"),
                _num(s.mean_accepted_length, "{:.2f}"),
                split,
                _lossless(s),
            )
        )
    return rows


def text_table(rows: Sequence[Sequence[str]], header: Sequence[str] = HEADER) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [header, tuple("-" * w for w in widths), *rows]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def markdown_table(rows: Sequence[Sequence[str]], header: Sequence[str] = HEADER) -> str:
    lines = [header, tuple("---" for _ in header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def report_markdown(run: BenchRun, plots: Sequence[Path]) -> str:
    s = run.settings
    env = run.environment
    machine = env.get("machine", {})
    versions = env.get("versions", {})
    rows = table_rows(run.summaries)
    overall = [r for r, summary in zip(rows, run.summaries, strict=True) if summary.group == "overall"]
    prompts = len({(r.dataset, r.category, r.prompt_id) for r in run.records if r.ok})
    out = [
        "# verispec bench",
        "",
        "```",
        run.command,
        "```",
        "",
        f"- target: `{s.target}`"
        + (f", draft: `{s.draft}`" if s.draft else "")
        + (f", heads: `{s.heads}`" if s.heads else ""),
        f"- {prompts} prompts from {', '.join(s.datasets)}"
        + (f" (categories {', '.join(s.categories)})" if s.categories else "")
        + (f", first {s.limit_per_category} per category" if s.limit_per_category else ""),
        f"- greedy, batch 1, up to {s.max_new_tokens} new tokens per turn, {s.warmup} warm-up generation(s) "
        f"per method, k = {s.num_speculative_tokens}"
        + (f", tree nodes {s.tree_nodes}" if s.tree_nodes else "")
        + (f", tree width {s.tree_width}" if s.tree_width else "")
        + (
            ", JSON mode (every answer under `settings.json_schema` of results.json)" if s.json_schema else ""
        ),
        f"- cache scope: {s.cache_scope} ("
        + (
            "each method's requests share one scope: later prompts and turns may reuse earlier ones'"
            if s.cache_scope == "shared"
            else "nothing reused across requests"
        )
        + ")",
        f"- machine: {describe_cpu(machine)}, {machine.get('ram_gb')} GB RAM, "
        f"torch threads: {machine.get('torch_threads')}, load average {_load(machine)}",
        *_busy_warning(machine),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        f"- git commit: {env.get('git_commit') or 'none (not a git checkout with a commit)'}",
        f"- wall time of the run: {run.wall_seconds:.0f} s"
        + (f" (resumed: {run.resumed} generations measured by an earlier process)" if run.resumed else ""),
        "",
        "## Overall",
        "",
        markdown_table(overall),
        "",
        "## Per category",
        "",
        markdown_table(rows),
        "",
        _legend(),
        "",
        "## Per turn",
        "",
        markdown_table(turn_rows(turn_summaries(run.records)), TURN_HEADER),
        "",
        "Turn n of every conversation that has one. cached: mean prompt tokens the prefix cache supplied "
        "instead of a prefill. TTFT: seconds from submitting the turn to its first "
        "token (verispec's methods; '-' for other tools). tok/s: mean over prompts of the turn's new tokens "
        "/ its wall time. speedup: over `none` on the same turns. decode tok/s: tokens after the first over "
        "the time after the first, all prompts together (the decoding speed, without the prefill). "
        "Turn `all`: every turn together.",
        "",
        "## Lossless check",
        "",
        *_lossless_section(run),
        "",
    ]
    if run.failed:
        out += [
            "## Failed generations",
            "",
            "Not in any table above:",
            "",
            *(f"- **{r.method}** on {r.dataset} {r.prompt_id} ({r.category}): {r.error}" for r in run.failed),
            "",
        ]
    if run.skipped:
        out += ["## Skipped", "", *(f"- **{k.name}**: {k.reason}" for k in run.skipped), ""]
    out += ["## Contenders", "", *(f"- **{n}**: {_describe(d)}" for n, d in run.contenders.items()), ""]
    if plots:
        out += ["## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots), ""]
    return "\n".join(out)


def write_outputs(run: BenchRun, out_dir: Path, plots: Sequence[Path]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.json"
    results.write_text(json.dumps(results_dict(run), indent=1) + "\n")
    report = out_dir / "report.md"
    report.write_text(report_markdown(run, plots))
    return results, report


def _load(machine: dict[str, Any]) -> str:
    start, end = machine.get("load_average"), machine.get("load_average_end")
    before, after = (x[0] if x else "?" for x in (start, end))
    return f"{before} before the run, {after} at its end (1 min; this run included){describe_busy(machine)}"


def _busy_warning(machine: dict[str, Any]) -> list[str]:
    """A visible caveat when other work shared the CPU: the timings are then noisy and uneven.
    Judged by what other processes used in the second before the run (``cpu_busy``); results
    written before that reading existed fall back to the 1-minute load average, which lags."""
    cores = machine.get("cores") or 0
    busy, start = machine.get("cpu_busy"), machine.get("load_average")
    if busy is not None:
        why = f"other processes used {busy:.0%} of its CPU time in the second before the run"
        warn = busy > 0.25
    else:
        why = f"load average {start[0] if start else '?'} on {cores} cores"
        warn = bool(cores and start and start[0] > 0.5 * cores)
    if warn:
        return [
            f"- **warning**: the machine was busy before the run ({why}); "
            "other processes slow some generations more than others, so treat these timings as noisy"
        ]
    return []


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _lossless(s: Summary) -> str:
    if not s.lossless_checked:
        return "-"
    if s.lossless_mismatches == 0:
        return f"ok {s.lossless_checked}/{s.lossless_checked}"
    return f"{s.lossless_mismatches}/{s.lossless_checked} DIFFER"


def _legend() -> str:
    return (
        "tok/s: mean over prompts of new tokens / wall time (prefill included, all turns). "
        "speedup: over `none` (verispec plain decoding) on the same prompts in this run. "
        "vs ref: over the plain decoding of the same library. "
        "accept: accepted / drafted tokens. tau: tokens committed per target forward pass (bonus included). "
        "draft/verify/other: share of wall time. "
        "lossless: outputs equal to the reference's, token for token. "
        "Contenders run interleaved, prompt by prompt, after their warm-up generations."
    )


def _lossless_section(run: BenchRun) -> list[str]:
    measured = [r for r in run.records if r.ok]
    checked = [r for r in measured if r.matches_reference is not None]
    bad = [r for r in checked if not r.matches_reference]
    lines = [
        f"{len(checked) - len(bad)} of {len(checked)} checked outputs equal their reference's greedy output."
    ]
    unchecked = sorted({r.method for r in measured if r.matches_reference is None and r.method != "none"})
    if unchecked:
        lines.append(f"Not checked (no comparable plain decoding): {', '.join(unchecked)}.")
    for r in bad:
        lines.append(
            f"- **MISMATCH** {r.method} vs {r.reference} on {r.dataset} {r.prompt_id} ({r.category}): "
            f"first differing token at output position {r.first_mismatch}"
        )
    return lines


def _describe(description: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in description.items() if v is not None)
