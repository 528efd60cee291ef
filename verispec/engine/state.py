"""What the engine keeps for each request: the validated request, its running sequence, and what a
step hands back (per request, and for metrics per step)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.config import SamplingConfig
from verispec.detok import IncrementalDetokenizer
from verispec.metrics import SpecStats
from verispec.models.base import KVCache
from verispec.penalties import Penalties, RequestRules
from verispec.policy import AcceptanceEstimate
from verispec.types import TokenEvent

TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]
"""A token's log-probability and the most likely tokens at its position, (id, log-probability)."""


@dataclass(frozen=True)
class Request:
    """One generation request, validated (:meth:`verispec.engine.requests.RequestBuilder.make_request`)."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int = 0
    """Most draft tokens per step for this request; 0 turns speculation off for it."""
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")
    """Unique without a process-wide counter: engines (a plain twin, a server's) share no state."""
    logprobs: int | None = None
    """None: no log-probabilities; n: each token's, with the n most likely tokens at its position."""
    prompt_logprobs: int | None = None
    """The same for the prompt's tokens (scoring a text, as ``echo`` with ``logprobs`` asks)."""
    penalties: Penalties | None = None
    """Logit bias and repetition penalties, applied to each verified row for its own context."""
    grammar: str | None = None
    """llguidance grammar the output must match (:mod:`verispec.structured`), masked the same way."""
    stop_token_ids: frozenset[int] = frozenset()
    """Tokens that end the output as EOS does (finish reason ``stop``)."""
    cache_scope: str | None = None
    """Who may reuse what this request computes and writes (its prompt's KV, its output as draft
    material), and whose they may reuse: requests of the same scope share both caches. None keeps
    the request private: it reuses nothing and leaves nothing behind. A scope is the caller's
    tenant (from its API key), narrowed by the OpenAI ``user`` field: cross-request caches are a
    timing side channel, so they are shared only among callers who may see each other's text."""


@dataclass
class SeqState:
    """Everything that belongs to one running sequence."""

    request: Request
    token_ids: list[int]  # committed tokens, prompt included
    cache: KVCache
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    budget: int  # tokens it may generate
    acceptance: AcceptanceEstimate
    admitted_at: float
    proposer_state: Any = None
    stats: SpecStats = field(default_factory=SpecStats)
    steps: int = 0
    feeds_draft: bool | None = None
    """Whether its prompt chunks are fed to the draft model as the target prefills them; decided
    at its first chunk (see :meth:`~verispec.engine.drafting.Drafting.feeds_draft`)."""
    rules: RequestRules | None = None
    """With penalties or a grammar: them, the grammar's matcher following this sequence's output."""
    prompt_scores: list[TokenLogprobs] = field(default_factory=list)
    """With ``prompt_logprobs``: the prompt's tokens after the first, scored as prefill goes."""
    reuse_checked: bool = False
    """Whether the prefix cache was asked for this sequence's prompt (once, before its first chunk)."""
    hidden_rows: list[torch.Tensor] | None = None
    """Where the prefix cache will keep this sequence's hidden rows: one per cached position, as
    the target's forwards gave them (None: it keeps none for this sequence)."""
    tail_in_decode: bool = False
    """Whether the rest of its prompt is fed by this step's decode forward, before its pending
    token, instead of by a prefill forward of its own (see :meth:`~verispec.engine.step.Step.prefill`)."""

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def pending_position(self) -> int:
        """The position of its last committed token, which the next decode forward feeds (with the
        prompt's rest before it where that rides along): every token before it is context."""
        return len(self.token_ids) - 1

    @property
    def prefilled(self) -> bool:
        return self.cache.length >= self.pending_position

    @property
    def speculation_cap(self) -> int:
        """Most draft tokens this sequence may take now: its request's k, cut by the tokens it may
        still generate (the step's own token included); 0 when the request turned speculation off."""
        return min(self.request.num_speculative_tokens, self.budget - self.num_generated - 1)


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, or an error that ended it."""

    request_id: str
    events: list[TokenEvent] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On a request's first output, where it asked for them: one entry per prompt token, the first
    None (nothing predicts it)."""


@dataclass(frozen=True)
class StepReport:
    """One decode step, for metrics: batch size, per-sequence depth and outcome, and timings."""

    batch_size: int
    drafted: list[int]
    accepted: list[int]
    draft_seconds: float
    target_seconds: float
    waiting: int
