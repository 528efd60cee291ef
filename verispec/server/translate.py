"""Between OpenAI bodies and the engine: requests in, responses and stream chunks out.

:func:`build_request` turns a validated body into an engine :class:`~verispec.engine.Request`. It
tokenizes, so it runs on the engine thread (through :meth:`AsyncEngine.call`): Hugging Face fast
tokenizers are not safe to use from two threads at once, and the engine thread detokenizes every
step. Every refusal it raises is an :class:`APIError` naming the offending field. The rest of this
module formats what the engine produced (see :mod:`verispec.server` for the stream format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from verispec.detok import token_text
from verispec.engine import Request, SpecEngine, TokenLogprobs
from verispec.errors import VerispecError
from verispec.metrics import SpecStats
from verispec.server.errors import APIError
from verispec.server.protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    MessageToolCall,
    NamedToolChoice,
    SamplingRequest,
)
from verispec.server.tools import ToolCallStream, parse_tool_calls
from verispec.structured import Structured
from verispec.types import TokenEvent

GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (as vLLM does): dividing logits by a subnormal number
overflows to inf and the softmax to NaN."""

MAX_CHARS_PER_TOKEN = 64
"""A text prompt longer than context x this many characters cannot fit (no tokenizer's tokens are
that long on average), so it is refused before spending time tokenizing megabytes."""

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat defaults to the rest of the context."""

Kind = Literal["completion", "chat"]


def check_model(body: SamplingRequest, served: str) -> None:
    if body.model is not None and body.model != served:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist; this server serves `{served}` (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def reject_unsupported(body: SamplingRequest) -> None:
    """400 for options that would change the answer in ways this server does not implement."""
    generated, keep = _choice_counts(body)
    n = body.n or 1
    refusals: list[tuple[bool, str, str]] = [
        (generated < n, "best_of", f"best_of ({generated}) must be >= n ({n})"),
        (keep is not None and bool(body.stream), "best_of", "best_of above n cannot be streamed"),
    ]
    if isinstance(body, ChatCompletionRequest):
        refusals += [
            (
                body.top_logprobs is not None and not body.logprobs,
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ),
        ]
    for refused, param, message in refusals:
        if refused:
            raise APIError(400, message, param=param, code="unsupported_parameter")


def single_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (OpenAI also takes a list of prompts)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"send one prompt per request (got a list of {len(prompt)}); requests run in parallel",
                param="prompt",
            )
        return prompt[0]  # type: ignore[return-value]
    return prompt  # type: ignore[return-value]


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content, ``developer`` as ``system``, earlier
    tool calls with their arguments decoded (templates write them with ``tojson``)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or [])
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                _template_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(m.tool_calls)
            ]
        out.append(message)
    return out


def _template_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{where}.function.arguments is not JSON: {exc}", param=where) from exc
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


@dataclass(frozen=True)
class Prepared:
    requests: list[Request]
    """One engine request per choice generated (``best_of``, else ``n``), in choice order."""
    prompt_tokens: int
    token_bytes: list[bytes] | None = None
    """Each token id's bytes, where the request asked for log-probabilities (names their tokens)."""
    echo: str | None = None
    """The prompt's text, where a completion request asked for ``echo``."""
    tools: frozenset[str] | None = None
    """The names of the tools offered, where the reply is parsed for calls (a chat request with
    tools, not ``tool_choice: none``)."""
    keep: int | None = None
    """Where more choices are generated than returned (``best_of`` above ``n``): how many to return."""


def build_request(
    engine: SpecEngine,
    body: CompletionRequest | ChatCompletionRequest,
    request_id: str,
) -> Prepared:
    """Tokenize and validate ``body`` into an engine request (call on the engine thread)."""
    asked_by, structured = _structured(body)
    offered = _offered_tools(body) if isinstance(body, ChatCompletionRequest) else None
    if isinstance(body, ChatCompletionRequest):
        ids, source, prompt, ends = _chat_ids(engine, body, offered), "messages", None, ()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        prompt = single_prompt(body)
        ids, ends = _prompt_ids(engine, prompt, body.suffix)
        source = "prompt"
        max_tokens = body.max_tokens
        logprobs = body.logprobs
    generated, keep = _choice_counts(body)
    context = engine.target.max_context
    if not ids:
        raise APIError(400, "the prompt is empty (it encodes to no tokens)", param=source)
    if len(ids) >= context:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens but the model's context is {context} tokens; shorten it",
            param=source,
            code="context_length_exceeded",
        )
    room = context - len(ids)
    if max_tokens is None:
        max_tokens = (
            room if isinstance(body, ChatCompletionRequest) else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        )
    elif max_tokens > room:
        raise APIError(
            400,
            f"max_tokens is {max_tokens} but the prompt's {len(ids)} tokens leave room for {room} "
            f"in the model's context of {context} tokens",
            param="max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens",
            code="context_length_exceeded",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop")
    temperature = body.temperature or 0.0
    spec = body.speculation
    try:
        request = engine.make_request(
            ids,
            max_new_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_k=max(0, body.top_k or 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=stop,
            stop_token_ids=[*(body.stop_token_ids or []), *ends],
            num_speculative_tokens=None
            if spec is None
            else (spec.num_speculative_tokens if spec.enabled else 0),
            request_id=request_id,
            logprobs=0 if logprobs is None and keep is not None else logprobs,  # best_of ranks by them
            prompt_logprobs=logprobs if getattr(body, "echo", False) else None,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias),
            structured=structured,
        )
        token_bytes = None if logprobs is None else engine.token_bytes()
    except VerispecError as exc:
        param = asked_by if str(exc).startswith("structured output") else _param_of(str(exc))
        raise APIError(400, str(exc), param=param) from exc
    echo = None
    if prompt is not None and getattr(body, "echo", False):
        echo = prompt if isinstance(prompt, str) else _decoded(engine, ids)
    tools = None if offered is None else frozenset(t["function"]["name"] for t in offered)
    asked_for = "n" if keep is None else "best_of"
    return Prepared(_choices(engine, request, generated, asked_for), len(ids), token_bytes, echo, tools, keep)


def _choice_counts(body: SamplingRequest) -> tuple[int, int | None]:
    """Choices to generate and, where fewer are returned (``best_of`` > ``n``), how many."""
    n = body.n or 1
    best_of = body.best_of or n
    return best_of, (n if best_of > n else None)


def best_choices(choices: list[list[TokenEvent]], keep: int) -> list[list[TokenEvent]]:
    """The ``keep`` choices with the highest mean log-probability per token, best first (the rule
    OpenAI gives for ``best_of``; a sum would favour short completions). Ties keep choice order."""

    def score(events: list[TokenEvent]) -> float:
        logprobs = [e.logprob for e in events if e.logprob is not None]
        return sum(logprobs) / len(logprobs) if logprobs else float("-inf")

    ranked = sorted(range(len(choices)), key=lambda i: -score(choices[i]))
    return [choices[i] for i in ranked[:keep]]


def _structured(body: CompletionRequest | ChatCompletionRequest) -> tuple[str | None, Structured | None]:
    """What the output must match and the field that asked: ``structured_outputs``,
    ``response_format`` or a forced ``tool_choice``, one at most."""
    found: list[tuple[str, Structured]] = []
    wanted = body.structured_outputs
    if wanted is not None:
        values = {
            "json": wanted.json_,
            "regex": wanted.regex,
            "choice": wanted.choice,
            "grammar": wanted.grammar,
        }
        given = [(kind, value) for kind, value in values.items() if value is not None]
        if len(given) != 1:
            raise APIError(
                400,
                "structured_outputs needs exactly one of json, regex, choice, grammar",
                param="structured_outputs",
            )
        found.append(("structured_outputs", Structured(*given[0])))
    if isinstance(body, ChatCompletionRequest):
        fmt = body.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", Structured("json", {"type": "object"})))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format json_schema needs json_schema", param="response_format")
            found.append(("response_format", Structured("json", fmt.json_schema.schema_)))
        call = _forced_call(body)
        if call is not None:
            found.append(("tool_choice", call))
    if len(found) > 1:
        raise APIError(
            400, f"{found[0][0]} and {found[1][0]} both constrain the output; give one", param=found[1][0]
        )
    return found[0] if found else (None, None)


def _forced_call(body: ChatCompletionRequest) -> Structured | None:
    """``required`` or a named function: the reply is one JSON call (``{"name": ..., "arguments":
    {...}}``, the arguments following the tool's parameter schema), which the tool-call parser reads."""
    choice = body.tool_choice
    if choice is not None and choice != "none" and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice in (None, "none", "auto") or not body.tools:
        return None
    tools = body.tools
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in body.tools if t.function.name == choice.function.name]
        if not tools:
            raise APIError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return Structured("json", calls[0] if len(calls) == 1 else {"anyOf": calls})


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids (the engine checks the ids against the vocabulary)."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _decoded(engine: SpecEngine, ids: list[int]) -> str:
    """A token-id prompt's text, for ``echo``."""
    if engine.tokenizer is None:
        raise APIError(
            400,
            f"echo needs a tokenizer to write the prompt, and {engine.target.name} has none",
            param="echo",
        )
    return str(engine.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _choices(engine: SpecEngine, request: Request, n: int, param: str = "n") -> list[Request]:
    """``n`` copies of ``request`` with ids of their own (``<id>-<i>``) and, for a seeded request,
    seeds seed + i: the same request gives the same choices, and they differ from one another.
    ``param``: the field that asked for ``n`` (``best_of`` where it is the larger)."""
    if n == 1:
        return [request]
    batch, waiting = engine.scheduler.max_batch_size, engine.scheduler.max_waiting
    if n > batch + waiting:
        raise APIError(
            400,
            f"{param} is {n}, but this server holds at most {batch + waiting} sequences at once "
            f"({batch} running, {waiting} waiting); ask for fewer",
            param=param,
        )
    seed = request.sampling.seed
    out = []
    for i in range(n):
        sampling = request.sampling
        if seed is not None:
            sampling = replace(sampling, seed=seed + i if seed + i < 2**64 else seed + i - 2**64)
        out.append(replace(request, sampling=sampling, request_id=f"{request.request_id}-{i}"))
    return out


def _prompt_ids(
    engine: SpecEngine, prompt: str | list[int], suffix: str | None = None
) -> tuple[list[int], tuple[int, ...]]:
    """A completion's prompt ids and the tokens that end its output besides EOS: with ``suffix``, a
    fill-in-the-middle prompt and the end-of-text tokens that close a middle (:mod:`verispec.fim`)."""
    limit = engine.target.max_context * MAX_CHARS_PER_TOKEN
    if isinstance(prompt, str) and len(prompt) + len(suffix or "") > limit:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} characters, far more than the model's context of "
            f"{engine.target.max_context} tokens can hold; shorten it",
            param="prompt",
            code="context_length_exceeded",
        )
    if suffix is not None:
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs a text prompt", param="suffix", code="unsupported_parameter")
        try:
            fim = engine.fill_in_middle(prompt, suffix)
        except VerispecError as exc:
            raise APIError(400, str(exc), param="suffix") from exc
        return fim.ids, fim.stop_token_ids
    try:
        return engine.encode(prompt), ()
    except VerispecError as exc:
        raise APIError(400, str(exc), param="prompt") from exc


def _offered_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the template shows the model: none under ``tool_choice: none``."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def _chat_ids(
    engine: SpecEngine, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> list[int]:
    messages = chat_messages(body.messages)
    limit = engine.target.max_context * MAX_CHARS_PER_TOKEN
    if sum(len(m["content"] or "") for m in messages) > limit:
        raise APIError(
            400,
            "the messages are far longer than the model's context",
            param="messages",
            code="context_length_exceeded",
        )
    try:
        return engine.apply_chat_template(messages, tools)
    except VerispecError as exc:
        raise APIError(400, str(exc), param="tools" if tools and "tools" in str(exc) else "messages") from exc
    except Exception as exc:  # the template's own checks (role order, ...) raise jinja errors
        raise APIError(
            400, f"the chat template cannot render these messages: {exc}", param="messages"
        ) from exc


def _param_of(message: str) -> str | None:
    """The request field an engine validation message is about (they start with the setting's name)."""
    for setting, param in (
        ("temperature", "temperature"),
        ("top_k", "top_k"),
        ("top_p", "top_p"),
        ("num_speculative_tokens", "speculation.num_speculative_tokens"),
        ("stop_token_ids", "stop_token_ids"),
        ("stop", "stop"),
        ("max_new_tokens", "max_tokens"),
        ("logprobs", "logprobs"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("repetition_penalty", "repetition_penalty"),
        ("logit_bias", "logit_bias"),
    ):
        if message.startswith(setting):
            return param
    return None


# ------------------------------------------------------------------------------------------ output


def openai_finish_reason(event: TokenEvent) -> str:
    """OpenAI knows 'stop' and 'length'; the model's EOS is a 'stop'."""
    return "length" if event.finish_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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
        "usage": usage(prompt_tokens, sum(len(events) for events in choices)),
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
            usage=usage(prompt_tokens, completion_tokens),
            verispec={"stats": (stats or SpecStats()).to_dict()},
        )


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
