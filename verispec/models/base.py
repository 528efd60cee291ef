"""The small model protocol every engine path talks to.

A model runs a forward pass over *new* tokens on top of a KV cache and returns logits for the last
few positions (and, on request, the last layer's hidden states, which Medusa/EAGLE heads read).
Rolling back rejected draft tokens is one call on the cache: ``cache.rollback(start, kept_rows)``
keeps the verify rows of the accepted path (for a chain, a prefix: the same as ``cache.trim(n)``).
A batched forward runs many sequences, each with its own cache and length, in one pass.

Shapes: ``B`` batch, ``S`` new tokens this call, ``T`` tokens in the cache before the call, ``V``
vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


def head_dim_of(config: Any) -> int:
    """The attention head width a transformers config implies: its ``head_dim`` where it sets one
    (some families, e.g. Qwen3 and Gemma, decouple it from the hidden size), else hidden size / heads.
    One definition, as the rotary frequencies, EAGLE's layer and the speculators reader all need it."""
    own = getattr(config, "head_dim", None)
    return int(own or int(config.hidden_size) // int(config.num_attention_heads))


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [1, keep, V] float32: predictions for the token after each kept position
    hidden: torch.Tensor | None = None  # [1, keep, H] last layer's hidden states (after final norm)


@dataclass
class BatchOutput:
    logits: list[torch.Tensor]  # per row [keep_b, V] float32
    hidden: list[torch.Tensor] | None = None  # per row [keep_b, H], [keep_b, (1 + F) H] with F feature layers


@runtime_checkable
class KVCache(Protocol):
    """Keys and values of the tokens one sequence has seen, trimmable from the end and rolled back to
    a draft's accepted path after verification."""

    @property
    def length(self) -> int:
        """Number of token positions held."""
        ...

    def trim(self, n: int) -> None:
        """Drop the last ``n`` positions (rejected draft tokens). Raises if ``n`` exceeds the length."""
        ...

    def rollback(self, start: int, kept_rows: Sequence[int]) -> None:
        """After a verify forward whose rows were written from position ``start`` (row 0, the pending
        token, at ``start``; a tree's nodes after it in node order): keep the entries of
        ``start + kept_rows[i]`` at ``start + i`` and drop every other row. ``kept_rows`` is
        increasing and starts with 0; for a chain it is ``0 .. accepted``, a trim."""
        ...


class CausalLM(Protocol):
    """A decoder-only language model behind per-sequence KV caches."""

    name: str
    vocab_size: int  # V: width of the logits
    hidden_size: int
    max_context: int  # positions the model was trained for
    device: torch.device
    eos_token_ids: frozenset[int]

    def new_cache(self) -> KVCache:
        """An empty cache for one sequence."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, S] int64, the new tokens
        cache: KVCache,  # holds T positions; holds T + S afterwards
        *,
        logits_to_keep: int = 1,  # logits only for the last this-many positions (all if 0)
        return_hidden: bool = False,
    ) -> ForwardOutput:
        """One sequence; the same computation as a one-row :meth:`forward_batch`."""
        ...

    def forward_batch(
        self,
        caches: Sequence[KVCache],  # one per row, each with its own length
        tokens: Sequence[Sequence[int]],  # row b's new tokens (rows may differ in length)
        *,
        logits_to_keep: Sequence[int],  # per row, logits for its last this-many new tokens
        return_hidden: bool = False,
        positions: Sequence[Sequence[int]] | None = None,  # per row; default T_b .. (trees override)
        tree_masks: Sequence[torch.Tensor | None] | None = None,  # per row [S_b, S_b] bool (trees)
        hidden_to_keep: Sequence[int] | None = None,  # per row, hidden states of its last this-many
        feature_layers: Sequence[int] = (),  # decoder layers whose normed inputs follow each hidden state
        raw_features: bool = False,  # those layers' inputs before their norm (EAGLE-3's states)
    ) -> BatchOutput:
        """Many sequences in one pass. A row's result does not depend on the other rows: batching
        is invisible in the output, to the bit on the batch-invariant paths."""
        ...
