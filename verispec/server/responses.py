"""Engine output as OpenAI bodies: whole responses, log-probabilities and stream chunks.

What the engine produced for a request (:class:`~verispec.types.TokenEvent` lists per choice)
becomes a :class:`~verispec.server.protocol.CompletionResponse` or
:class:`~verispec.server.protocol.ChatCompletionResponse` (:func:`full_response`) or, streamed,
server-sent events (:class:`ChunkWriter`, in the format :mod:`verispec.server` documents). Requests
come in through :mod:`verispec.server.translate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from verispec.detok import token_text
from verispec.engine import TokenLogprobs
from verispec.metrics import SpecStats
from verispec.server.tools import ToolCallStream, parse_tool_calls
from verispec.types import TokenEvent

Kind = Literal["completion", "chat"]


def best_choices(choices: list[list[TokenEvent]], keep: int) -> list[list[TokenEvent]]:
    """The ``keep`` choices with the highest mean log-probability per token, best first (the rule
    OpenAI gives for ``best_of``; a sum would favour short completions). Ties keep choice order."""

    def score(events: list[TokenEvent]) -> float:
        logprobs = [e.logprob for e in events if e.logprob is not None]
        return sum(logprobs) / len(logprobs) if logprobs else float("-inf")

    ranked = sorted(range(len(choices)), key=lambda i: -score(choices[i]))
    return [choices[i] for i in ranked[:keep]]


def openai_finish_reason(event: TokenEvent) -> str:
    """OpenAI knows 'stop' and 'length'; the model's EOS is a 'stop'."""
    return "length" if event.finish_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens``: prompt tokens the prefix cache supplied."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


LOWEST_LOGPROB = -9999.0
"""A log-probability of -inf (a token the model rules out) is sent as this: JSON has no infinity."""


def _named(token_bytes: list[bytes], token_id: int) -> tuple[str, list[int]]:
    raw = token_bytes[token_id] if 0 <= token_id < len(token_bytes) else b""  # padded vocabulary rows
    return token_text(raw), list(raw)


def _finite(logprob: float | None) -> float:
    return LOWEST_LOGPROB if logprob is None or logprob < LOWEST_LOGPROB else logprob


def prompt_logprobs_body(
    prompt_ids: list[int], scores: list[TokenLogprobs | None], token_bytes: list[bytes]
) -> dict[str, Any]:
    """The completions format's lists for an echoed prompt (its first token has null entries);
    offsets count each token's own text."""
    return _legacy_body(token_bytes, list(zip(prompt_ids, scores, strict=True)), None, 0)


def _legacy_body(
    token_bytes: list[bytes],
    scored: list[tuple[int, TokenLogprobs | None]],
    texts: list[str] | None,
    offset: int,
) -> dict[str, Any]:
    """The completions format's parallel lists: each token's name, log-probability and alternatives
    (the token itself always among them; nulls where it has no score, as an echoed prompt's first
    token), and where its text starts, counting ``texts`` (else each token's own name) from
    ``offset``."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for i, (token_id, score) in enumerate(scored):
        token = _named(token_bytes, token_id)[0]
        tokens.append(token)
        offsets.append(offset)
        offset += len(texts[i] if texts is not None else token)
        if score is None:
            logprobs.append(None)
            tops.append(None)
            continue
        top = {_named(token_bytes, t)[0]: _finite(lp) for t, lp in score[1]}
        top.setdefault(token, _finite(score[0]))
        logprobs.append(_finite(score[0]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, list[Any]]:
    return {key: first[key] + then[key] for key in first}


def logprobs_body(
    kind: Kind, events: list[TokenEvent], token_bytes: list[bytes], offset: int = 0
) -> dict[str, Any]:
    """``choices[0].logprobs`` for ``events``: chat's ``content`` entries or the completions format's
    parallel lists (``offset``: where the first event's text starts in the output)."""
    if kind == "chat":
        content = []
        for e in events:
            token, raw = _named(token_bytes, e.token_id)
            top = []
            for token_id, logprob in e.top_logprobs:
                name, alt = _named(token_bytes, token_id)
                top.append({"token": name, "logprob": _finite(logprob), "bytes": alt})
            content.append({"token": token, "logprob": _finite(e.logprob), "bytes": raw, "top_logprobs": top})
        return {"content": content}
    scored = [(e.token_id, (_finite(e.logprob), e.top_logprobs)) for e in events]
    return _legacy_body(token_bytes, scored, [e.text for e in events], offset)


def full_response(
    kind: Kind,
    request_id: str,
    created: int,
    model: str,
    choices: list[list[TokenEvent]],
    prompt_tokens: int,
    token_bytes: list[bytes] | None = None,
    echo: Echo | None = None,
    tools: frozenset[str] | None = None,
    keep: int | None = None,
) -> dict[str, Any]:
    """The non-streaming body (:class:`CompletionResponse` or :class:`ChatCompletionResponse`) of
    each choice's events; ``token_bytes`` where the request asked for log-probabilities, ``echo``
    where it asked for its prompt back, ``tools`` (their names) where the reply may hold calls. The
    statistics are the choices' together (:meth:`SpecStats.combined`). With ``keep`` (``best_of``
    above ``n``) only the best ``keep`` choices are returned (:func:`best_choices`); usage and the
    statistics still count every choice generated."""
    out = []
    for index, events in enumerate(choices if keep is None else best_choices(choices, keep)):
        text = "".join(e.text for e in events)
        logprobs = None
        if token_bytes is not None:
            offset = len(echo.text) if echo else 0
            logprobs = logprobs_body(kind, events, token_bytes, offset)
            if echo is not None and echo.scores is not None:
                logprobs = _joined(prompt_logprobs_body(echo.prompt_ids, echo.scores, token_bytes), logprobs)
        if echo is not None:
            text = echo.text + text
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(events[-1]),
        }
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            content, calls = parse_tool_calls(text, tools) if tools is not None else (text, [])
            if calls:
                bodies = [c.body() for c in calls]
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": bodies}
                choice["finish_reason"] = "tool_calls" if events[-1].finish_reason != "length" else "length"
        else:
            choice["text"] = text
        out.append(choice)
    stats = SpecStats.combined([events[-1].stats or SpecStats() for events in choices])
    return {
        "id": request_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, sum(len(events) for events in choices), stats.cached_prompt_tokens),
        "verispec": {"stats": stats.to_dict()},
    }


@dataclass(frozen=True)
class Echo:
    """A completion's prompt as echoed: its text, ids and (with logprobs) the engine's scores."""

    text: str
    prompt_ids: list[int]
    scores: list[TokenLogprobs | None] | None = None


@dataclass
class ChunkWriter:
    """Server-sent events of one streamed request, in the format of :mod:`verispec.server`."""

    kind: Kind
    request_id: str
    created: int
    model: str
    token_bytes: list[bytes] | None = None
    """Set where the request asked for log-probabilities."""
    choices: int = 1
    tools: frozenset[str] | None = None
    """The names of the tools offered, where replies are parsed for calls (text is held back while
    it may be a call)."""
    _held: dict[int, list[TokenEvent]] = field(default_factory=dict)
    """Per choice, tokens whose log-probabilities wait for its next chunk (their text was held back)."""
    _offset: dict[int, int] = field(default_factory=dict)
    _calls: dict[int, ToolCallStream] = field(default_factory=dict)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return sse(payload)

    def role(self) -> str | None:
        """Chat streams open with the assistant role and empty content, as OpenAI's do (one
        chunk per choice)."""
        if self.kind != "chat":
            return None
        return "".join(
            self._chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for index in range(self.choices)
        )

    def echo(self, echo: Echo, index: int = 0) -> str:
        """A completion stream's first chunk for choice ``index`` under ``echo``: the prompt (and,
        with logprobs, its tokens' log-probabilities)."""
        logprobs = None
        if self.token_bytes is not None and echo.scores is not None:
            logprobs = prompt_logprobs_body(echo.prompt_ids, echo.scores, self.token_bytes)
        self._offset[index] = len(echo.text)
        return self._chunk([{"index": index, "text": echo.text, "logprobs": logprobs, "finish_reason": None}])

    def token(self, event: TokenEvent, index: int = 0) -> str | None:
        """One chunk per token with text, of choice ``index``; None for an empty-text token that is
        not the last."""
        held = self._held.setdefault(index, [])
        held.append(event)
        text, calls = event.text, []
        if self.tools is not None:
            parser = self._calls.setdefault(index, ToolCallStream(self.tools))
            text, calls = parser.feed(text)
            if event.finish_reason is not None:
                rest, last = parser.finish()
                text, calls = text + rest, calls + last
        if not text and not calls and event.finish_reason is None:
            return None
        finish = openai_finish_reason(event) if event.finish_reason is not None else None
        if finish == "stop" and self.tools is not None and self._calls[index].sent:
            finish = "tool_calls"
        logprobs = None
        if self.token_bytes is not None:  # this chunk's token and any held back before it
            offset = self._offset.get(index, 0)
            logprobs = logprobs_body(self.kind, held, self.token_bytes, offset)
            self._offset[index] = offset + sum(len(e.text) for e in held)
        self._held[index] = []
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.kind == "chat":
            choice["delta"] = {"content": text}
            if calls:
                first = self._calls[index].sent - len(calls)
                deltas = [c.body(first + j) for j, c in enumerate(calls)]
                choice["delta"] = {"content": text or None, "tool_calls": deltas}
        else:
            choice["text"] = text
        return self._chunk([choice], verispec={"from_draft": event.from_draft, "token_id": event.token_id})

    def usage(self, prompt_tokens: int, completion_tokens: int, stats: SpecStats | None) -> str:
        return self._chunk(
            [],
            usage=usage(prompt_tokens, completion_tokens, stats.cached_prompt_tokens if stats else 0),
            verispec={"stats": (stats or SpecStats()).to_dict()},
        )


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
