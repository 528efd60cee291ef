"""``verispec bench serve`` and ``bench soak``: the pure parts on synthetic data (statistics, metrics
parsing, SSE handling through a mock transport, report, plots, the server process's life cycle), and
both commands end to end on SmolLM2-135M with real ``verispec serve`` processes."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import needs_smollm2
from verispec.bench.datasets import BenchPrompt
from verispec.bench.load import LevelRun, RequestResult, RequestSpec, request_body, run_level, send
from verispec.bench.scrape import parse_metrics, spec_delta
from verispec.bench.serve import ServeBenchSettings, pick_prompts
from verispec.bench.serve_report import HEADER, report_markdown, table_rows, write_plots
from verispec.bench.serve_stats import level_stats, mean, percentile, stdev, summarize
from verispec.bench.server_proc import ServerProcess, rss_bytes
from verispec.bench.soak import (
    Observed,
    SoakSettings,
    count_outcomes,
    finished_check,
    is_settled,
    judge,
    rss_check,
    soak_specs,
    summary,
)
from verispec.cli import main
from verispec.errors import VerispecError

CHAT = BenchPrompt("spec_bench", "qa", "7", ["What is 2 + 2?", "And 3 + 3?"], chat=True)
CODE = BenchPrompt("humaneval", "code", "HumanEval/0", ["def f():\n"], chat=False)

# ------------------------------------------------------------------------------------------ stats


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 90) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_mean_and_stdev_skip_missing_values_and_need_two_for_a_spread() -> None:
    assert mean([1.0, None, 3.0]) == 2.0
    assert mean([None]) is None
    assert stdev([2.0, 4.0, None]) == pytest.approx(2**0.5)
    assert stdev([2.0]) is None


def result(
    tokens: int, seconds: float, ttft: float, ok: bool = True, stats: dict | None = None
) -> RequestResult:
    return RequestResult("1", "qa", ok=ok, ttft=ttft, seconds=seconds, output_tokens=tokens, stats=stats)


def test_level_stats_count_only_successful_requests() -> None:
    run = LevelRun(2, 4.0, [result(10, 2.0, 0.5), result(30, 4.0, 1.5), result(99, 1.0, 0.1, ok=False)])
    s = level_stats("fixed", 0, run, None)
    assert (s.requests, s.failed, s.output_tokens) == (3, 1, 40)
    assert s.throughput == 10.0  # 40 tokens / 4 s of wall time
    assert s.ttft_mean == 1.0 and s.ttft_p50 == 1.0 and s.ttft_p90 == pytest.approx(1.4)
    assert s.user_tps_mean == pytest.approx((5.0 + 7.5) / 2)
    assert s.decode_tps_mean == pytest.approx((9 / 1.5 + 29 / 2.5) / 2)
    assert (s.mean_depth, s.depth_source) == (None, "none")


def test_depth_comes_from_the_server_counters_else_from_the_usage_stats() -> None:
    stats = {"drafted": 12, "accepted": 6, "target_forward_passes": 4}
    run = LevelRun(1, 1.0, [result(10, 1.0, 0.1, stats=stats)])
    from_usage = level_stats("adaptive", 0, run, None)
    assert (from_usage.mean_depth, from_usage.acceptance_rate, from_usage.depth_source) == (3.0, 0.5, "usage")
    before = parse_metrics("verispec_step_depth_sum 10\nverispec_step_depth_count 5\n")
    after = parse_metrics("verispec_step_depth_sum 40\nverispec_step_depth_count 15\n")
    from_metrics = level_stats("adaptive", 0, run, spec_delta(before, after))
    assert (from_metrics.mean_depth, from_metrics.depth_source) == (3.0, "metrics")


def test_summaries_give_the_spread_over_repeats_and_the_table_shows_it() -> None:
    levels = [
        level_stats("plain", r, LevelRun(1, 1.0, [result(tokens, 1.0, 0.2)]), None)
        for r, tokens in enumerate((10, 12))
    ]
    levels.append(level_stats("fixed", 0, LevelRun(1, 1.0, [result(22, 1.0, 0.1)]), None))
    summaries = summarize(levels)
    assert [(s.policy, s.repeats) for s in summaries] == [("plain", 2), ("fixed", 1)]
    throughput = summaries[0].values["throughput"]
    assert (throughput.mean, throughput.min, throughput.max) == (11.0, 10.0, 12.0)
    assert throughput.std == pytest.approx(2**0.5)
    rows = table_rows(summaries)
    assert all(len(row) == len(HEADER) for row in rows)
    assert rows[0][2] == "11.00 ± 1.41" and rows[0][3] == "-"
    assert rows[1][2] == "22.00" and rows[1][3] == "2.00x"  # no spread from one repeat; ratio to plain


# --------------------------------------------------------------------------------------- /metrics

METRICS = textwrap.dedent(
    """\
    # HELP verispec_draft_tokens_total Draft tokens proposed
    # TYPE verispec_draft_tokens_total counter
    verispec_draft_tokens_total 120.0
    verispec_accepted_tokens_total 60.0
    verispec_sequence_steps_total 40.0
    verispec_batch_size 0.0
    verispec_requests_finished_total{reason="length"} 7.0
    verispec_requests_finished_total{reason="aborted"} 2.0
    verispec_requests_total{endpoint="/v1/chat/completions",status="200"} 9.0 1700000000
    not a sample
    """
)


def test_metrics_parser_reads_labels_and_sums_over_them() -> None:
    m = parse_metrics(METRICS)
    assert m.get("verispec_draft_tokens_total") == 120.0
    assert m.get("verispec_requests_finished_total") == 9.0
    assert m.get("verispec_requests_finished_total", reason="aborted") == 2.0
    assert m.by_label("verispec_requests_finished_total", "reason") == {"length": 7.0, "aborted": 2.0}
    assert m.get("verispec_requests_total", status="200") == 9.0  # a timestamp after the value is allowed
    assert m.get("verispec_missing") is None


def test_spec_delta_without_a_depth_histogram_uses_drafted_per_sequence_step() -> None:
    before = parse_metrics(METRICS)
    after = parse_metrics(
        METRICS.replace("120.0", "180.0")
        .replace("60.0", "90.0")
        .replace("steps_total 40.0", "steps_total 60.0")
    )
    delta = spec_delta(before, after)
    assert (delta.drafted, delta.accepted, delta.sequence_steps) == (60.0, 30.0, 20.0)
    assert delta.mean_depth == 3.0 and delta.acceptance_rate == 0.5
    assert spec_delta(before, before).mean_depth is None  # nothing ran: no depth, not 0


# ------------------------------------------------------------------------------------ SSE client


def test_request_body_sends_chat_prompts_as_their_first_turn_and_code_raw() -> None:
    path, body = request_body(RequestSpec(CHAT, 16, speculation={"enabled": False}))
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert body["temperature"] == 0.0 and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["speculation"] == {"enabled": False} and "model" not in body
    path, body = request_body(RequestSpec(CODE, 16), model="m")
    assert (path, body["prompt"], body["model"]) == ("/v1/completions", "def f():\n", "m")


def chat_chunk(content: str, token_id: int | None, finish: str | None = None, draft: bool = False) -> dict:
    chunk: dict = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}
    if token_id is not None:
        chunk["verispec"] = {"from_draft": draft, "token_id": token_id}
    return chunk


USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    "verispec": {"stats": {"drafted": 4, "accepted": 2, "target_forward_passes": 2}},
}


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def fake_client(body: bytes, status: int = 200, delay: float = 0.0) -> httpx.AsyncClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(delay)
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test")


def send_to(body: bytes, spec: RequestSpec | None = None, status: int = 200) -> RequestResult:
    async def go() -> RequestResult:
        async with fake_client(body, status) as client:
            return await send(client, spec or RequestSpec(CHAT, 8))

    return asyncio.run(go())


def test_a_complete_stream_counts_tokens_from_usage_and_skips_the_role_chunk_for_ttft() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    body = sse(role, chat_chunk("Hi", 1), chat_chunk(" there", 2, draft=True), chat_chunk("", 3, "length"))
    r = send_to(body + sse(USAGE, "[DONE]"))
    assert r.ok and not r.disconnected and r.error is None
    assert (r.output_tokens, r.token_chunks, r.draft_tokens, r.finish_reason) == (3, 3, 1, "length")
    assert r.stats == USAGE["verispec"]["stats"] and r.ttft is not None and r.status == 200


def test_a_stream_without_done_or_finish_reason_is_a_lost_request() -> None:
    no_done = send_to(sse(chat_chunk("a", 1, "stop")))
    assert not no_done.ok and "[DONE]" in (no_done.error or "")
    no_finish = send_to(sse(chat_chunk("a", 1), "[DONE]"))
    assert not no_finish.ok and "finish_reason None" in (no_finish.error or "")


def test_an_error_event_or_status_fails_the_request_with_its_message() -> None:
    event = send_to(sse(chat_chunk("a", 1), {"error": {"message": "engine stopped"}}, "[DONE]"))
    assert not event.ok and event.error == "engine stopped" and event.output_tokens == 1
    refused = send_to(b'{"error": {"message": "queue full"}}', status=429)
    assert not refused.ok and refused.status == 429 and "queue full" in (refused.error or "")


def test_a_client_that_hangs_up_early_is_marked_disconnected_not_lost() -> None:
    tokens = [chat_chunk(str(i), i) for i in range(5)] + [chat_chunk("x", 9, "length")]
    r = send_to(sse(*tokens, USAGE, "[DONE]"), RequestSpec(CHAT, 8, disconnect_after=2))
    assert r.ok and r.disconnected and r.token_chunks == 2 and r.output_tokens == 2
    # a hang-up planned after the last token is no hang-up: the request simply finished
    late = send_to(
        sse(chat_chunk("a", 1, "length"), USAGE, "[DONE]"), RequestSpec(CHAT, 8, disconnect_after=1)
    )
    assert late.ok and not late.disconnected


def test_run_level_keeps_concurrency_users_busy_and_returns_results_in_order() -> None:
    """Counts requests in flight at the server rather than timing the run, which flakes on a busy CI
    machine: three users must have three requests open at once, and never a fourth."""
    body = sse(chat_chunk("a", 1, "length"), USAGE, "[DONE]")
    prompts = [BenchPrompt("d", "c", str(i), ["p"], chat=True) for i in range(6)]
    in_flight, peak, served = 0, 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak, served
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        served += 1
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> LevelRun:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await run_level(client, [RequestSpec(p, 4) for p in prompts], 3)

    run = asyncio.run(go())
    assert [r.prompt_id for r in run.results] == [str(i) for i in range(6)]
    assert all(r.ok for r in run.results) and run.concurrency == 3
    assert (peak, served, in_flight) == (3, 6, 0) and run.wall_seconds > 0


# ---------------------------------------------------------------------------------- settings


def test_plain_is_a_server_without_speculation_and_the_others_set_their_depth_policy() -> None:
    s = ServeBenchSettings(target="t", draft="d", num_speculative_tokens=4, concurrency=(1, 4), threads=2)
    plain = s.server_args_for("plain")
    assert "--draft" not in plain and plain[plain.index("--method") + 1] == "none"
    assert plain[plain.index("--max-batch-size") + 1] == "4"  # every user of the top level decodes at once
    fixed = s.server_args_for("fixed")
    assert fixed[fixed.index("--depth-policy") + 1] == "fixed" and fixed[fixed.index("-k") + 1] == "4"
    assert fixed[fixed.index("--method") + 1] == "draft" and fixed[fixed.index("--draft") + 1] == "d"
    adaptive = s.server_args_for("adaptive")
    assert adaptive[adaptive.index("--depth-policy") + 1] == "adaptive"
    assert ServeBenchSettings(target="t").speculative_method == "ngram"
    heads = ServeBenchSettings(target="t", method="eagle+suffix").server_args_for("adaptive")
    assert heads[heads.index("--method") + 1] == "eagle+suffix"  # the default setup, served


def test_every_prefix_of_the_prompt_list_mixes_the_categories(tmp_path: Path) -> None:
    rows = [
        {"question_id": i, "category": category, "turns": [f"{category} {i}"]}
        for i, category in enumerate(["qa"] * 6 + ["rag"] * 3 + ["translation"] * 3)
    ]
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    prompts = pick_prompts("spec_bench", 14, data_dir=tmp_path, seed=1)
    assert [p.category for p in prompts[:6]] == ["qa", "rag", "translation"] * 2
    assert len({p.id for p in prompts[:12]}) == 12 and prompts[12] == prompts[0]  # all of them, then again
    assert prompts == pick_prompts("spec_bench", 14, data_dir=tmp_path, seed=1)
    assert prompts != pick_prompts("spec_bench", 14, data_dir=tmp_path, seed=2)
    assert all(
        p.category == "rag" for p in pick_prompts("spec_bench", 4, data_dir=tmp_path, categories=["rag"])
    )


def test_requests_per_level_default_to_two_per_user_and_at_least_a_dozen() -> None:
    auto = ServeBenchSettings(target="t")
    assert [auto.requests_at(c) for c in (1, 4, 8, 16)] == [12, 12, 16, 32]
    assert ServeBenchSettings(target="t", requests_per_level=5).requests_at(16) == 5


@pytest.mark.parametrize(
    "bad",
    [
        {"policies": ("plain", "greedy")},
        {"concurrency": (0, 2)},
        {"requests_per_level": 0},
        {"method": "draft"},
        {"method": "lookahead"},
        {"num_speculative_tokens": 0},
    ],
)
def test_bad_serve_settings_are_refused_before_a_server_starts(bad: dict) -> None:
    with pytest.raises(VerispecError):
        ServeBenchSettings(target="t", **bad).validate()


def test_replies_to_compare_with_must_exist_before_a_server_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--compare-replies", str(tmp_path / "none"), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "--compare-replies" in capsys.readouterr().err and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------- soak


def test_soak_specs_hang_up_a_seeded_quarter_before_the_end() -> None:
    specs = soak_specs([CHAT, CODE], 400, 8, 0.25, seed=3)
    leaving = [s.disconnect_after for s in specs if s.disconnect_after is not None]
    assert 70 <= len(leaving) <= 130 and all(1 <= n <= 4 for n in leaving)
    assert specs == soak_specs([CHAT, CODE], 400, 8, 0.25, seed=3)
    assert [s.prompt for s in specs[:3]] == [CHAT, CODE, CHAT]
    assert all(s.disconnect_after is None for s in soak_specs([CHAT], 50, 8, 0.0, seed=1))


def test_outcomes_add_up_and_anything_neither_finished_nor_hung_up_is_lost() -> None:
    done = RequestResult("1", "qa", ok=True, finish_reason="stop")
    left = RequestResult("2", "qa", ok=True, disconnected=True)
    broken = RequestResult("3", "qa", ok=False, error="boom")
    outcomes = count_outcomes(LevelRun(2, 1.0, [done, left, broken, done]))
    assert outcomes == {"sent": 4, "completed": 2, "disconnected": 1, "lost": 1}


def test_rss_must_stop_growing_over_the_second_half() -> None:
    """Growth up to half the larger tolerance over the second half; the first half's is not judged."""
    mb = 2**20
    assert rss_check(400 * mb, 500 * mb, 545 * mb, 10, 100).ok  # +45 MB < 100 MB / 2
    assert not rss_check(495 * mb, 500 * mb, 560 * mb, 10, 100).ok  # +60 MB: a leak
    assert rss_check(300 * mb, 2000 * mb, 2090 * mb, 10, 100).ok  # +90 MB < 10 % of 2 GB / 2
    check = rss_check(400 * mb, 539 * mb, 540 * mb, 10, 100)
    assert check.ok and "+1 MB over the second half" in check.detail and "+140 MB in all" in check.detail
    assert not rss_check(500 * mb, None, 1, 10, 100).ok


def test_the_server_must_end_exactly_the_requests_sent() -> None:
    before = parse_metrics('verispec_requests_finished_total{reason="length"} 4\n')
    after = parse_metrics(
        'verispec_requests_finished_total{reason="length"} 10\n'
        'verispec_requests_finished_total{reason="aborted"} 2\n'
    )
    check, reasons = finished_check(before, after, 8)
    assert check.ok and reasons == {"length": 6.0, "aborted": 2.0}
    assert not finished_check(before, after, 9)[0].ok
    assert finished_check(None, after, 8)[0].ok  # a server without the counter: skipped, not failed


def test_settled_means_an_empty_batch_an_empty_queue_and_every_request_counted() -> None:
    idle = parse_metrics(
        "verispec_batch_size 0\nverispec_waiting_requests 0\n"
        'verispec_requests_finished_total{reason="stop"} 5\n'
    )
    assert is_settled(idle, 5) and not is_settled(idle, 6)
    assert not is_settled(parse_metrics("verispec_batch_size 2\nverispec_waiting_requests 0\n"), 0)


def observed(results: list[RequestResult], end_mb: int = 510, health: int | str = 200) -> Observed:
    mb = 2**20
    metrics = "verispec_batch_size 0\nverispec_waiting_requests 0\n"
    after = parse_metrics(metrics + f'verispec_requests_finished_total{{reason="stop"}} {len(results)}\n')
    return Observed(
        LevelRun(2, 3.0, results), parse_metrics(metrics), after, health, 490 * mb, 500 * mb, end_mb * mb,
        [(0.0, 400 * mb), (1.0, 500 * mb), (2.0, 530 * mb)], 2,
    )  # fmt: skip


def test_a_clean_soak_passes_and_any_lost_request_fails_it() -> None:
    settings = SoakSettings(target="t")
    done = RequestResult("1", "qa", ok=True, finish_reason="stop", output_tokens=4)
    left = RequestResult("2", "qa", ok=True, disconnected=True, output_tokens=1)
    good = judge(observed([done, left, done]), settings)
    assert good["passed"] and good["outcomes"]["lost"] == 0 and good["finish_reasons"] == {"stop": 2}
    assert good["rss"]["peak_after_warmup_mb"] == 530 and good["output_tokens"] == 9
    assert "soak: PASSED" in summary(good)
    lost = judge(
        observed([done, RequestResult("3", "qa", error="the stream ended without [DONE]")]), settings
    )
    assert not lost["passed"] and lost["failures"][0]["error"] == "the stream ended without [DONE]"
    assert "[FAIL] no_request_lost" in summary(lost) and summary(lost).endswith("soak: FAILED")
    leaked = judge(observed([done], end_mb=700), settings)
    assert [c["name"] for c in leaked["checks"] if not c["ok"]] == ["rss"]
    dead = judge(observed([done], health="no answer (ConnectError)"), settings)
    assert [c["name"] for c in dead["checks"] if not c["ok"]] == ["healthy"]


def test_bad_soak_settings_are_refused() -> None:
    for bad in ({"requests": 0}, {"disconnect_fraction": 1.5}, {"method": "draft"}, {"depth_policy": "x"}):
        with pytest.raises(VerispecError):
            SoakSettings(target="t", **bad).validate()  # type: ignore[arg-type]
    flags = SoakSettings(target="t", method="none", concurrency=4).serve_flags()
    assert "--depth-policy" not in flags and flags[flags.index("--max-batch-size") + 1] == "4"


# ---------------------------------------------------------------------------------- report


def test_report_and_plots_from_synthetic_levels(tmp_path: Path) -> None:
    levels = [
        level_stats(policy, r, LevelRun(c, 2.0, [result(10 * c + r, 2.0, 0.1 * c)]), None)
        for policy in ("plain", "fixed", "adaptive")
        for r in range(2)
        for c in (1, 2, 4)
    ]
    summaries = summarize(levels)
    plots = write_plots(summaries, tmp_path, "tiny")
    assert [p.name for p in plots] == ["throughput.png", "user_tps.png", "ttft.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    settings = ServeBenchSettings(target="tiny", repeats=2, concurrency=(1, 2, 4)).to_dict()
    results = {
        "command": "verispec bench serve --target tiny",
        "settings": settings,
        "machine": {"cpu": "cpu", "cores": 2},
        "versions": {"python": "3"},
        "wall_seconds": 12.0,
        "servers": [
            {"policy": "plain", "args": ["--method", "none"], "startup_seconds": 1.0, "rss_peak_mb": 5.0}
        ],
        "levels": [{"failed": 1}],
    }
    report = report_markdown(results, summaries, plots)
    assert "| adaptive | 4 |" in report and " ± " in report and "![ttft](ttft.png)" in report
    assert "1 request(s) failed" in report and "--method none" in report


# -------------------------------------------------------------------------------- server process

FAKE_SERVER = textwrap.dedent(
    """\
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
    """
)


def fake_server(tmp_path: Path, script: str) -> ServerProcess:
    """A :class:`ServerProcess` whose child is a small script instead of ``verispec serve``."""
    path = tmp_path / "fake_server.py"
    path.write_text(script)
    server = ServerProcess([], tmp_path / "server.log", startup_timeout=30)
    server.command = [sys.executable, str(path), "--port", str(server.port)]
    return server


def test_the_server_process_is_killed_when_the_block_raises(tmp_path: Path) -> None:
    server = fake_server(tmp_path, FAKE_SERVER)
    with pytest.raises(KeyboardInterrupt), server:
        assert server.alive() and server.startup_seconds is not None
        assert rss_bytes(server.pid) and server.rss_bytes()
        raise KeyboardInterrupt  # Ctrl-C in the middle of a level
    assert not server.alive() and server.process is not None and server.process.returncode is not None


def test_a_server_that_dies_during_startup_is_an_error_with_its_log(tmp_path: Path) -> None:
    server = fake_server(tmp_path, "import sys; print('no such model'); sys.exit(3)")
    with pytest.raises(VerispecError, match="no such model"), server:
        pass
    assert not server.alive()


PARENT = textwrap.dedent(
    """\
    import sys, time
    from pathlib import Path
    from verispec.bench.server_proc import ServerProcess
    tmp = Path(sys.argv[1])
    server = ServerProcess([], tmp / "server.log", startup_timeout=30)
    server.command = [sys.executable, str(tmp / "fake_server.py"), "--port", str(server.port)]
    with server:
        print(server.pid, flush=True)
        time.sleep(60)
    """
)


def gone(pid: int) -> bool:
    """No such process, or a zombie (in a container nobody may reap an orphan)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_the_server_dies_with_the_benchmark_even_when_it_is_killed(tmp_path: Path, signal_name: str) -> None:
    """SIGTERM unwinds the ``with`` block; after SIGKILL, which runs no Python, the kernel's
    parent-death signal still ends the child."""
    import os
    import signal
    import subprocess

    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not gone(child)
        parent.send_signal(getattr(signal, signal_name))
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child)
    finally:
        parent.kill()
        parent.wait()
        if child is not None and not gone(child):
            os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------------------------ end to end

SMOLLM2 = ["--target", "smollm2-135m-instruct", "--method", "ngram"]


@pytest.mark.slow
@needs_smollm2
def test_bench_serve_end_to_end_on_smollm2(tmp_path: Path) -> None:
    """Three real servers (plain, fixed, adaptive), two levels each, then a fourth whose replies are
    held against the first run's; about two minutes on two cores."""
    argv = ["bench", "serve", *SMOLLM2, "--concurrency", "1,2", "--requests-per-level", "2", "--max-tokens",
            "16", "--warmup", "1", "--categories", "qa,translation", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["schema"] == "verispec-bench-serve/1"
    levels = {(lv["policy"], lv["concurrency"]): lv for lv in results["levels"]}
    assert set(levels) == {(p, c) for p in ("plain", "fixed", "adaptive") for c in (1, 2)}
    for level in levels.values():
        assert level["throughput"] > 0 and level["failed"] == 0 and level["ttft_mean"] > 0
        assert len(level["requests"]) == 2 and all(r["output_tokens"] > 0 for r in level["requests"])
    assert levels[("plain", 1)]["mean_depth"] == 0
    assert levels[("fixed", 1)]["mean_depth"] > 0 and levels[("fixed", 1)]["depth_source"] == "metrics"
    assert {s["policy"] for s in results["servers"]} == {"plain", "fixed", "adaptive"}
    for name in ("throughput.png", "user_tps.png", "ttft.png", "report.md"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| adaptive | 2 |" in (tmp_path / "report.md").read_text()
    # greedy and lossless: every policy's replies are plain's, and a second run's are the first's
    assert [(c["label"], c["compared"], c["same"]) for c in results["replies"]] == [
        ("fixed vs plain", 4, 4),
        ("adaptive vs plain", 4, 4),
    ]
    assert "fixed vs plain: 4/4 replies the same (identical)" in (tmp_path / "report.md").read_text()
    again = tmp_path / "again"
    argv = ["bench", "serve", *SMOLLM2, "--policies", "adaptive", "--concurrency", "1",
            "--requests-per-level", "2", "--max-tokens", "16", "--warmup", "0", "--categories",
            "qa,translation", "--cache-scope", "private", "--compare-replies", str(tmp_path),
            "--out", str(again)]  # fmt: skip
    assert main(argv) == 0
    (check,) = json.loads((again / "results.json").read_text())["replies"]
    assert check == {"label": f"adaptive vs adaptive of {tmp_path}", "compared": 2, "same": 2}


@pytest.mark.slow
@needs_smollm2
def test_bench_soak_end_to_end_on_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """400 requests with 8 tokens each, a quarter hanging up; short prompts keep it near a minute on two
    busy cores (Spec-Bench's summarization and RAG prompts would make prefill most of the time). Fewer
    requests leave the RSS check's second half inside the allocator's climb (soak module docstring)."""
    argv = ["bench", "soak", *SMOLLM2, "--requests", "400", "--max-tokens", "8", "--concurrency", "8",
            "--categories", "qa,translation", "--out", str(tmp_path)]  # fmt: skip
    code = main(argv)
    soak = json.loads((tmp_path / "soak.json").read_text())
    checks = {c["name"]: c for c in soak["checks"]}
    assert set(checks) == {"no_request_lost", "healthy", "server_finished", "idle", "rss"}
    assert soak["outcomes"]["sent"] == 400 and soak["outcomes"]["lost"] == 0, soak["failures"]
    assert 60 <= soak["outcomes"]["disconnected"] <= 140
    assert checks["server_finished"]["ok"] and checks["idle"]["ok"] and checks["healthy"]["ok"]
    assert soak["server_alive_at_end"]
    assert soak["rss"]["after_warmup_mb"] > 0 and soak["rss"]["half_mb"] > 0 and soak["rss"]["end_mb"] > 0
    assert code == 0 and soak["passed"] and "soak: PASSED" in capsys.readouterr().out, soak["checks"]
