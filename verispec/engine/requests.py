"""Request building: a prompt and its settings become a validated :class:`Request`, or a
:class:`~verispec.errors.VerispecError` with a message fit for the user.

Everything that can be refused is refused here, before the request is queued: a bad grammar, a
prompt longer than the context, out-of-range token ids. So the step never fails a request for its
settings, and the server can answer 400 instead of ending a stream with an error. The tokenizer's
uses (chat templates, fill-in-the-middle, structured output's vocabulary view, logprobs' token
bytes) live here too: they all turn text into what the engine decodes, or back.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from verispec.config import MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS, SamplingConfig
from verispec.detok import token_bytes_table
from verispec.engine.state import Request
from verispec.errors import ConfigError, VerispecError
from verispec.fim import FimPrompt, fim_prompt
from verispec.models.base import CausalLM
from verispec.penalties import Penalties
from verispec.structured import Constraint, Structured, ll_tokenizer

Prompt = str | Seq[int]


class RequestBuilder:
    """Validates requests for one target (and its tokenizer, if any)."""

    def __init__(self, target: CausalLM, tokenizer: Any | None, max_speculative_tokens: int) -> None:
        """``max_speculative_tokens``: the engine's k, 0 without a proposer (requests are cut to it)."""
        self.target = target
        self.tokenizer = tokenizer
        self.max_speculative_tokens = max_speculative_tokens
        self._token_bytes: list[bytes] | None = None
        self._grammar_tokenizer: Any = None

    def make_request(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Seq[str] = (),
        stop_token_ids: Seq[int] = (),
        num_speculative_tokens: int | None = None,
        request_id: str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        structured: Structured | None = None,
        cache_scope: str | None = None,
    ) -> Request:
        """Validate a request; raises :class:`VerispecError` with a message fit for the user (a
        :class:`ConfigError` naming the option where one option is at fault).

        ``num_speculative_tokens``: None takes the engine's k, 0 turns speculation off, and a value
        above the engine's k is cut to it. ``logprobs``: None for none, else each token's
        log-probability under the target plus that many (<= :data:`MAX_LOGPROBS`) most likely
        tokens (``TokenEvent.logprob`` and ``top_logprobs``); ``prompt_logprobs`` the same for the
        prompt's tokens (``RequestOutput.prompt_logprobs``, ``Generation.prompt_logprobs``).
        Penalties and ``logit_bias`` (token id -> value added to its logit) follow vLLM's rules
        (:mod:`verispec.penalties`); log-probabilities stay the target's raw ones, as vLLM's default.
        ``structured`` constrains the output to a JSON schema, regex, choice or Lark grammar
        (:mod:`verispec.structured`); the grammar is compiled here, so a bad one is refused here.
        ``stop_token_ids`` end the output like EOS does (kept in ``token_ids``, finish reason
        ``stop``), as vLLM's. ``cache_scope``: who shares this request's cached prompt and output
        (:attr:`Request.cache_scope`); None keeps it private.
        """
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ConfigError(name, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        penalties = Penalties(
            presence_penalty, frequency_penalty, repetition_penalty, tuple((logit_bias or {}).items())
        )
        penalties.check_vocab(self.target.vocab_size)
        grammar = None
        if structured is not None:
            grammar = structured.grammar()
            self.constraint(grammar)  # compiles it: errors now, not once queued
        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) >= self.target.max_context:
            raise VerispecError(
                f"the prompt has {len(prompt_ids)} tokens but {self.target.name} has a context of "
                f"{self.target.max_context}; shorten the prompt"
            )
        if stop and self.tokenizer is None:
            raise ConfigError("stop", "strings need a tokenizer; this model folder has none")
        bad = [t for t in stop_token_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ConfigError("stop_token_ids", f"out of range [0, {self.target.vocab_size}): {bad[:5]}")
        k = self.max_speculative_tokens
        if num_speculative_tokens is not None:
            if not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                raise ConfigError(
                    "num_speculative_tokens",
                    f"must be between 0 (no speculation) and {MAX_SPECULATIVE_TOKENS}, "
                    f"got {num_speculative_tokens}",
                )
            k = min(k, num_speculative_tokens)
        extra = {"request_id": request_id} if request_id is not None else {}
        return Request(
            prompt_ids,
            sampling,
            max_new_tokens,
            tuple(stop),
            k,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            penalties=penalties if penalties.active else None,
            grammar=grammar,
            stop_token_ids=frozenset(stop_token_ids),
            cache_scope=cache_scope,
            **extra,
        )

    def encode(self, prompt: Prompt) -> list[int]:
        """A text prompt's token ids (through the tokenizer), or token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise VerispecError("the prompt is empty")
            return list(self.require_tokenizer("a text prompt").encode(prompt))
        ids = [int(i) for i in prompt]
        if not ids:
            raise VerispecError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.target.vocab_size]
        if bad:
            raise VerispecError(f"prompt token ids out of range [0, {self.target.vocab_size}): {bad[:5]}")
        return ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, ready for the reply;
        ``tools`` (OpenAI's function definitions) are shown to the model where its template takes them."""
        tok = self.require_tokenizer("chat messages")
        template = getattr(tok, "chat_template", None)
        if not template:
            raise VerispecError(f"{self.target.name} has no chat template; send a plain prompt instead")
        if tools and "tools" not in template:
            raise VerispecError(f"{self.target.name}'s chat template does not take tools")
        ids = tok.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def fill_in_middle(self, prefix: str, suffix: str) -> FimPrompt:
        """The prompt ids asking the target for the text between ``prefix`` and ``suffix``, and the
        tokens that end it (pass them as ``stop_token_ids``; :mod:`verispec.fim`). Refused for a
        model not trained for it."""
        return fim_prompt(self.require_tokenizer("suffix"), prefix, suffix)

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes (:func:`~verispec.detok.token_bytes_table`), built on the first
        call: make it on the thread that owns the tokenizer (fast tokenizers are not thread-safe);
        the list is never changed afterwards, so any thread may read it."""
        if self._token_bytes is None:
            if self.tokenizer is None:
                raise VerispecError(
                    f"logprobs need a tokenizer to name the tokens, and {self.target.name} has none"
                )
            self._token_bytes = token_bytes_table(self.tokenizer)
        return self._token_bytes

    def constraint(self, grammar: str) -> Constraint:
        """A matcher for ``grammar`` over this target's vocabulary (llguidance's tokenizer view is
        built on first use, ~1.5 s for Qwen's 151,936 ids, on the engine thread)."""
        if self._grammar_tokenizer is None:
            tok = self.require_tokenizer("structured output")
            self._grammar_tokenizer = ll_tokenizer(tok, self.target.vocab_size, self.target.eos_token_ids)
        return Constraint(self._grammar_tokenizer, grammar, self.target.vocab_size)

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise VerispecError(
                f"{what} needs a tokenizer, and {self.target.name} has none; pass token ids instead"
            )
        return self.tokenizer
