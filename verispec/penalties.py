"""Logit bias and repetition penalties, applied so that speculation stays lossless.

These adjustments depend on the text so far, so in a verification forward every row of the
target's logits has its own context: row j of a chain comes after the committed tokens plus draft
tokens ``0..j-1``; row i + 1 of a tree after the committed tokens plus the path to node i. Each row
is adjusted for exactly that context (:meth:`Draft.row_paths <verispec.types.Draft.row_paths>`;
a chain is the tree whose parents are i - 1), which makes it the row plain decoding would have
adjusted at the same point. The verifiers then see the adjusted rows and keep what they keep, so the
output follows the adjusted target distribution exactly, whatever the proposer drafted from.

Semantics and order are vLLM's (what an OpenAI-API user migrating from it expects): ``logit_bias``
is added first; then the repetition penalty (transformers' rule: a positive logit is divided by
it, a negative one multiplied) on every token seen in the prompt or the output; then
``mu[t] -= frequency * c[t] + presence * (c[t] > 0)`` with ``c`` counted over output tokens only.
All of this comes before temperature, top-k and top-p (:func:`verispec.sampling.logits_to_probs`).

:class:`RequestRules` applies a sequence's penalties and its grammar mask (:mod:`verispec.structured`)
together, row by row, for the engine's verification and for every proposer that drafts with them
(the draft model, EAGLE), so a draft agrees with the adjusted target as often as it can.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.errors import ConfigError, VerispecError

if TYPE_CHECKING:
    from verispec.structured import Constraint

MAX_PENALTY = 2.0
"""OpenAI's range for presence and frequency penalties is [-2, 2]."""
MAX_BIAS = 100.0
"""OpenAI's range for a logit bias is [-100, 100]: -100 bans a token, 100 forces it."""


@dataclass(frozen=True)
class Penalties:
    """A request's context-dependent logit adjustments; the defaults change nothing."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    """1 is off; above 1 discourages repeating prompt or output tokens, below 1 encourages it."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value added to its logit) pairs."""

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ConfigError(name, f"must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}")
        if not (math.isfinite(self.repetition) and self.repetition > 0):
            raise ConfigError("repetition_penalty", f"must be > 0 (1 = off), got {self.repetition}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ConfigError("logit_bias", f"token ids must be >= 0, got {token}")
            if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise ConfigError(
                    "logit_bias", f"values must be between -100 and 100, got {bias} for {token}"
                )

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a bias on a token id the model does not have."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ConfigError(
                "logit_bias", f"names token id {bad[0]}, but the vocabulary has {vocab_size} ids"
            )


def adjust_logits(
    logits: torch.Tensor,  # [R, V]
    penalties: Penalties,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    row_paths: Sequence[Sequence[int]],
    prompt_seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``logits`` adjusted row by row; row r's context is the prompt, the output so far, then
    ``row_paths[r]`` (tokens drafted before that row, counted as output).

    The shared part (prompt and output) is applied to all rows at once; only the few tokens on each
    row's path are corrected one by one, so a 60-node tree costs a handful of scalar updates.
    ``prompt_seen`` ([V] bool, the prompt's tokens) saves rebuilding that mask from ``prompt_ids``
    on every call (:class:`RequestRules` keeps it per sequence).
    """
    if len(row_paths) != logits.shape[0]:
        raise ValueError(f"need one path per row: {len(row_paths)} paths for {logits.shape[0]} rows")
    out = logits.float().clone()
    vocab = out.shape[-1]
    if penalties.logit_bias:
        ids = torch.tensor([t for t, _ in penalties.logit_bias], dtype=torch.long)
        values = torch.tensor([b for _, b in penalties.logit_bias], dtype=out.dtype)
        out[:, ids] += values
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
    seen = counts > 0
    if penalties.repetition != 1.0:
        if prompt_seen is None:
            prompt_seen = prompt_mask(prompt_ids, vocab)
        seen_all = seen | prompt_seen
        out = torch.where(seen_all, _repeated(out, penalties.repetition), out)
    out -= penalties.frequency * counts.to(out.dtype) + penalties.presence * seen.to(out.dtype)
    for row, path in enumerate(row_paths):
        if not path:
            continue
        extra = torch.tensor(sorted(Counter(path).items()), dtype=torch.long)  # [n, 2]: token, times
        tokens, times = extra[:, 0], extra[:, 1]
        if penalties.repetition != 1.0:  # first seen on this row's path; their logits are still raw
            new = tokens[~seen_all[tokens]]
            out[row, new] = _repeated(out[row, new], penalties.repetition)
        before = counts[tokens]
        out[row, tokens] -= penalties.frequency * times.to(out.dtype) + penalties.presence * (
            (before == 0).to(out.dtype)
        )
    return out


def prompt_mask(prompt_ids: Sequence[int], vocab: int) -> torch.Tensor:
    """[V] bool: the tokens that occur in the prompt (what the repetition penalty also penalises)."""
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
    return seen


@dataclass
class RequestRules:
    """One sequence's penalties and grammar (its matcher follows the committed output), applied to
    logit rows by the engine's verification and by proposers that draft with them."""

    penalties: Penalties | None
    constraint: Constraint | None
    prompt_len: int
    _prompt_seen: torch.Tensor | None = field(default=None, repr=False)
    """The prompt's token mask, built on first use: a 4k-token prompt costs ~1 ms to scan, and the
    rows are adjusted once a step for verification and once per drafted token by a draft model."""

    def rows(
        self, logits: torch.Tensor, token_ids: Sequence[int], row_paths: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """``logits [R, V]`` as the rules make them: penalised (:func:`adjust_logits`) and masked by
        the grammar, row r after the committed ``token_ids`` (prompt first) plus ``row_paths[r]``."""
        if self.penalties is not None:
            vocab = logits.shape[-1]
            if self._prompt_seen is None or self._prompt_seen.numel() != vocab:
                self._prompt_seen = prompt_mask(token_ids[: self.prompt_len], vocab)
            logits = adjust_logits(
                logits,
                self.penalties,
                (),  # the prompt is in the mask; slicing it out again would copy it on every call
                token_ids[self.prompt_len :],
                row_paths,
                self._prompt_seen,
            )
        if self.constraint is not None:
            allowed = self.constraint.masks(row_paths)
            if not bool(allowed.any(dim=-1).all()):
                raise VerispecError("structured output: the grammar allows no token here")
            logits = logits.float().masked_fill(~allowed, float("-inf"))
        return logits


def _repeated(logits: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: toward zero if positive, further down if negative."""
    return torch.where(logits > 0, logits / penalty, logits * penalty)
