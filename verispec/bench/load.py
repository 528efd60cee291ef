"""Client side of the serving benchmarks: streaming OpenAI requests sent by concurrent users.

A *level* is a closed loop: ``concurrency`` simulated users each run one conversation, wait for its
last chunk, and start the next, until ``len(specs)`` conversations are done. A conversation is one
request (a prompt's first turn) or, with ``RequestSpec.turns`` > 1, a request per turn, each
carrying the whole conversation so far (the model's own earlier answers, and what the workload adds
after them, e.g. a tool's result) as chat clients resend it. Closed-loop load (rather than requests
at a fixed arrival rate) keeps exactly ``concurrency`` requests in the server for most of the
level, which is what "batch size" means to the engine; the tail, where fewer are left, is why a
level should hold several conversations per user.

Times are client-side wall clock (``time.perf_counter``): time to first token counts from sending
the request to the first chunk that carries a token (an OpenAI stream may open with a role-only
chunk; that is not a token). Token counts come from the ``usage`` of the last chunk, which the
request asks for with ``stream_options.include_usage``; the chunks' own count is the fallback.

Only ``httpx`` is needed here (the ``openai`` client would hide the chunk timings and the verispec
fields behind its own types).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from verispec.bench.datasets import BenchPrompt, Message
from verispec.bench.replies import digest

FINISH_REASONS = ("stop", "length")
"""What a request that ran to its end reports (the server maps EOS to ``stop``)."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: which prompt, how long, and whether this client hangs up early."""

    prompt: BenchPrompt
    max_tokens: int
    disconnect_after: int | None = None
    """Close the connection after this many token chunks (a user who leaves); None reads to the end."""
    speculation: dict[str, Any] | None = None
    """The verispec ``speculation`` extension field, or None to use the server's settings."""
    turns: int = 1
    """How many of the prompt's turns to send, one request each, as one conversation."""
    user: str | None = None
    """OpenAI's ``user`` field: on a server that shares caches it narrows the cache scope to the
    requests that name the same user (None: the caller's whole scope)."""


@dataclass
class RequestResult:
    """What one client saw. ``seconds`` runs from sending to the end of the stream (or the hang-up)."""

    prompt_id: str
    category: str
    turn: int = 1
    """Which turn of its conversation this request asked (1-based)."""
    ok: bool = False
    """The stream ended with a finish reason and ``[DONE]`` (or the client hung up on purpose)."""
    disconnected: bool = False
    """The client closed the connection on purpose before the end."""
    status: int | None = None
    ttft: float | None = None
    seconds: float = 0.0
    output_tokens: int = 0
    token_chunks: int = 0
    draft_tokens: int = 0
    """Tokens whose chunk says ``from_draft`` (accepted draft tokens)."""
    finish_reason: str | None = None
    error: str | None = None
    stats: dict[str, Any] | None = None
    """The ``verispec.stats`` of the usage chunk (drafted, accepted, target_forward_passes, ...)."""
    text: str = field(default="", repr=False)
    """The streamed answer, which the next turn resends (written to results as a digest only:
    :mod:`verispec.bench.replies` compares replies across policies and runs)."""

    @property
    def tokens_per_second(self) -> float | None:
        """What this user experienced: output tokens over the whole request, queueing and prefill included."""
        return self.output_tokens / self.seconds if self.ok and self.seconds > 0 else None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first over the time after the first (time per output token, inverted)."""
        if not self.ok or self.ttft is None or self.output_tokens < 2 or self.seconds <= self.ttft:
            return None
        return (self.output_tokens - 1) / (self.seconds - self.ttft)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["text"]
        out["reply_digest"] = digest(self.text) if self.ok and not self.disconnected else None
        out["tokens_per_second"] = self.tokens_per_second
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        return out


@dataclass
class LevelRun:
    """The requests of one closed-loop level and its wall time (first send to last end)."""

    concurrency: int
    wall_seconds: float
    results: list[RequestResult] = field(default_factory=list)


def first_messages(prompt: BenchPrompt) -> list[Message]:
    """The messages of a prompt's first request: its system message, if any, and its first turn."""
    return [*prompt.before_turn(0), {"role": "user", "content": prompt.turns[0]}]


def request_body(
    spec: RequestSpec, model: str | None = None, messages: list[Message] | None = None
) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body of ``spec``: chat prompts go through the chat template.

    ``messages`` is the conversation so far (None: the first turn, :func:`first_messages`); a raw
    completion prompt sends their texts joined, as ``verispec bench`` does.
    """
    messages = first_messages(spec.prompt) if messages is None else messages
    body: dict[str, Any] = {
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if spec.speculation is not None:
        body["speculation"] = spec.speculation
    if spec.user is not None:
        body["user"] = spec.user
    if spec.prompt.chat:
        body["messages"] = messages
        return "/v1/chat/completions", body
    body["prompt"] = "".join(message["content"] for message in messages)
    return "/v1/completions", body


def parse_chunk(data: str) -> dict[str, Any] | None:
    """The JSON of one SSE ``data:`` payload, or None for the ``[DONE]`` sentinel."""
    if data.strip() == "[DONE]":
        return None
    return json.loads(data)


def apply_chunk(result: RequestResult, chunk: dict[str, Any], elapsed: float) -> bool:
    """Fold one stream chunk into ``result``; True when it carried a token.

    A chunk carries a token when it has the verispec ``token_id`` or non-empty text: the opening
    role-only chunk of a chat stream and the final usage chunk do not.
    """
    if "error" in chunk:
        error = chunk["error"]
        result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return False
    if chunk.get("usage"):
        result.output_tokens = int(chunk["usage"].get("completion_tokens", result.output_tokens))
    extension = chunk.get("verispec") or {}
    if isinstance(extension.get("stats"), dict):
        result.stats = extension["stats"]
    token = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text = choice.get("text", delta.get("content"))
        if isinstance(text, str):
            result.text += text
        if "token_id" in extension or text:
            token = True
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if token:
        result.token_chunks += 1
        result.draft_tokens += bool(extension.get("from_draft"))
        if result.ttft is None:
            result.ttft = elapsed
    return token


async def send(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    model: str | None = None,
    messages: list[Message] | None = None,
    turn: int = 1,
) -> RequestResult:
    """Send ``spec`` (with ``messages``, the conversation up to its ``turn``-th user turn; None: the
    first) as a streaming request and read it to the end (or hang up as it asks).

    Never raises for a failed request: the failure is the result (``ok`` False, ``error`` set), so
    one bad request cannot hide the others' measurements. Cancellation still propagates.
    """
    path, body = request_body(spec, model, messages)
    result = RequestResult(prompt_id=spec.prompt.id, category=spec.prompt.category, turn=turn)
    start = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", path, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                chunk = parse_chunk(line[5:])
                if chunk is None:
                    done = True
                    break
                token = apply_chunk(result, chunk, time.perf_counter() - start)
                if result.error is not None:
                    break
                # Leaving a stream whose last token has come is no hang-up: read it to the end.
                leave = spec.disconnect_after is not None and result.token_chunks >= spec.disconnect_after
                if token and leave and result.finish_reason is None:
                    result.disconnected = True
                    break
            # Leaving the ``async with`` before the body ends closes the connection: the server sees
            # the client go, as it would when a browser tab closes.
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.seconds = time.perf_counter() - start
    if result.output_tokens < result.token_chunks:
        result.output_tokens = result.token_chunks  # no usage chunk (hung up, or an error)
    if result.error is None and not result.disconnected:
        if not done:
            result.error = "the stream ended without [DONE]"
        elif result.finish_reason not in FINISH_REASONS:
            result.error = f"the stream ended with finish_reason {result.finish_reason!r}"
    result.ok = result.error is None
    return result


async def converse(
    client: httpx.AsyncClient, spec: RequestSpec, model: str | None = None
) -> list[RequestResult]:
    """``spec``'s conversation: a request per turn (``spec.turns`` of them at most), each sent when
    the previous answer has streamed to its end and carrying the whole conversation so far, built
    from the answers as :meth:`BenchPrompt.before_turn` says. A failed or abandoned turn ends it:
    the next one would need its answer."""
    prompt = spec.prompt
    messages: list[Message] = []
    results: list[RequestResult] = []
    answer = None
    for index in range(min(spec.turns, len(prompt.turns))):
        messages += prompt.before_turn(index, answer)
        messages.append({"role": "user", "content": prompt.turns[index]})
        result = await send(client, spec, model, list(messages), turn=index + 1)
        results.append(result)
        if not result.ok or result.disconnected:
            break
        answer = result.text
    return results


async def run_level(
    client: httpx.AsyncClient, specs: Sequence[RequestSpec], concurrency: int, model: str | None = None
) -> LevelRun:
    """Run the conversations of ``specs`` from ``concurrency`` closed-loop users; the results of
    their requests come back in ``specs`` order, each conversation's turns in order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[list[RequestResult]] = [[] for _ in specs]
    next_index = 0

    async def user() -> None:
        nonlocal next_index
        while next_index < len(specs):
            index = next_index
            next_index += 1  # no await in between: the event loop runs one user at a time
            results[index] = await converse(client, specs[index], model)

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(min(concurrency, len(specs)))))
    wall = time.perf_counter() - start
    return LevelRun(concurrency, wall, [r for conversation in results for r in conversation])


def client_for(
    base_url: str, concurrency: int, timeout: float, api_key: str | None = None
) -> httpx.AsyncClient:
    """An HTTP client with a connection per user, so no request waits for a pooled connection.

    ``timeout`` bounds each read (the gap between two chunks, or the wait for the first one), not the
    whole request: a long generation is fine, a stalled server is an error. ``api_key`` goes with
    every request as ``Authorization: Bearer``.
    """
    return httpx.AsyncClient(
        base_url=base_url,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        timeout=httpx.Timeout(timeout, connect=30.0),
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4),
        trust_env=False,  # a proxy from the environment must not sit between the bench and loopback
    )
