"""The small model protocol every engine path talks to.

A model runs a forward pass over *new* tokens on top of a KV cache and returns logits for the last
few positions (and, on request, the last layer's hidden states, which Medusa/EAGLE heads read).
Rolling back rejected draft tokens is one call on the cache: ``cache.trim(n)``.

Shapes: ``B`` batch, ``S`` new tokens this call, ``T`` tokens in the cache before the call, ``V``
vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, keep, V] float32: predictions for the token after each kept position
    hidden: torch.Tensor | None = None  # [B, keep, H] last layer's hidden states (after final norm)


@runtime_checkable
class KVCache(Protocol):
    """Keys and values of the tokens a model has seen, trimmable from the end."""

    @property
    def length(self) -> int:
        """Number of token positions held (the same for every sequence in the batch for now)."""
        ...

    def trim(self, n: int) -> None:
        """Drop the last ``n`` positions (rejected draft tokens). Raises if the cache can't be trimmed."""
        ...


class CausalLM(Protocol):
    """A decoder-only language model behind a KV cache."""

    name: str
    vocab_size: int  # V: width of the logits
    hidden_size: int
    max_context: int  # positions the model was trained for
    device: torch.device
    eos_token_ids: frozenset[int]

    def new_cache(self) -> KVCache:
        """An empty cache for one sequence (or a batch that advances together)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64, the new tokens
        cache: KVCache,  # holds T positions; holds T + S afterwards
        *,
        logits_to_keep: int = 1,  # logits only for the last this-many positions (all if 0)
        return_hidden: bool = False,
        position_ids: torch.Tensor | None = None,  # [B, S]; default T .. T+S-1 (trees override it)
        attention_mask: torch.Tensor | None = None,  # [B, 1, S, T+S] bool, True = may attend (trees)
    ) -> ForwardOutput: ...
