"""OpenAI request bodies into engine requests.

:func:`build_request` turns a validated body into an engine :class:`~verispec.engine.Request`. It
tokenizes, so it runs on the engine thread (through :meth:`AsyncEngine.call`): Hugging Face fast
tokenizers are not safe to use from two threads at once, and the engine thread detokenizes every
step. Every refusal it raises is an :class:`APIError` naming the offending field: the server's own
checks name it where they make it, and the engine's name their setting
(:class:`~verispec.errors.ConfigError`), which :func:`~verispec.server.errors.from_verispec_error`
turns into the field. What the engine produces goes out through :mod:`verispec.server.responses`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from verispec.engine import Request, SpecEngine
from verispec.errors import ConfigError, VerispecError
from verispec.server.errors import APIError, from_verispec_error
from verispec.server.protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    MessageToolCall,
    NamedToolChoice,
    SamplingRequest,
)
from verispec.structured import Structured

GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (as vLLM does): dividing logits by a subnormal number
overflows to inf and the softmax to NaN."""

MAX_CHARS_PER_TOKEN = 64
"""A text prompt longer than context x this many characters cannot fit (no tokenizer's tokens are
that long on average), so it is refused before spending time tokenizing megabytes."""

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat defaults to the rest of the context."""


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
    cache_scope: str | None = None,
) -> Prepared:
    """Tokenize and validate ``body`` into an engine request (call on the engine thread).

    ``cache_scope``: who the request shares cached prompts and outputs with, from the caller's
    API key and ``user`` (:func:`verispec.server.auth.cache_scope`), never from the body alone;
    None keeps it private."""
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
            cache_scope=cache_scope,
        )
    except ConfigError as exc:  # a setting or option refused: its field
        raise from_verispec_error(exc) from exc
    except VerispecError as exc:
        # The engine names the option it refuses (above), all but the grammar, which compiles
        # against the vocabulary here and was asked for by one of the structured-output fields.
        raise APIError(400, str(exc), param=asked_by) from exc
    try:
        token_bytes = None if logprobs is None else engine.token_bytes()
    except VerispecError as exc:
        raise APIError(400, str(exc), param="logprobs") from exc
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
