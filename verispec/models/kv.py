"""Per-sequence KV storage and the batch view transformers' decoder layers write into.

Each sequence owns a :class:`KVBuffer`: one key and one value tensor per layer, ``[Hkv, capacity,
D]``, that grows by doubling. Rolling back rejected drafts is just a smaller length (the stale
entries are overwritten by the next write), and sequences of any lengths can share one forward:
a :class:`RowBatch` tells every decoder layer where each row's new tokens go, and the attention in
:mod:`verispec.models.attention` reads each row's keys straight from its own buffer, so no padded
batch cache is ever built or copied when sequences join or leave.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

_MIN_CAPACITY = 64


class KVBuffer:
    """One sequence's keys and values for every layer; trimmable from the end in O(1), rolled back
    to a tree's accepted path by moving its rows."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [Hkv, capacity, D]
        self.values: dict[int, torch.Tensor] = {}
        self._length = 0

    @property
    def length(self) -> int:
        """Committed positions (the target sees exactly these on the next forward)."""
        return self._length

    def trim(self, n: int) -> None:
        """Drop the last ``n`` positions (rejected draft tokens)."""
        if n < 0 or n > self._length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self._length}")
        self._length -= n

    def advance(self, n: int) -> None:
        self._length += n

    def write(self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ([Hkv, S, D]) at positions ``start .. start+S-1`` of ``layer``."""
        end = start + key.shape[1]
        buf = self.keys.get(layer)
        if buf is None or buf.shape[1] < end:
            self.keys[layer] = _grown(buf, key, end, start)
            self.values[layer] = _grown(self.values.get(layer), value, end, start)
        self.keys[layer][:, start:end] = key
        self.values[layer][:, start:end] = value

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers of ``layer`` (positions past the last write are junk)."""
        return self.keys[layer], self.values[layer]

    @torch.inference_mode()
    def rollback(self, start: int, kept_rows: Sequence[int]) -> None:
        """After a verify forward: keep the entries at ``start + kept_rows[i]`` (the pending token and
        the accepted path, in order) at ``start + i`` and drop the rest of the draft. A chain's rows
        are a prefix, kept in place: only the length moves back, as :meth:`trim` does."""
        kept = list(kept_rows)
        end = start + len(kept)
        if end > self._length or (kept and kept[-1] >= self._length - start):
            raise ValueError(f"cannot keep rows {kept} from {start} in a cache of {self._length}")
        if kept != list(range(len(kept))):  # a tree's path: move its rows next to each other
            some = next(iter(self.keys.values()))  # every layer's buffers live on one device
            idx = torch.tensor([start + k for k in kept], device=some.device)
            for store in (self.keys, self.values):
                for buf in store.values():
                    buf[:, start:end] = buf.index_select(1, idx)
        self._length = end

    def clone(self) -> KVBuffer:
        """An independent copy (the cost measurement gives many rows the same prefix)."""
        other = KVBuffer()
        other.keys = {i: t.clone() for i, t in self.keys.items()}
        other.values = {i: t.clone() for i, t in self.values.items()}
        other._length = self._length
        return other

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def _grown(buf: torch.Tensor | None, like: torch.Tensor, needed: int, keep: int) -> torch.Tensor:
    """A buffer with room for ``needed`` positions holding the first ``keep`` positions of ``buf``."""
    capacity = max(_MIN_CAPACITY, needed, 2 * (buf.shape[1] if buf is not None else 0))
    new = like.new_empty(like.shape[0], capacity, like.shape[2])
    if buf is not None and keep:
        new[:, :keep] = buf[:, :keep]
    return new


@dataclass
class RowBatch:
    """One forward over several sequences: row ``b`` appends ``lengths[b]`` tokens to ``caches[b]``.

    Passed to the decoder as its cache (layers call :meth:`update`) and to the attention as the
    ``verispec_rows`` keyword. The rows are packed: their tokens lie side by side in one sequence of
    the forward (``[1, sum(lengths)]``), row ``b``'s at :meth:`span`, so the Linears, which do
    nearly all of a CPU forward's arithmetic, run on real tokens only. Padded to a common width, a
    batch of a 5-token verify row and seven 1-token decode rows ran 40 token rows for 12, and a
    prompt's last chunk could not ride in a decode forward beside other sequences at all. Only the
    attention and the cache writes tell the rows apart, and both go row by row.
    """

    caches: Sequence[KVBuffer]
    starts: list[int]  # cache length of each row before this forward
    lengths: list[int]  # new tokens of each row
    tree_masks: Sequence[torch.Tensor | None] | None = None
    """Per row, ``[n, n]`` bool over the row's new tokens (True = may attend), for token trees;
    None attends causally. Every new token always sees the whole cached prefix."""
    native_attention: bool = True
    """Attend decode and verify rows with ``kernels/rowwise_attention.cpp`` where it builds (float32
    on CPU); False keeps the Python loop over positions (the reference the tests compare to). The
    model's choice (:class:`~verispec.models.hf.HFCausalLM`'s ``native_attention``), carried here
    because the attention sees the rows, not the model."""
    offsets: list[int] = field(init=False)
    """Where each row starts in the packed sequence, and its end last."""

    def __post_init__(self) -> None:
        self.offsets = [0, *accumulate(self.lengths)]

    def span(self, row: int) -> slice:
        """Where row ``row``'s new tokens lie in the packed sequence."""
        return slice(self.offsets[row], self.offsets[row + 1])

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' cache hook: store each row's new keys/values (of the packed
        ``[1, Hkv, tokens, D]``) in its own buffer."""
        for b, cache in enumerate(self.caches):
            span = self.span(b)
            cache.write(layer_idx, self.starts[b], key[0, :, span], value[0, :, span])
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.starts)

    def tree_mask(self, row: int) -> torch.Tensor | None:
        return None if self.tree_masks is None else self.tree_masks[row]
