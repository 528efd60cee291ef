"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are validated strictly (``"max_tokens": "5"`` or ``"stream": 1`` is a 400, as with OpenAI)
so that a client bug shows up as an error instead of a silent conversion. Unknown fields are ignored:
clients send fields this server has no use for (``metadata``, ``store``). Values a field
takes that this server does not implement (``best_of`` with ``stream``, say) get a 400 that names
the field, never a silently different answer.
Response models describe the non-streaming bodies in the OpenAPI schema; streamed chunks are
documented in :mod:`verispec.server`.

The fields that set one of verispec's settings for a request (``temperature``, ``top_k``, ``top_p``,
``seed``, ``speculation.num_speculative_tokens``) take their kind, bounds, default and description
from that setting's config field (:func:`setting_field`), and say which in the schema
(``x-verispec-setting``); :func:`request_param` maps a refused setting back to its field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from verispec.config import MAX_LOGPROBS
from verispec.penalties import MAX_PENALTY
from verispec.settings import setting

MAX_STOP_STRINGS = 16
"""More stop strings than this is almost certainly a client bug (OpenAI allows 4)."""
MAX_CHOICES = 128
"""Most choices (``n``) per request, as OpenAI allows."""
MAX_TOOLS = 128
"""Most tools per request, as OpenAI allows."""
MAX_USER_CHARS = 1024
"""The longest ``user``: it becomes part of the request's cache scope, kept with cached entries."""


def _integral(value: object) -> object:
    """JSON Schema counts 5.0 as an integer, so the strict models accept it as 5 (but not "5" or 5.5)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(**constraints: int) -> Any:
    """An int type with ``constraints`` (checked, and shown in the schema) that takes 5.0 as 5."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]  # Field first: see the schema


def setting_field(name: str, *, server_default: bool = False, note: str = "", **bounds: float) -> Any:
    """The type of a request field that sets the setting ``name`` (:mod:`verispec.settings`) for one
    request: its kind, bounds, default and description are the setting's, and the schema names it
    (``x-verispec-setting``). ``bounds`` replace the setting's where the protocol takes more (vLLM's
    ``top_k: -1``, a per-request k of 0); ``note`` adds what the protocol means beyond the setting.
    ``server_default``: null (the default) keeps the server's own value of a server-wide setting,
    which the description says and ``x-verispec-default`` gives."""
    s = setting(name)
    limits = {**(s.bounds.constraints() if s.bounds is not None else {}), **bounds}
    kind: Any = integer(**limits) if s.kind is int else Annotated[float, Field(**limits, allow_inf_nan=False)]
    extra: dict[str, Any] = {"x-verispec-setting": name}
    default = s.default
    if server_default:
        note += f" Null (the default) keeps the server's {s.flag()} ({s.default} unless set)."
        extra["x-verispec-default"] = s.default
        default = None
    text = re.sub(r"\bNone\b", "null", f"{s.help} {note}".strip())  # JSON's word for it
    described = Field(default=default, description=text, json_schema_extra=extra)
    return Annotated[kind | None, described]


TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]  # type: ignore[valid-type]
Text = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SpeculationOptions(_Strict):
    """verispec extension: speculation settings for this request (``extra_body`` in the openai client)."""

    enabled: bool = True
    """False decodes this request plainly (same output under greedy decoding, no drafts)."""
    num_speculative_tokens: setting_field(  # type: ignore[valid-type]  # default: in the type
        "num_speculative_tokens",
        server_default=True,
        ge=0,
        note="0 decodes this request plainly; values above the server's are cut to it.",
    )


class StructuredOutputs(_Strict):
    """verispec extension, vLLM's ``structured_outputs``: the output must match exactly one of these
    (see :mod:`verispec.structured`)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    """``json``: a JSON schema (``{"type": "object"}`` for any object)."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect)."""


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send a last chunk with ``usage`` and the speculation statistics before ``[DONE]``."""


class SamplingRequest(_Strict):
    """The fields both generation endpoints share."""

    model: str | None = None
    """The served model name (``GET /v1/models``); null means the one this server serves."""
    max_tokens: integer(ge=1) | None = None  # type: ignore[valid-type]
    """Tokens to generate at most; prompt plus max_tokens must fit in the model's context."""
    # The settings' fields carry their defaults in their types (setting_field); null takes it too.
    temperature: setting_field("temperature", note="Values below 1e-5 count as 0.")  # type: ignore[valid-type]
    top_p: setting_field("top_p")  # type: ignore[valid-type]
    top_k: setting_field("top_k", ge=-1, note="Extension (as in vLLM); -1 also keeps them all.")  # type: ignore[valid-type]
    seed: setting_field("seed", ge=-(2**63), le=2**64 - 1)  # type: ignore[valid-type]
    stop: str | list[str] | None = None
    """Stop strings (the output ends before the first match); needs a model with a tokenizer."""
    stop_token_ids: list[integer(ge=0)] | None = None  # type: ignore[valid-type]
    """vLLM's extension: token ids that end the output as EOS does (kept out of the text if special)."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: integer(ge=1, le=MAX_CHOICES) | None = None  # type: ignore[valid-type]
    """Choices to generate, each its own sequence in the batch (sampled independently; with a
    ``seed``, choice i uses seed + i)."""
    best_of: integer(ge=1, le=MAX_CHOICES) | None = None  # type: ignore[valid-type]
    """Generate this many completions (at least ``n``) and return the ``n`` with the highest
    log-probability per token, best first (OpenAI's rule); all of them count in ``usage``. Not with
    ``stream`` where it exceeds ``n``: the best is known only at the end."""
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    """Subtracted from the logit of every token already in the output (before temperature)."""
    frequency_penalty: float | None = Field(
        default=None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False
    )
    """Subtracted from a token's logit once per time it is already in the output."""
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Extension (as in vLLM and transformers): a token seen in the prompt or the output has a
    positive logit divided by it and a negative one multiplied; 1 is off."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's format) to a value in [-100, 100] added to its logit.
    Penalties and bias keep speculation lossless: each drafted position is judged with the
    penalties of its own context (see :mod:`verispec.penalties`)."""
    speculation: SpeculationOptions | None = None
    """verispec extension: per-request speculation settings."""
    structured_outputs: StructuredOutputs | None = None
    """Extension (as in vLLM): constrain the output to a JSON schema, regex, choice or grammar."""
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    """OpenAI's end-user id. Here it narrows which requests share cached prompts and outputs: to
    those of the same user within the caller's tenant (the API key's). It never widens that: a
    request of another tenant with the same ``user`` shares nothing. Empty narrows nothing."""


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    """Text, or token ids; a list of prompts must hold exactly one (send one request per prompt)."""
    echo: bool | None = None
    """Return the prompt before the completion; with ``logprobs``, the prompt's tokens are scored
    too (the first gets null), which is how evaluation harnesses ask for a text's likelihood."""
    suffix: str | None = None
    """Text after the completion: the prompt and this become a fill-in-the-middle prompt for models
    trained for it (:mod:`verispec.fim`; others get a 400)."""
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # type: ignore[valid-type]
    """Return each token's log-probability and the ``logprobs`` most likely tokens at its position
    (the sampled one always among them): the target's raw distribution, before temperature, top-k
    and top-p."""


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str
    """The arguments as a JSON object encoded in a string, as OpenAI sends them."""


class MessageToolCall(_Strict):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    """``developer`` (OpenAI's newer name for ``system``) is sent to the template as ``system``."""
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of the arguments, shown to the model through the chat template."""
    strict: bool | None = None


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``; the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None  # type: ignore[valid-type]
    """OpenAI's newer name for max_tokens; give one or the other."""
    logprobs: bool | None = None
    """Return each output token's log-probability (the target's raw distribution, before
    temperature, top-k and top-p) in ``choices[0].logprobs.content``."""
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None  # type: ignore[valid-type]
    """With ``logprobs``: also the most likely tokens at each position, this many."""
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    """Functions the model may call, shown to it through its chat template (the template must take
    tools, as Qwen2.5's does); calls come back in OpenAI's ``tool_calls`` (see
    :mod:`verispec.server.tools`)."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """``auto`` (the default with tools) lets the model choose; ``none`` hides the tools from it;
    ``required`` and a named function constrain the reply to one call (a JSON call of an offered
    tool, or of that one) through structured output."""
    parallel_tool_calls: bool | None = None
    """Accepted; the model may always make several calls in one reply."""
    response_format: ResponseFormat | None = None
    """``json_object`` (any JSON object) or ``json_schema`` (``json_schema.schema``): the reply is
    constrained to it, losslessly under speculation (see :mod:`verispec.structured`)."""


# --------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache (as OpenAI reports them)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class StatsExtension(BaseModel):
    """verispec extension on responses: the request's speculation statistics
    (:meth:`verispec.metrics.SpecStats.to_dict`: drafted, accepted, acceptance_rate,
    mean_accepted_length, per_position_acceptance, tokens_per_second, seconds)."""

    stats: dict[str, Any]


class TopLogprob(BaseModel):
    token: str
    """The token's text; ``bytes:`` and its escaped bytes where it holds part of a character."""
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
    """The most likely tokens at this position, most likely first (``top_logprobs`` of them)."""


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per output token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    """With ``echo``, the prompt's first token has null: nothing predicts it."""
    top_logprobs: list[dict[str, float] | None]
    """The ``logprobs`` most likely tokens at each position, and the sampled one."""
    text_offset: list[int]
    """Where each token's text starts in ``text`` (a token still inside a character adds none)."""


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    verispec: StatsExtension


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """Null when the reply is only tool calls."""
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    verispec: StatsExtension


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "verispec"
    max_model_len: int
    """The model's context in tokens: prompt plus max_tokens must fit in it."""
    verispec: dict[str, Any]
    """The speculation setup: target, draft, method, num_speculative_tokens, depth policy."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _setting_params() -> dict[str, str]:
    """Each setting a request field sets, with that field's path (OpenAI's ``param``)."""
    out = {}
    for model, prefix in ((SamplingRequest, ""), (SpeculationOptions, "speculation.")):
        for name, info in model.model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and "x-verispec-setting" in extra:
                out[str(extra["x-verispec-setting"])] = prefix + name
    return out


SETTING_PARAMS = _setting_params()
ENGINE_PARAMS = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}
"""The engine's names of request options whose request field is called otherwise (every other
option has its field's name: ``presence_penalty``, ``logit_bias``, ``stop_token_ids``, ...)."""


def request_param(name: str) -> str | None:
    """The request field that sets the setting or option ``name`` (a
    :attr:`~verispec.errors.ConfigError.field`), None where no field does."""
    param = SETTING_PARAMS.get(name) or ENGINE_PARAMS.get(name)
    if param is not None:
        return param
    known = CompletionRequest.model_fields.keys() | ChatCompletionRequest.model_fields.keys()
    return name if name in known else None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body; ``type`` is ``invalid_request_error`` for every 4xx caused by the input."""

    error: ErrorInfo


class Health(BaseModel):
    status: Literal["ok"]
