"""``verispec serve``: an OpenAI-compatible HTTP server over the batched speculative engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /`` (the web
page, ``verispec/server/static/index.html``, when installed), ``GET /docs`` (the OpenAPI schema).
With API keys (``--api-key``, ``--api-keys-file``) every route but ``/health`` and ``/`` needs one
(:mod:`verispec.server.auth`); the key's tenant, narrowed by the body's ``user``, is the request's
cache scope: the prefix cache and suffix decoding's earlier outputs are shared only within it.

Extensions to OpenAI's request bodies (the openai client sends them through ``extra_body``):

- ``"speculation": {"enabled": true, "num_speculative_tokens": null}``: per-request speculation;
  ``enabled: false`` decodes plainly, a number caps the draft length (at most the server's ``-k``);
- ``"top_k"``: keep the k most likely tokens (0 or -1 disables);
- ``"repetition_penalty"``: vLLM's and transformers' (1 is off). OpenAI's ``presence_penalty``,
  ``frequency_penalty`` and ``logit_bias`` are taken as well (:mod:`verispec.penalties`).

Structured output: chat ``response_format`` (``json_object``, ``json_schema``) and, on both
endpoints, vLLM's ``"structured_outputs": {"json" | "regex" | "choice" | "grammar": ...}`` (one of
them) constrain the output (:mod:`verispec.structured`).

Tools (chat ``tools``, ``tool_choice`` ``auto``, ``none``, ``required`` or a named function; the
last two constrain the reply to one call): the model sees them through its chat
template, and a call in its reply (a Hermes ``<tool_call>`` block, or a reply that opens with a JSON
call, see :mod:`verispec.server.tools`) comes back as ``message.tool_calls`` with ``finish_reason``
``"tool_calls"``. Streamed, text that may be a call is held back, and each call arrives whole in one
chunk's ``delta.tool_calls`` (``index``, ``id``, ``type``, ``function.name``, ``function.arguments``);
such a chunk's ``verispec`` names the last token it holds.

With ``n`` > 1 every choice is its own sequence; stream chunks carry one choice each, told apart by
``choices[0].index`` (chat opens with one role chunk per choice), each choice ends with its own
``finish_reason``, and ``usage`` and ``stats`` count all the choices together.

Log-probabilities (chat ``logprobs``/``top_logprobs``, completions ``logprobs``) follow OpenAI's
formats; they are the target's raw distribution (before temperature, top-k and top-p). In a stream
each chunk carries the entries of its token and of any token whose text was held back before it.
A completion with ``echo`` starts with the prompt (streamed: a first chunk per choice holding the
prompt's text and, with ``logprobs``, its tokens' entries, the first null).

Non-streaming responses are OpenAI's, plus ``"verispec": {"stats": {...}}``: the request's
speculation statistics (:meth:`verispec.metrics.SpecStats.to_dict`: ``drafted``, ``accepted``,
``acceptance_rate``, ``mean_accepted_length``, ``per_position_acceptance``, ``tokens_per_second``,
``output_tokens``, ``prompt_tokens``, ``target_forward_passes``, ``seconds``).

Stream format (``"stream": true``), server-sent events, each ``data: <json>\\n\\n``:

1. chat only: one opening chunk ``{"object": "chat.completion.chunk", "choices": [{"index": 0,
   "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}``, with no ``verispec``
   field (it carries no token);
2. one chunk per generated token that adds text (a token whose text is still held back, such as
   part of a multi-byte character, gets no chunk of its own; its text arrives with a later token)::

       chat:        {"id": ..., "object": "chat.completion.chunk", "created": ..., "model": ...,
                     "choices": [{"index": 0, "delta": {"content": "text"}, "logprobs": null,
                                  "finish_reason": null}],
                     "verispec": {"from_draft": true, "token_id": 1234}}
       completions: {"id": ..., "object": "text_completion", "created": ..., "model": ...,
                     "choices": [{"index": 0, "text": "text", "logprobs": null, "finish_reason": null}],
                     "verispec": {"from_draft": false, "token_id": 1234}}

   ``from_draft`` is true when the token was proposed by the draft (model or n-gram lookup) and
   accepted by the target, false for the target's own tokens (the corrected or bonus token of a
   step, or any token of plain decoding);
3. the last token's chunk always comes, even with empty text, and has ``finish_reason`` ``"stop"``
   (a stop string or the model's end-of-sequence token), ``"length"`` (``max_tokens`` reached) or,
   with tools, ``"tool_calls"``;
4. with ``"stream_options": {"include_usage": true}``: a chunk with ``"choices": []``,
   ``"usage": {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
   {"cached_tokens"}}`` and
   ``"verispec": {"stats": {...}}`` (as in non-streaming responses);
5. ``data: [DONE]``.

If generation fails after the stream started, an ``{"error": {"message", "type", "param", "code"}}``
event replaces the remaining chunks, followed by ``data: [DONE]``.

Errors before a response starts are OpenAI's: status 400 (``invalid_request_error``; bad JSON, wrong
or missing fields, a prompt or ``max_tokens`` over the context), 401 (a missing or unknown API key,
with ``WWW-Authenticate: Bearer``), 404 ``model_not_found``, 413 (body
too large), 429 with ``Retry-After`` (queue full), 503 (engine stopped), as
``{"error": {"message", "type", "param", "code"}}``.
"""

from verispec.server.app import create_app
from verispec.server.launch import bind_socket, cap_malloc_arenas, serve

__all__ = ["bind_socket", "cap_malloc_arenas", "create_app", "serve"]
