"""Keeping the target's hidden states while it distils its replies (``verispec distill --keep-hidden``).

Training heads on distilled replies needs the target's hidden state after every token of them
(:class:`~verispec.training.store.HiddenStore`). Computed afterwards, that is a second pass of the target
over every prompt and reply: on a 2-core AVX2 machine ~50 tokens/s, about as long again as
generating them (2-3 hours for the 480k tokens of the 1.5B's pack). But generating computes those very
states: :class:`HiddenRecorder`, the engine's ``hidden_observer``, keeps them per request, and
:class:`StoreKeeper` grows the store by each batch of records just written, their states filled in.

- The state after a reply's last token is never computed (the engine never feeds it). No training
  pair reads it (``TokenData.ok`` is False at a sequence's last position: nothing follows it), so the
  store holds zeros there.
- The argmax after each token is the raw target's (before any grammar or penalty), as a store pass
  keeps it: the engine's logits for decode rows, the LM head for prompt rows (prefill keeps no logits).
- Prompts are prefilled in the engine's chunks and replies fed as decode steps, so a store pass
  that prefilled each sequence whole would not give these states on the quantized paths (their 7-8
  bit activation rows turn SDPA's row-count-dependent last bits into quantization steps: the 1.5B
  int4's whole-prefill argmax differed from the token it wrote at 1.9% of reply positions). The
  store pass therefore feeds a distilled reply as the engine fed it
  (:func:`~verispec.training.states.target_states` with ``prompt_len``) and matches these states to the
  bit (``tests/training/test_keep.py``).
- Records the file already holds without states (written before, or without the flag) become
  sequences still to fill; ``verispec train`` fills them (:meth:`HiddenStore.fill` skips the kept ones).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec.heads.identity import TargetIdentity
from verispec.models.quant import lm_head_kind
from verispec.training.cache import open_store, quantization_of
from verispec.training.data import DataSpec, build_examples
from verispec.training.records import read_records
from verispec.training.states import lm_head_argmax
from verispec.training.store import HiddenStore


def request_id(record_id: str) -> str:
    """The engine request that answers a distilled record's prompt (how its states are found)."""
    return f"distill:{record_id}"


class HiddenRecorder:
    """The target's last hidden state and argmax after every fed token, per request, in order."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self._hidden: dict[str, list[torch.Tensor]] = {}
        self._greedy: dict[str, list[torch.Tensor]] = {}

    @torch.inference_mode()
    def prefilled(self, request_id: str, hidden: torch.Tensor) -> None:
        rows = hidden.float()
        self._keep(request_id, rows, lm_head_argmax(self.target, rows))

    def committed(self, request_id: str, hidden: torch.Tensor, greedy: torch.Tensor) -> None:
        self._keep(request_id, hidden.float(), greedy)

    def _keep(self, request_id: str, hidden: torch.Tensor, greedy: torch.Tensor) -> None:
        self._hidden.setdefault(request_id, []).append(hidden.to(torch.float16))
        self._greedy.setdefault(request_id, []).append(greedy.to(torch.int32))

    def take(self, request_id: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A request's states ``[n, H]`` float16 and argmax ``[n]``, forgotten here (None if none)."""
        hidden, greedy = self._hidden.pop(request_id, None), self._greedy.pop(request_id, None)
        if not hidden or not greedy:
            return None
        return torch.cat(hidden).numpy(), torch.cat(greedy).numpy()

    def clear(self) -> None:
        self._hidden.clear()
        self._greedy.clear()


class StoreKeeper:
    """The hidden-state store of a distillation file, grown as records are appended to it.

    It is the store ``verispec train --sources distilled --distilled FILE`` opens with the same
    data flags (the defaults, or ``--cache-dir``), so training starts without a pass over the replies.
    """

    def __init__(
        self, target: Any, identity: TargetIdentity, out: Path, cache_dir: Path | None = None
    ) -> None:
        self.target = target
        self.identity = identity
        self.spec = DataSpec(sources=("distilled",), distilled=str(out.expanduser().resolve()))
        self.store: HiddenStore = open_store(target, identity, self.spec, cache_dir)
        self.recorder = HiddenRecorder(target)

    def sync(self) -> tuple[int, int]:
        """Grow the store by the file's records it lacks, filling those whose states were recorded
        (and forgetting them); returns (sequences added, of which filled). Requests still running keep
        what was recorded of them."""
        if len(read_records(Path(str(self.spec.distilled)))) <= self.store.cursor.distilled:
            return 0, 0  # nothing new (or a file not written yet)
        examples, cursor = build_examples(None, self.spec, 1 << 62, self.store.cursor, progress=False)
        if not examples:
            return 0, 0
        first = int(self.store.meta.get("sequences", 0)) if self.store.meta else 0
        self.store.extend(
            examples,
            cursor,
            self.identity,
            self.spec,
            self.target.hidden_size,
            quantization=quantization_of(self.target),
            lm_head=lm_head_kind(self.target),
        )
        rows = {}
        for i, example in enumerate(examples):
            kept = self.recorder.take(request_id(example.key))
            states = _aligned(kept, len(example.ids), self.target.hidden_size)
            if states is not None:
                rows[first + i] = states
            elif kept is not None:
                print(f"{example.key}: {len(kept[0])} states recorded for {len(example.ids)} tokens; "
                      "left for a store pass", file=sys.stderr)  # fmt: skip
        if rows:
            self.store.put(rows)
        return len(examples), len(rows)


def _aligned(
    kept: tuple[np.ndarray, np.ndarray] | None, length: int, hidden_size: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Recorded states cut to a sequence of ``length`` tokens (a record longer than the store's
    ``max_seq_len`` is cut), with a zero row for the last token's, which is never computed; None
    where they cannot be that sequence's."""
    if kept is None:
        return None
    hidden, greedy = kept
    if len(hidden) >= length:
        return hidden[:length], greedy[:length]
    if len(hidden) == length - 1:
        return (
            np.concatenate([hidden, np.zeros((1, hidden_size), dtype=hidden.dtype)]),
            np.concatenate([greedy, np.zeros(1, dtype=greedy.dtype)]),
        )
    return None
