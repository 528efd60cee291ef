"""Tool calls (OpenAI's function calling): finding the calls in a model's reply.

The chat template shows the model the tools. Models then write a call in one of two ways, and both
become OpenAI's ``tool_calls``:

- **Hermes blocks**, what Qwen2.5's template asks for (and vLLM parses with
  ``--tool-call-parser hermes``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number of them, with text around them as the content.
- **A bare JSON call**: a reply that opens with one JSON object ``{"name": ..., "arguments": {...}}``,
  possibly in a ```json fence (any text after it is content). Qwen2.5-Coder 0.5B and 1.5B answer
  this way although their template asks for blocks. So that an answer that merely shows JSON is not
  taken for a call, only the names of the tools offered count here.

Parsing reads text only, after verification, so it cannot change which tokens are generated:
speculation stays lossless with tools. A reply that is not a call stays plain text (as in vLLM), so
a model that writes something else never loses output.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = re.compile(r"^```(?:json)?[ \t]*\n(.*)\n[ \t]*```$", re.DOTALL)
MAX_HELD_CHARS = 16_384
"""A reply that might be a bare JSON call is held back while streaming, but never more than this."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI sends them."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry; with ``index``, a streamed delta's."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


def _call(text: str, names: Collection[str] | None = None) -> ToolCall | None:
    """The call a JSON object names (only one of ``names``, where given), or None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already encoded
        return ToolCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _bare_call(text: str, names: Collection[str]) -> ToolCall | None:
    """The call a whole reply is, bare or in a json fence, or None."""
    text = text.strip()
    fenced = FENCE.match(text)
    return _call(fenced.group(1) if fenced else text, names)


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """Split a whole reply into its content and its calls, exactly as :class:`ToolCallStream`
    splits it when streamed; content is None when it is blank beside calls."""
    stream = ToolCallStream(names)
    content, calls = stream.feed(text)
    rest, last = stream.finish()
    content, calls = content + rest, calls + last
    if calls:
        return content.strip() or None, calls
    return content, calls


class ToolCallStream:
    """:func:`parse_tool_calls` token by token. Content is released as soon as it cannot be part of a
    call, a Hermes call as soon as its block closes, a bare JSON call when its object (or fence)
    is complete. A reply that starts like a bare call (``{`` or a json fence) is held until that is
    decided. A block that turns out not to be a call is released as content; calls already sent
    stay sent. :func:`parse_tool_calls` is this stream fed the whole reply at once."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self._pending = ""  # held: a possible start of OPEN, an open block, or a possible bare call
        self._start = True  # nothing but whitespace released so far: a bare call may still begin
        self.sent = 0
        """Calls released so far (a streamed call's ``index``)."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        if self._start:
            decided = self._bare()
            if decided is None:
                return "", []
            if decided:
                return "", [decided]
        return self._blocks()

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is still held when the reply ends: a bare call, or content."""
        rest, self._pending = self._pending, ""
        if self._start:
            call = _bare_call(rest, self.names)
            if call is not None:
                self.sent += 1
                return "", [call]
        return ("" if self.sent and not rest.strip() else rest), []

    def _bare(self) -> ToolCall | bool | None:
        """While the reply may be a bare call: the call once complete, False once it cannot be one
        (then the held text goes on as usual), None while undecided."""
        held = self._pending.lstrip()
        if not held:
            return None
        if len(held) > MAX_HELD_CHARS:
            self._start = False
            return False
        if "```".startswith(held):
            return None
        if held.startswith("```"):
            first, newline, body = held.partition("\n")
            if not newline:
                return None if "json".startswith(first[3:].strip()) else self._give_up()
            if first[3:].strip() not in ("", "json"):
                return self._give_up()
            close = body.find("\n```")
            if close < 0:
                return None
            end = len(self._pending) - len(held) + len(first) + 1 + close + 4
        elif held.startswith("{"):
            try:
                _, used = json.JSONDecoder().raw_decode(held)
            except json.JSONDecodeError:
                return None  # not complete yet (or never: decided at the end)
            end = len(self._pending) - len(held) + used
        else:
            return self._give_up()
        call = _bare_call(self._pending[:end], self.names)
        if call is None:
            return self._give_up()
        self._start = False
        self._pending = self._pending[end:]
        self.sent += 1
        return call

    def _give_up(self) -> bool:
        self._start = False
        return False

    def _blocks(self) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_open(self._pending)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                content.append(self._pending[:start])
                self._pending = self._pending[start:]
                break
            content.append(self._pending[:start])
            block = self._pending[start : end + len(CLOSE)]
            self._pending = self._pending[end + len(CLOSE) :]
            call = _call(block[len(OPEN) : -len(CLOSE)])
            if call is None:
                content.append(block)
            else:
                calls.append(call)
        self.sent += len(calls)
        text = "".join(content)
        if self.sent and not text.strip():  # whitespace after a call waits: content only if more follows
            self._pending = text + self._pending
            text = ""
        return text, calls


def _partial_open(text: str) -> int:
    """Length of the longest end of ``text`` that OPEN starts with."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
