"""Tool calls: the reply parser (whole and streamed), request validation, and the format a real
openai client reads; end to end on the real Qwen2.5-Coder-0.5B in tests/server/test_qwen_tools.py."""

from __future__ import annotations

import json

import pytest

from tests.server.test_errors import assert_error, post
from verispec.server.responses import ChunkWriter, full_response
from verispec.server.tools import MAX_HELD_CHARS, ToolCallStream, parse_tool_calls
from verispec.types import TokenEvent

NAMES = frozenset({"get_weather", "add"})

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
CASES = [
    # (reply, content, [(name, arguments)])
    ("<tool_call>\n" + json.dumps(WEATHER) + "\n</tool_call>", None, [("get_weather", '{"city": "Paris"}')]),
    ("```json\n" + json.dumps(WEATHER, indent=2) + "\n```", None, [("get_weather", '{"city": "Paris"}')]),
    (json.dumps(WEATHER) + "\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    (
        'Let me check. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>',
        "Let me check.",
        [("add", '{"a": 1}'), ("add", '{"a": 2}')],
    ),
    # Not calls: everything stays content.
    ('{"name": "delete_everything", "arguments": {}}', '{"name": "delete_everything", "arguments": {}}', []),
    ('{"name": "add"', '{"name": "add"', []),
    ("```python\nprint({'name': 'add'})\n```", "```python\nprint({'name': 'add'})\n```", []),
    ("<tool_call>{not json}</tool_call> sorry", "<tool_call>{not json}</tool_call> sorry", []),
    ("an open <tool_call>{", "an open <tool_call>{", []),
    ("a < b and <tool", "a < b and <tool", []),
    ("", "", []),
]


def streamed(reply: str, pieces: int) -> tuple[str, list[tuple[str, str]]]:
    """The reply fed in chunks of ``pieces`` characters, as tokens arrive."""
    stream = ToolCallStream(NAMES)
    content, calls = "", []
    for i in range(0, len(reply), pieces):
        text, new = stream.feed(reply[i : i + pieces])
        content += text
        calls += new
    text, new = stream.finish()
    return content + text, [(c.name, c.arguments) for c in calls + new]


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_replies_split_into_content_and_calls_whole_or_streamed(reply, content, calls):
    got_content, got_calls = parse_tool_calls(reply, NAMES)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for pieces in (1, 3, 1000):
        text, streamed_calls = streamed(reply, pieces)
        assert streamed_calls == calls
        assert (text.strip() or None) == (content.strip() if content else content) or (
            not calls and text == reply
        )


def test_content_is_released_as_soon_as_it_cannot_be_a_call():
    stream = ToolCallStream(NAMES)
    assert stream.feed("Hello <to") == ("Hello ", [])  # "<to" may open a block
    assert stream.feed("day") == ("<today", [])
    bare = ToolCallStream(NAMES)
    assert bare.feed('{"name": "add", ') == ("", [])  # may be a bare call: held
    text, calls = bare.feed('"arguments": {}} ok')
    assert [c.name for c in calls] == ["add"] and text == ""
    assert bare.finish() == (" ok", [])
    big = ToolCallStream(NAMES)
    assert big.feed("{" + "x" * MAX_HELD_CHARS)[0].startswith("{x")  # never held without bound


def events(text: str) -> list[TokenEvent]:
    last = len(text) - 1
    return [
        TokenEvent(
            token_id=i,
            text=ch,
            from_draft=False,
            logprob=None,
            step=i,
            finish_reason="eos" if i == last else None,
        )
        for i, ch in enumerate(text)
    ]


def test_response_and_stream_formats():
    reply = "<tool_call>" + json.dumps(WEATHER) + "</tool_call>"
    body = full_response("chat", "id", 0, "m", [events(reply)], 3, tools=NAMES)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    writer = ChunkWriter("chat", "id", 0, "m", tools=NAMES)
    chunks = [c for c in (writer.token(e) for e in events(reply)) if c is not None]
    payloads = [json.loads(c.removeprefix("data: ")) for c in chunks]
    deltas = [p["choices"][0]["delta"] for p in payloads]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
    assert deltas[0]["tool_calls"][0]["index"] == 0
    assert payloads[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = full_response("chat", "id", 0, "m", [events(reply)], 3)  # no tools offered: plain text
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": reply}


TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HI, "tools": TOOLS, "tool_choice": "anything"}, "tool_choice"),
        ({"messages": HI, "tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {
                "messages": HI,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ({"messages": HI, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
        (
            {"messages": HI, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
        ),
        ({"messages": HI, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"messages": HI, "tools": TOOLS}, "tools"),  # the tiny model's template does not take tools
        (
            {
                "messages": [
                    *HI,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0]",
        ),
    ],
)
def test_bad_tool_requests_are_400(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param, None)


def test_tool_choice_none_is_a_plain_chat(client):
    reply = client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=4, tools=TOOLS, tool_choice="none"
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
