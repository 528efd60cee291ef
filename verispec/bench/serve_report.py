"""``report.md``, the printed table and the PNG plots of ``verispec bench serve``.

Every number is shown with its spread over the repeats (``mean ± std``) where there were several,
because at small concurrency on a shared CPU the difference between two policies can be smaller
than the noise, and a table without the noise invites reading it as a result.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verispec.bench.environment import describe_busy, describe_cpu
from verispec.bench.replies import ReplyCheck
from verispec.bench.report import markdown_table
from verispec.bench.serve_stats import LevelSummary, Spread

PLAIN_POLICY = "plain"
HEADER = ("policy", "users", "tok/s", "vs plain", "TTFT mean", "TTFT p50", "TTFT p90", "user tok/s",
          "decode tok/s", "depth", "accept", "failed")  # fmt: skip


def _fmt(s: Spread, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    if s.mean is None:
        return "-"
    out = fmt.format(s.mean * scale)
    if s.std is not None:
        out += " ± " + fmt.format(s.std * scale)
    return out


def _ratio(summary: LevelSummary, plain: dict[int, LevelSummary]) -> str:
    base = plain.get(summary.concurrency)
    value = summary.get("throughput")
    if base is None or summary.policy == PLAIN_POLICY or value is None or not base.get("throughput"):
        return "-"
    return f"{value / base.get('throughput'):.2f}x"  # type: ignore[operator]


def table_rows(summaries: Sequence[LevelSummary]) -> list[tuple[str, ...]]:
    """One row of :data:`HEADER` per (policy, concurrency); latencies in seconds."""
    plain = {s.concurrency: s for s in summaries if s.policy == PLAIN_POLICY}
    rows = []
    for s in summaries:
        v = s.values
        rows.append(
            (
                s.policy,
                str(s.concurrency),
                _fmt(v["throughput"]),
                _ratio(s, plain),
                _fmt(v["ttft_mean"], "{:.3f}"),
                _fmt(v["ttft_p50"], "{:.3f}"),
                _fmt(v["ttft_p90"], "{:.3f}"),
                _fmt(v["user_tps_mean"]),
                _fmt(v["decode_tps_mean"]),
                _fmt(v["mean_depth"]),
                _fmt(v["acceptance_rate"], "{:.1f}%", 100.0),
                f"{s.failed}/{s.requests}",
            )
        )
    return rows


def turn_table(summaries: Sequence[LevelSummary]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The mean TTFT of each turn, per (policy, concurrency): the header (``turn 1`` .. ``turn N``)
    and the rows, in seconds, '-' where no conversation of that level reached the turn."""
    turns = sorted({turn for s in summaries for turn in s.ttft_by_turn})
    header = ("policy", "users", *(f"turn {turn}" for turn in turns))
    rows = [
        (
            s.policy,
            str(s.concurrency),
            *(_fmt(s.ttft_by_turn[t], "{:.3f}") if t in s.ttft_by_turn else "-" for t in turns),
        )
        for s in summaries
    ]
    return header, rows


def _multi_turn(summaries: Sequence[LevelSummary]) -> bool:
    return any(len(s.ttft_by_turn) > 1 for s in summaries)


LEGEND = (
    "tok/s: throughput, output tokens of all requests of a level / its wall time (first request sent to "
    "last done). vs plain: throughput over the plain server's at the same number of users. TTFT: seconds "
    "from sending a request to its first token, client side (queueing and prefill included). user tok/s: "
    "mean over requests of output tokens / request time; decode tok/s: the same after the first token. "
    "depth: draft tokens per sequence and step (server counters). accept: accepted / drafted. "
    "`a ± b`: mean and sample standard deviation over the repeats."
)


def report_markdown(results: dict[str, Any], summaries: Sequence[LevelSummary], plots: Sequence[Path]) -> str:
    """The whole report: how the run was made, one table, the servers and the plots."""
    s = results["settings"]
    machine = results.get("machine", {})
    versions = results.get("versions", {})
    out = [
        "# verispec bench serve",
        "",
        "```",
        results["command"],
        "```",
        "",
        f"- target: `{s['target']}`"
        + (f", draft: `{s['draft']}`" if s.get("draft") else "")
        + f", method {s['method']}, k = {s['num_speculative_tokens']}",
        f"- {_requests(s)} streaming {_unit(s)} per level (greedy, max_tokens {s['max_tokens']}) "
        f"from {s['dataset']}, {_turns(s)}; {s['repeats']} repeat(s) per level; "
        f"{s['warmup']} warm-up {_unit(s)} per server",
        f"- cache scope: {_scope(s)}",
        f"- closed loop: each of N users sends its next request when the last one ends; server "
        f"--max-batch-size {s['max_batch_size']}",
        f"- plain: {s['plain_is']}",
        f"- machine: {describe_cpu(machine)}, server threads "
        f"{s.get('threads') or 'default'}; load average {machine.get('load_average')} at the start, "
        f"{machine.get('load_average_end')} at the end{describe_busy(machine)}",
        "- the load generator runs on the same machine as the server and takes some of its CPU",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        f"- git commit: {results.get('git_commit') or 'none'}",
        f"- wall time: {results['wall_seconds']:.0f} s",
        "",
        "## Results",
        "",
        markdown_table(table_rows(summaries), HEADER),
        "",
        LEGEND,
        "",
        *_turn_section(summaries),
        "## Servers",
        "",
    ]
    for server in results["servers"]:
        peak = server.get("rss_peak_mb")
        out.append(
            f"- **{server['policy']}**: `{' '.join(server['args'])}`; healthy after "
            f"{server['startup_seconds']:.1f} s, peak RSS {f'{peak:.0f} MB' if peak else 'unknown'}"
        )
    checks = [ReplyCheck(**c) for c in results.get("replies", [])]
    if checks:
        out += [
            "",
            "## Replies",
            "",
            "Greedy and lossless: the same turn must come back as the same text.",
            "",
        ]
        out += [f"- {c.line()}" for c in checks]
    failed = sum(level["failed"] for level in results["levels"])
    if failed:
        out += [
            "",
            f"**{failed} request(s) failed**: not counted in any number above; their errors are "
            "in results.json (`levels[].requests[].error`).",
        ]
    if plots:
        out += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n".join(out) + "\n"


def _turn_section(summaries: Sequence[LevelSummary]) -> list[str]:
    if not _multi_turn(summaries):
        return []
    header, rows = turn_table(summaries)
    return [
        "## Time to first token by turn",
        "",
        markdown_table(rows, header),
        "",
        "Mean seconds from sending turn n's request (the whole conversation so far) to its first token; "
        "from turn 2 on, a prefix cache can skip the prefill of what earlier turns already computed.",
        "",
    ]


def _unit(settings: dict[str, Any]) -> str:
    return "conversations (a request per turn)" if settings.get("turns") == "all" else "requests"


def _turns(settings: dict[str, Any]) -> str:
    if settings.get("turns") == "all":
        return "every turn, each request carrying the whole conversation so far"
    return "first user turn only"


def _scope(settings: dict[str, Any]) -> str:
    if settings.get("cache_scope") == "private":
        return "private (the servers share no cached prompts or outputs between requests)"
    how = "the API key's tenant" if settings.get("api_key") else "servers started with --shared-cache"
    return f"shared within each level ({how}; each level names its own OpenAI `user`)"


def _requests(settings: dict[str, Any]) -> str:
    if settings.get("requests_per_level"):
        return str(settings["requests_per_level"])
    return "max(12, 2 x users)"


def write_plots(summaries: Sequence[LevelSummary], out_dir: Path, title: str) -> list[Path]:
    """``throughput.png``, ``user_tps.png`` and ``ttft.png``: one line per policy over concurrency."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _lines(summaries, "throughput", "throughput (output tokens/s)", out_dir / "throughput.png", title),
        _lines(summaries, "user_tps_mean", "per-user tokens/s", out_dir / "user_tps.png", title),
        _lines(summaries, "ttft_mean", "mean time to first token (s)", out_dir / "ttft.png", title),
    ]


def _lines(summaries: Sequence[LevelSummary], name: str, label: str, path: Path, title: str) -> Path:
    from verispec.bench.plots import _figure, save_figure

    figure = _figure()
    ax = figure.add_subplot()
    policies = list(dict.fromkeys(s.policy for s in summaries))
    for policy in policies:
        points = [
            (s.concurrency, s.values[name])
            for s in summaries
            if s.policy == policy and s.values[name].mean is not None
        ]
        if not points:
            continue
        xs = [x for x, _ in points]
        ys = [p.mean for _, p in points]
        errors = [p.std or 0.0 for _, p in points]
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=policy)
    concurrencies = sorted({s.concurrency for s in summaries})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies)
    ax.set_xticklabels([str(c) for c in concurrencies])
    ax.set_xlabel("concurrent users")
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    return save_figure(figure, ax, path, drawn=bool(policies))
