"""Prompt lookup: draft the tokens that followed the most recent earlier match of the context's tail.

No model is involved. If the last ``n`` committed tokens also occur earlier in the sequence (prompt
or generated text), the tokens that followed that earlier occurrence are a cheap and often right
guess; copy-heavy tasks (summarisation, retrieval-augmented answers, code edits) accept long runs
of them. Longer tails are tried first (``max_ngram`` down to ``min_ngram``) because a longer match
is better evidence. The proposal is deterministic, so the draft carries no probabilities.

The index is incremental, so a step costs O(max_ngram) per new token however long the context is:
for each n, a dict maps every n-gram seen to the position right after its most recent occurrence
*whose continuation is known*, i.e. that is followed by at least one token. The context's own tail
has no known continuation yet, so it is not in the index and can never match itself; it is added
when the next token arrives.

Under a request's grammar the continuation is cut before its first token the grammar forbids
(checked without a mask, in microseconds): such a token would be rejected anyway, and the tokens
after it cost verification rows for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.proposers.base import Proposer, register
from verispec.types import Draft

if TYPE_CHECKING:
    from verispec.config import SamplingConfig, SpecConfig
    from verispec.models.base import CausalLM
    from verispec.penalties import RequestRules
    from verispec.structured import Constraint

NgramKey = tuple[int, ...]


@dataclass
class NgramState:
    """One sequence's lookup index.

    ``index[n]`` maps an n-gram to the position right after its most recent occurrence that has a
    known continuation: an occurrence ``tokens[e - n : e]`` is indexed once ``e < len(tokens)``.
    """

    min_ngram: int
    max_ngram: int
    tokens: list[int] = field(default_factory=list)
    """Every token indexed so far (a copy of the committed sequence)."""
    index: dict[int, dict[NgramKey, int]] = field(default_factory=dict)
    positions_indexed: int = 0
    """End positions indexed since the state was built; each position is indexed once (a work counter)."""
    constraint: Constraint | None = None
    """The request's grammar, following the committed output (see the module docstring)."""

    def __post_init__(self) -> None:
        self.index = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def sync(self, token_ids: Sequence[int]) -> None:
        """Index the tokens of ``token_ids`` beyond those already indexed; touches only new tokens.

        ``token_ids`` must extend the indexed tokens. If it does not (it is shorter, or its last
        already-indexed token differs: a cheap check, not a full comparison), the index is rebuilt.
        """
        known = len(self.tokens)
        if len(token_ids) < known or (known and int(token_ids[known - 1]) != self.tokens[-1]):
            self._reset()
            known = 0
        if len(token_ids) == known:
            return
        self.tokens.extend(int(t) for t in token_ids[known:])
        # Occurrences ending at `end` gain a known continuation once tokens[end] exists: the newly
        # eligible ends are those from the old length up to the new length - 1.
        tokens = self.tokens
        for end in range(max(known, 1), len(tokens)):
            for n, table in self.index.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
            self.positions_indexed += 1

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier match of the longest matching tail."""
        tokens = self.tokens
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < n:
                continue
            start = self.index[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def _reset(self) -> None:
        self.tokens = []
        self.index = {n: {} for n in self.index}


@register("ngram")
class NgramProposer(Proposer):
    """Prompt-lookup proposer; ignores the models it is built with."""

    name = "ngram"

    def __init__(self, spec: SpecConfig, target: CausalLM | None = None, draft: CausalLM | None = None):
        self.min_ngram = spec.ngram.min_ngram
        self.max_ngram = spec.ngram.max_ngram

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig | None = None) -> NgramState:
        state = NgramState(min_ngram=self.min_ngram, max_ngram=self.max_ngram)
        state.sync(prompt_ids)
        return state

    def propose(self, state: NgramState, token_ids: Sequence[int], k: int) -> Draft:
        # The engine passes the whole committed sequence, which may be ahead of the index.
        state.sync(token_ids)
        if k <= 0:
            return Draft.empty()
        continuation = state.lookup(k)
        if state.constraint is not None:
            # Within the grammar, then on with the tokens it forces there (a schema's next key):
            # lookup knows them only where the context happens to hold them.
            continuation = continuation[: state.constraint.valid_prefix(continuation)]
            if len(continuation) < k:
                continuation += state.constraint.forced(continuation)[: k - len(continuation)]
        if not continuation:
            return Draft.empty()
        return Draft.chain(torch.tensor(continuation, dtype=torch.long))

    def constrain(self, state: NgramState, rules: RequestRules) -> None:
        state.constraint = rules.constraint

    def update(
        self,
        state: NgramState,
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        state.sync(token_ids)
