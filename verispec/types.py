"""The typed values that flow through one decoding step.

A proposer returns a :class:`Draft`; the verifier turns target probabilities and the draft into a
:class:`VerifyResult`; the engine commits it and emits :class:`TokenEvent` values, one per committed
token, which the CLI, the Python API and the server all consume. A finished request is a
:class:`Generation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from verispec.metrics import SpecStats

FinishReason = Literal["stop", "length", "eos"]
"""Why generation ended: a stop string matched, ``max_new_tokens`` was reached, or the model's EOS."""


@dataclass(frozen=True)
class Draft:
    """The draft tokens a proposer suggests for one sequence in one step.

    ``probs`` holds the proposer's distribution at each draft position, from which each draft token
    was sampled; ``None`` means a deterministic proposal (prompt lookup, greedy heads), which the
    verifier treats as one-hot on the proposed token. Exact rejection sampling needs the real
    distribution whenever the proposer sampled.
    """

    tokens: torch.Tensor  # [k] int64
    probs: torch.Tensor | None = None  # [k, vocab] float32, rows sum to 1

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"Draft.tokens must be 1-D, got shape {tuple(self.tokens.shape)}")
        if self.probs is not None and self.probs.shape[0] != self.tokens.shape[0]:
            raise ValueError("Draft.probs must have one row per draft token")

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> Draft:
        return Draft(tokens=torch.empty(0, dtype=torch.long))


@dataclass(frozen=True)
class VerifyResult:
    """What the verifier decided for one sequence.

    ``tokens`` are the tokens to commit: the ``num_accepted`` accepted draft tokens followed by
    exactly one token of the target's own (recovered at the first rejection, or bonus when every
    draft token was accepted).
    """

    tokens: list[int]
    num_accepted: int
    num_drafted: int

    @property
    def bonus(self) -> bool:
        """True when every draft token was accepted and the last token is the target's bonus."""
        return self.num_accepted == self.num_drafted


@dataclass(frozen=True)
class TokenEvent:
    """One committed token, as streamed to callers.

    ``text`` is the text this token adds to the output (it can be empty while a multi-byte
    character is incomplete). ``from_draft`` is True when the token was proposed by the proposer and
    accepted by the verifier; False for the target's own recovered, bonus or plain tokens.
    """

    token_id: int
    text: str
    from_draft: bool
    logprob: float | None
    """The token's log-probability under the target's raw distribution (its logits before
    temperature, top-k and top-p), when the request asked for logprobs; else None."""
    step: int
    finish_reason: FinishReason | None = None
    stats: SpecStats | None = None
    """Set on the last event only: the statistics of the whole generation."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The request's ``logprobs`` most likely tokens at this position, as (token id, log-probability)
    under the same distribution as ``logprob``, most likely first."""


@dataclass
class Generation:
    """A finished generation: the new tokens, their text, why it stopped and its statistics."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: SpecStats
    prompt_token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None] | None = None
    """With ``prompt_logprobs``: per prompt token, its log-probability and the most likely tokens
    there (as ``TokenEvent.logprob`` / ``top_logprobs``); None for the first token."""
