"""The workloads that repeat structure (``code_edit``, ``tool_calls``, ``mt_bench_6turn``): generated
the same way every time and well formed; conversations built from the model's own answers, offline
and served; cache scopes and per-turn time to first token; and both benchmarks end to end on
SmolLM2-135M. No test reads a model's words: only their shape (turns, tokens, timings present)."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from llguidance import LLMatcher

from tests.conftest import make_engine, needs_smollm2
from verispec.bench import workloads
from verispec.bench.contenders import EngineContender
from verispec.bench.datasets import CATEGORIES, CONVERSATIONS, DATASETS, BenchPrompt, load_dataset
from verispec.bench.harness import check_lossless, generate_turn, measure, run_prompt, select_prompts, warm_up
from verispec.bench.load import LevelRun, RequestResult, RequestSpec, request_body, run_level
from verispec.bench.report import turn_rows, turn_summaries
from verispec.bench.serve import ServeBenchSettings, _key_for_servers
from verispec.bench.serve_report import report_markdown, turn_table
from verispec.bench.serve_stats import level_stats, summarize
from verispec.bench.settings import BenchSettings
from verispec.cli import build_parser, main
from verispec.data import SHIPPED, WORKLOADS, dataset_dir
from verispec.data import workloads as text
from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
THIRD_TURN_ROLES = ["system", "user", "assistant", "tool", "user", "assistant", "tool", "user"]

# ------------------------------------------------------------------------------------- datasets


def test_every_workload_is_a_dataset_with_categories_and_no_folder() -> None:
    assert set(WORKLOADS) <= set(DATASETS) and set(DATASETS) == set(SHIPPED) | set(WORKLOADS)
    assert frozenset(WORKLOADS) == CONVERSATIONS
    for name in WORKLOADS:
        assert name in CATEGORIES
        with pytest.raises(VerispecError, match="generated"):
            dataset_dir(name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_generated_identically_every_time(name: str) -> None:
    first, second = load_dataset(name), load_dataset(name)  # type: ignore[arg-type]
    assert first == second and first
    assert len({p.id for p in first}) == len(first)
    assert all(p.dataset == name and p.chat and p.category in CATEGORIES[name] for p in first)
    assert all(all(isinstance(t, str) and t.strip() for t in p.turns) for p in first)


def test_code_edit_asks_for_the_whole_function_again_after_each_small_change() -> None:
    prompts = load_dataset("code_edit")
    humaneval = load_dataset("humaneval")
    assert [p.id for p in prompts] == [p.id for p in humaneval]  # one chat per problem, in file order
    assert Counter(len(p.turns) for p in prompts) == {4: 55, 5: 55, 6: 54}
    for chat, problem in zip(prompts, humaneval, strict=True):
        assert problem.turns[0] in chat.turns[0] and "```python" in chat.turns[0]
        edits = chat.turns[1:]
        assert len(set(edits)) == len(edits)  # each change asked once
        assert all(e.endswith(text.CODE_EDIT_REPLY) and "{name}" not in e for e in edits)
        assert chat.system is None and chat.feedback is None
    assert any("`truncate_number_v2`" in turn for turn in prompts[2].turns)  # edits 2..6 hold the rename


def test_mt_bench_6turn_is_mt_bench_followed_by_four_generic_follow_ups() -> None:
    chats, mt = load_dataset("mt_bench_6turn"), load_dataset("mt_bench")
    assert [(p.id, p.category) for p in chats] == [(p.id, p.category) for p in mt]
    for chat, original in zip(chats, mt, strict=True):
        assert len(chat.turns) == 6 and chat.turns[:2] == original.turns
        assert set(chat.turns[2:]) <= set(text.FOLLOW_UPS) and len(set(chat.turns[2:])) == 4


def test_tool_schemas_are_valid_json_schemas_in_openai_function_format() -> None:
    names = [tool["function"]["name"] for tool in text.TOOLS]
    assert len(set(names)) == len(names) == 5
    for tool in text.TOOLS:
        assert tool["type"] == "function" and tool["function"]["description"]
        schema = tool["function"]["parameters"]
        assert schema["type"] == "object" and set(schema["required"]) <= set(schema["properties"])
        for prop in schema["properties"].values():
            assert prop["type"] in ("string", "number", "integer", "boolean")
        error, warnings = LLMatcher.validate_grammar_with_warnings(
            LLMatcher.grammar_from_json_schema(json.dumps(schema))
        )
        assert not error and not warnings, (tool["function"]["name"], warnings)


def test_tool_calls_list_the_tools_in_the_system_message_and_ask_for_similar_items() -> None:
    prompts = load_dataset("tool_calls")
    assert len(prompts) == workloads.TOOL_CALL_CONVERSATIONS
    assert Counter(len(p.turns) for p in prompts) == {6: 30, 5: 30}
    system = prompts[0].system
    assert system is not None and all(p.system == system for p in prompts)  # one shared prefix
    for tool in text.TOOLS:
        assert json.dumps(tool, separators=(",", ":")) in system
    used = [p.id.rsplit("-", 1)[0] for p in prompts[:5]]
    assert sorted(used) == sorted(t["function"]["name"] for t in text.TOOLS)  # any five cover them all
    weather = prompts[0]
    cities = text.CITIES[: len(weather.turns)]
    assert all(city in weather.turns[0] for city in cities)
    assert [t.removeprefix("Next city: ").rstrip(".") for t in weather.turns[1:]] == list(cities[1:])


def test_tool_results_come_from_the_call_alone() -> None:
    result = workloads.tool_result(WEATHER_CALL)
    assert result == workloads.tool_result(WEATHER_CALL)
    assert result == {
        "city": "Paris",
        "temperature": 8,
        "unit": "celsius",
        "conditions": "fog",
        "humidity": 37,
    }
    other = workloads.tool_result(WEATHER_CALL.replace("Paris", "Oslo"))
    assert other["city"] == "Oslo" and other != result
    # The same call however it is wrapped: a code fence, Hermes tags, text first, arguments as a string.
    fenced = f"Sure:\n```json\n{WEATHER_CALL}\n```"
    encoded = json.dumps(
        {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}
    )
    hermes = f"<tool_call>{encoded}</tool_call>"
    assert workloads.tool_result(fenced) == workloads.tool_result(hermes) == result
    assert "error" in workloads.tool_result("I can't call tools.")
    assert workloads.tool_result('{"name": "fly_me", "arguments": {}}') == {"error": "unknown tool 'fly_me'"}
    bad_amount = '{"name": "convert_currency", "arguments": {"amount": "lots", "from": "USD", "to": "EUR"}}'
    assert workloads.tool_result(bad_amount) == {"error": "amount must be a number"}
    converted = workloads.tool_result(bad_amount.replace('"lots"', "120"))
    assert converted["converted"] == pytest.approx(120 * converted["rate"], abs=0.01)


def test_before_turn_adds_the_system_message_then_each_answer_and_its_tool_result() -> None:
    chat = load_dataset("tool_calls", limit=1)[0]
    assert chat.before_turn(0) == [{"role": "system", "content": chat.system}]
    answer, result = chat.before_turn(1, WEATHER_CALL)
    assert answer == {"role": "assistant", "content": WEATHER_CALL}
    assert result["role"] == "tool" and json.loads(result["content"]) == workloads.tool_result(WEATHER_CALL)
    with pytest.raises(ValueError, match="needs the answer"):
        chat.before_turn(1)
    # The published sets are unchanged: nothing before the first turn, only the answer after it.
    plain = load_dataset("mt_bench", limit=1)[0]
    assert plain.before_turn(0) == [] and plain.before_turn(1, "a") == [{"role": "assistant", "content": "a"}]


def test_workloads_are_selected_like_any_dataset(tmp_path: Path) -> None:
    settings = BenchSettings(
        target="x", datasets=("code_edit", "tool_calls", "mt_bench_6turn"), limit_per_category=2,
        categories=("code_edit", "tool_calls", "writing"),
    )  # fmt: skip
    prompts = select_prompts(settings)
    assert [(p.dataset, p.category) for p in prompts] == [
        ("code_edit", "code_edit"), ("code_edit", "code_edit"), ("tool_calls", "tool_calls"),
        ("tool_calls", "tool_calls"), ("mt_bench_6turn", "writing"), ("mt_bench_6turn", "writing"),
    ]  # fmt: skip
    with pytest.raises(VerispecError, match="valid categories: code_edit"):
        BenchSettings(target="x", datasets=("code_edit",), categories=("qa",))
    args = build_parser("bench").parse_args(
        ["bench", "--dataset", "code_edit,tool_calls", "--limit", "1", "--cache-scope", "private"]
    )
    assert args.dataset == ["code_edit", "tool_calls"] and args.cache_scope == "private"
    serve = build_parser("bench").parse_args(["bench", "serve", "--dataset", "tool_calls", "--turns", "all"])
    assert serve.dataset == "tool_calls" and serve.turns == "all"
    # code_edit reads HumanEval from --data-dir, as the published sets do; tool_calls reads no file.
    with pytest.raises(VerispecError, match=r"HumanEval\.jsonl\.gz is missing"):
        load_dataset("code_edit", data_dir=tmp_path)
    assert load_dataset("tool_calls", data_dir=tmp_path, limit=1)


def test_bench_refuses_a_bad_cache_scope_before_loading() -> None:
    with pytest.raises(VerispecError, match="--cache-scope"):
        BenchSettings(target="x", cache_scope="everyone")
    assert BenchSettings(target="x").scope_of("ngram") == "bench-ngram"
    assert BenchSettings(target="x", cache_scope="private").scope_of("ngram") is None


# ------------------------------------------------------------------- offline: scopes and TTFT


class RecordingPrompter:
    """A prompter for a tokenizer-less model: each conversation's ids are a fixed function of its
    messages, and it keeps every conversation it was asked to encode."""

    chat = True

    def __init__(self) -> None:
        self.histories: list[list[dict[str, str]]] = []

    def ids(self, history: list[dict[str, str]], chat: bool) -> list[int]:
        self.histories.append([dict(m) for m in history])
        words = " ".join(m["role"] + " " + m["content"] for m in history)
        return [1 + sum(map(ord, w)) % 90 for w in words.split()][-40:]

    def text(self, ids: list[int]) -> str:
        return WEATHER_CALL if ids else ""

    def user(self, text: str) -> str:
        return text


def scoped(contender: EngineContender, seen: list[Any]) -> EngineContender:
    """``contender`` with its engine's ``stream`` noting each request's cache scope in ``seen``."""
    stream = contender.engine.stream

    def noting(prompt: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("cache_scope", "unset"))
        return stream(prompt, **kwargs)

    contender.engine.stream = noting  # type: ignore[method-assign]
    return contender


def test_engine_turns_stream_in_their_scope_with_a_time_to_first_token(tiny_target: HFCausalLM) -> None:
    seen: list[Any] = []
    contender = scoped(EngineContender("ngram", make_engine(tiny_target, method="ngram")), seen)
    turn = generate_turn(contender, [5, 6, 7, 5, 6], 8, "bench-ngram")
    plain = make_engine(tiny_target).generate([5, 6, 7, 5, 6], max_new_tokens=8, temperature=0.0)
    assert turn.token_ids == plain.token_ids  # streaming changes the timing, not the output
    assert seen == ["bench-ngram"] and turn.counts is not None and turn.counts.committed == 8
    assert turn.ttft is not None and 0 < turn.ttft <= turn.seconds


def test_a_tool_loop_resends_the_conversation_with_each_result(tiny_target: HFCausalLM) -> None:
    """Every contender sees the same prompts in the same order, each request in its own scope (none
    when private), and turn n's conversation holds the answers and tool results of turns 1..n-1."""
    prompts = load_dataset("tool_calls", limit=2)
    for sharing, expected in (("shared", "bench-{}"), ("private", None)):
        settings = BenchSettings(target="x", cache_scope=sharing)
        seen: dict[str, list[Any]] = {"none": [], "ngram": []}
        contenders = [
            scoped(EngineContender(name, make_engine(tiny_target, method=method)), seen[name])
            for name, method in (("none", None), ("ngram", "ngram"))
        ]
        prompter = RecordingPrompter()
        scopes = {c.name: settings.scope_of(c.name) for c in contenders}
        records = measure(contenders, prompts, prompter, 6, progress=False, scopes=scopes)  # type: ignore[arg-type]
        check_lossless(records, contenders)  # type: ignore[arg-type]
        turns = sum(len(p.turns) for p in prompts)
        for name in ("none", "ngram"):
            assert seen[name] == [None if expected is None else expected.format(name)] * turns
        assert [(r.method, r.prompt_id) for r in records] == [
            (m, p.id) for p in prompts for m in ("none", "ngram")
        ]
        assert all(r.ok and r.matches_reference for r in records if r.method == "ngram")
        assert all(t.ttft is not None for r in records for t in r.turns)
    third = prompter.histories[2]  # the first contender's third turn of the first conversation
    assert [m["role"] for m in third] == THIRD_TURN_ROLES
    assert third[3]["content"] == json.dumps(workloads.tool_result(WEATHER_CALL), separators=(", ", ": "))


def test_warm_up_and_run_prompt_default_to_no_scope(tiny_target: HFCausalLM) -> None:
    seen: list[Any] = []
    contender = scoped(EngineContender("none", make_engine(tiny_target)), seen)
    record = run_prompt(contender, RecordingPrompter(), BenchPrompt("d", "c", "1", ["a b"], chat=True), 4)
    warm_up([contender], RecordingPrompter(), BenchSettings(target="x", warmup=2, max_new_tokens=4))  # type: ignore[arg-type]
    assert record.ok and seen == [None, None, None]


def test_turn_summaries_give_ttft_and_speed_per_turn_index() -> None:
    from tests.bench.test_aggregate import counts
    from verispec.bench.records import PromptRecord, Turn

    def rec(method: str, pid: str, ttfts: list[float | None]) -> PromptRecord:
        turns = [Turn(10 * (i + 1), [1, 2, 3, 4], 1.0 if method == "none" else 0.5, counts([], [], 4), ttft=t)
                 for i, t in enumerate(ttfts)]  # fmt: skip
        return PromptRecord(method, "code_edit", "code_edit", pid, turns)

    records = [rec("none", "1", [0.4, 0.1, 0.1]), rec("ngram", "1", [0.4, 0.2, 0.1]),
               rec("none", "2", [0.6, 0.3]), rec("ngram", "2", [0.6, 0.2]),
               rec("hf", "2", [None, None])]  # fmt: skip
    summaries = turn_summaries(records)
    by = {(s.method, s.turn): s for s in summaries}
    assert [s.turn for s in summaries if s.turn] == sorted(s.turn for s in summaries if s.turn)
    assert summaries[-1].turn == 0  # every turn together comes last
    # decoding speed: 3 tokens after the first over the time after it, all prompts' turns summed
    assert by[("none", 0)].decode_tokens_per_second == pytest.approx(15 / (5 - 1.5))
    # (ngram's turn with a TTFT of 0.6 s in 0.5 s has no time after its first token: left out)
    assert by[("ngram", 0)].decode_speedup == pytest.approx((12 / (2.0 - 0.9)) / (15 / (5 - 1.5)))
    assert by[("none", 1)].ttft_mean == pytest.approx(0.5) and by[("none", 2)].ttft_p50 == pytest.approx(0.2)
    assert by[("none", 3)].prompts == 1 and by[("none", 3)].prompt_tokens == 30
    assert by[("ngram", 2)].speedup == pytest.approx(2.0) and by[("none", 1)].speedup == 1.0
    assert by[("hf", 1)].ttft_mean is None and by[("hf", 1)].speedup == pytest.approx(2.0)  # on prompt 2
    rows = turn_rows(summaries)
    assert ("hf", "code_edit", "1", "1", "10", "-", "-", "-", "8.00", "2.00x", "-", "-") in rows
    assert by[("none", 0)].prompts == 5 and rows[-3][:3] == ("none", "code_edit", "all")


# ---------------------------------------------------------------------- served: conversations


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def answering(answer: str, seen: list[httpx.Request], fail_turn: int | None = None) -> httpx.MockTransport:
    """A server that streams ``answer`` in two chunks to every request (HTTP 500 for the request whose
    conversation holds ``fail_turn`` user turns) and keeps the requests in ``seen``."""

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if fail_turn is not None and sum(m["role"] == "user" for m in body["messages"]) == fail_turn:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        half = len(answer) // 2
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": answer[:half]}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": answer[half:]}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}},
        ]
        return httpx.Response(
            200, content=sse(*chunks, "[DONE]"), headers={"content-type": "text/event-stream"}
        )

    return httpx.MockTransport(handler)


def run_with(transport: httpx.MockTransport, specs: list[RequestSpec], concurrency: int) -> LevelRun:
    async def go() -> LevelRun:
        headers = {"Authorization": "Bearer sk-test"}
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
            return await run_level(client, specs, concurrency)

    return asyncio.run(go())


def test_a_served_conversation_sends_each_turn_with_the_whole_history() -> None:
    chats = load_dataset("tool_calls", limit=2)
    seen: list[httpx.Request] = []
    specs = [RequestSpec(chat, 16, turns=3, user="bench-r0-u2") for chat in chats]
    run = run_with(answering(WEATHER_CALL, seen), specs, 2)
    assert [(r.prompt_id, r.turn) for r in run.results] == [(c.id, t) for c in chats for t in (1, 2, 3)]
    assert all(r.ok and r.ttft is not None for r in run.results)
    bodies = [json.loads(r.content) for r in seen]
    assert all(b["user"] == "bench-r0-u2" and b["stream"] for b in bodies)
    assert all(r.headers["authorization"] == "Bearer sk-test" for r in seen)
    last = next(
        b for b in bodies if len(b["messages"]) == 8 and b["messages"][1]["content"] == chats[0].turns[0]
    )
    assert [m["role"] for m in last["messages"]] == THIRD_TURN_ROLES
    assert last["messages"][2]["content"] == WEATHER_CALL  # the streamed answer, put back together
    assert json.loads(last["messages"][3]["content"]) == workloads.tool_result(WEATHER_CALL)
    assert last["messages"][-1]["content"] == chats[0].turns[2]
    assert "text" not in run.results[0].to_dict()  # answers are not written to results.json


def test_a_failed_turn_ends_its_conversation_and_first_turn_specs_send_one_request() -> None:
    chat = load_dataset("code_edit", limit=1)[0]
    seen: list[httpx.Request] = []
    run = run_with(answering("def f(): pass", seen, fail_turn=2), [RequestSpec(chat, 8, turns=4)], 1)
    assert [(r.turn, r.ok) for r in run.results] == [(1, True), (2, False)] and len(seen) == 2
    path, body = request_body(RequestSpec(chat, 8))
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": chat.turns[0]}]
    assert "user" not in body


def test_level_stats_and_the_report_give_ttft_per_turn() -> None:
    def result(turn: int, ttft: float) -> RequestResult:
        return RequestResult("1", "c", turn=turn, ok=True, ttft=ttft, seconds=1.0, output_tokens=4)

    def level(policy: str, repeat: int) -> LevelRun:
        return LevelRun(2, 2.0, [result(1, 0.5 + repeat), result(2, 0.1), result(1, 0.7)])

    levels = [level_stats(p, r, level(p, r), None) for p in ("plain", "fixed") for r in (0, 1)]
    assert levels[0].ttft_by_turn == {1: pytest.approx(0.6), 2: pytest.approx(0.1)}
    assert levels[0].conversations == 2 and levels[0].requests == 3
    summaries = summarize(levels)
    assert summaries[0].ttft_by_turn[1].mean == pytest.approx(0.85)  # 0.6 and 1.1 over the repeats
    assert json.loads(json.dumps(summaries[0].to_dict()))["ttft_by_turn"]["2"]["mean"] == pytest.approx(0.1)
    header, rows = turn_table(summaries)
    assert header == ("policy", "users", "turn 1", "turn 2") and rows[1][0] == "fixed"
    settings = ServeBenchSettings(target="t", dataset="code_edit", concurrency=(2,)).to_dict()
    results = {"command": "c", "settings": settings, "wall_seconds": 1.0, "servers": [], "levels": []}
    report = report_markdown(results, summaries, [])
    assert (
        "## Time to first token by turn" in report
        and "| plain | 2 | 0.850 ± 0.354 | 0.100 ± 0.000 |" in report
    )
    assert "every turn, each request carrying the whole conversation" in report


def test_serve_settings_choose_turns_scopes_and_keep_the_key_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServeBenchSettings(target="t", dataset="tool_calls").all_turns
    assert not ServeBenchSettings(target="t", dataset="spec_bench").all_turns  # as it always was
    assert ServeBenchSettings(target="t", dataset="mt_bench", turns="all").all_turns
    assert not ServeBenchSettings(target="t", dataset="code_edit", turns="first").all_turns
    shared = ServeBenchSettings(target="t")
    assert shared.server_args_for("fixed")[-1] == "--shared-cache"
    assert shared.user_for("r0-u1") == "bench-r0-u1"
    mine = ServeBenchSettings(target="t", server_args=("--prefix-cache-gb", "1"))
    assert mine.server_args_for("fixed")[-3:] == ["--shared-cache", "--prefix-cache-gb", "1"]  # theirs last
    keyed = ServeBenchSettings(target="t", api_key="sk-secret")
    assert "--shared-cache" not in keyed.server_args_for("plain") and "sk-secret" not in repr(keyed)
    assert "sk-secret" not in json.dumps(keyed.to_dict()) and keyed.to_dict()["api_key"] == "(given)"
    private = ServeBenchSettings(target="t", cache_scope="private")
    assert "--shared-cache" not in private.server_args_for("fixed") and private.user_for("x") is None
    for bad in ({"turns": "some"}, {"cache_scope": "all"}, {"cache_scope": "private", "api_key": "k"}):
        with pytest.raises(VerispecError):
            ServeBenchSettings(target="t", **bad).validate()  # type: ignore[arg-type]
    specs = ServeBenchSettings(target="t", dataset="code_edit", max_tokens=5).specs(
        load_dataset("code_edit", limit=2), "u"
    )
    assert [s.turns for s in specs] == [4, 5] and all(s.user == "u" and s.max_tokens == 5 for s in specs)
    # The servers get the key through their environment, for as long as they run.
    monkeypatch.setenv("VERISPEC_API_KEY", "before")
    with _key_for_servers("sk-secret"):
        assert os.environ["VERISPEC_API_KEY"] == "sk-secret"
    assert os.environ["VERISPEC_API_KEY"] == "before"
    monkeypatch.delenv("VERISPEC_API_KEY")
    with _key_for_servers(None):
        assert "VERISPEC_API_KEY" not in os.environ


# ------------------------------------------------------------------------------ end to end

SMOLLM2 = ["--target", "smollm2-135m-instruct"]


@pytest.mark.slow
@needs_smollm2
def test_bench_runs_both_workloads_and_reports_ttft_per_turn(
    tmp_path: Path, restore_torch_threads: None
) -> None:
    out = tmp_path / "results"
    argv = ["bench", *SMOLLM2, "--methods", "none,ngram", "-k", "4", "--dataset", "code_edit,tool_calls",
            "--limit", "1", "--max-new-tokens", "16", "--warmup", "0", "--threads", "1",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["cache_scope"] == "shared"
    records = {(r["method"], r["dataset"]): r for r in results["records"]}
    assert set(records) == {(m, d) for m in ("none", "ngram") for d in ("code_edit", "tool_calls")}
    for (method, _), record in records.items():
        assert record["error"] is None and len(record["turns"]) >= 4
        for before, after in zip(record["turns"], record["turns"][1:], strict=False):
            # each turn resends the conversation: its prompt holds the previous prompt and answer
            assert after["prompt_tokens"] > before["prompt_tokens"] + len(before["token_ids"])
        assert all(0 < t["ttft"] <= t["seconds"] for t in record["turns"])
        if method == "ngram":
            assert record["matches_reference"] is True
    turns = {(t["method"], t["dataset"], t["turn"]): t for t in results["turns"]}
    for method in ("none", "ngram"):
        for dataset in ("code_edit", "tool_calls"):
            count = len(records[(method, dataset)]["turns"])
            assert {t for m, d, t in turns if (m, d) == (method, dataset)} == set(range(count + 1))  # 0: all
    assert all(t["ttft_mean"] > 0 and t["tokens_per_second"] > 0 for t in turns.values())
    report = (out / "report.md").read_text()
    assert "## Per turn" in report and "| ngram | tool_calls | 2 |" in report


@pytest.mark.slow
@needs_smollm2
def test_bench_serve_runs_multi_turn_conversations_at_two_users(tmp_path: Path) -> None:
    """One ngram server, two users each running a tool-calling conversation turn by turn."""
    argv = ["bench", "serve", *SMOLLM2, "--method", "ngram", "--policies", "fixed", "--concurrency", "2",
            "--requests-per-level", "2", "--max-tokens", "8", "--warmup", "0", "--dataset", "tool_calls",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["turns"] == "all" and results["settings"]["cache_scope"] == "shared"
    assert "--shared-cache" in results["servers"][0]["args"]
    (level,) = results["levels"]
    assert level["failed"] == 0 and level["conversations"] == 2
    turns = Counter(r["prompt_id"] for r in level["requests"])
    assert len(turns) == 2 and all(n >= 5 for n in turns.values())  # every turn of both conversations
    assert set(level["ttft_by_turn"]) == {str(t) for t in range(1, max(turns.values()) + 1)}
    (summary,) = results["summary"]
    assert all(spread["mean"] > 0 for spread in summary["ttft_by_turn"].values())
    assert "## Time to first token by turn" in (tmp_path / "report.md").read_text()
