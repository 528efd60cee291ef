"""The training view of a hidden-state store: each position's label, validity and features.

Labels come from the store's argmaxes (the target's greedy token: what greedy verification accepts)
or from the text; accuracies are always measured against the target's greedy token.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.training.config import EVAL_SPLITS
from verispec.training.store import HiddenStore

IGNORE = -100
"""The label of a position no loss counts (``F.cross_entropy``'s ``ignore_index``)."""


class TokenData:
    """The training view of a :class:`HiddenStore`: label and validity per position.

    ``label[t]`` is the training label of token t+1 (its prediction context ends at t): the target's
    argmax after t, or the text's token t+1. ``ok[t]``: token t+1 exists in t's sequence and is
    labelled. ``greedy[t]`` is always the target's argmax after t: accuracies are measured against
    it, because that is what greedy verification accepts.
    """

    def __init__(
        self,
        store: HiddenStore | dict[str, np.ndarray],
        labels: str = "target",
        feature_layers: tuple[int, ...] | None = None,
        raw_taps: bool | None = None,
    ) -> None:
        """``feature_layers``: the layers of the arrays' ``taps`` (a store's own by default);
        ``raw_taps``: whether those are the layers' raw inputs (EAGLE-3's) rather than their normed
        ones (a store's own by default; arrays without a store: normed)."""
        arrays = store if isinstance(store, dict) else store.arrays()
        if feature_layers is None:
            feature_layers = () if isinstance(store, dict) else store.feature_layers
        if raw_taps is None:
            raw_taps = False if isinstance(store, dict) else store.raw_taps
        if feature_layers and "taps" not in arrays:
            raise VerispecError(f"feature layers {list(feature_layers)} asked for, but the data has no taps")
        self.feature_layers = tuple(feature_layers)
        self.raw_taps = bool(raw_taps)
        self.taps = arrays["taps"] if feature_layers else None
        self.hidden = arrays["hidden"]
        tokens = np.asarray(arrays["tokens"]).astype(np.int64)
        starts = np.asarray(arrays["starts"]).astype(np.int64)
        self.starts = starts
        self.heldout = np.asarray(arrays["heldout"]).astype(bool)
        total = int(starts[-1])
        ends = np.repeat(starts[1:], np.diff(starts))  # [T] end of each position's sequence
        self.seq_end = torch.from_numpy(ends)
        nxt = np.arange(total) + 1
        inside = nxt < ends
        labelled = np.asarray(arrays["labelled"]).astype(bool)
        ok = inside & labelled[np.minimum(nxt, total - 1)]
        self.greedy = torch.from_numpy(np.asarray(arrays["argmax"]).astype(np.int64))
        text_next = np.where(inside, tokens[np.minimum(nxt, total - 1)], 0)
        self.label = torch.from_numpy(text_next) if labels == "data" else self.greedy
        self.ok = torch.from_numpy(ok)
        self.tokens = torch.from_numpy(tokens)

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def sequences(self, heldout: bool) -> list[tuple[int, int]]:
        return [
            (int(self.starts[s]), int(self.starts[s + 1]))
            for s in range(len(self.starts) - 1)
            if bool(self.heldout[s]) == heldout and self.starts[s + 1] - self.starts[s] >= 3
        ]

    def eval_sequences(self, split: str = "heldout") -> list[tuple[int, int]]:
        """The held-out sequences, or (``"train"``) an evenly spaced sample of the training ones of
        about the same count: heads that do much better on text they trained on than on held-out
        text have memorised it, the sign that they need more text rather than more training."""
        if split not in EVAL_SPLITS:
            raise VerispecError(f"unknown evaluation split {split!r}: one of {', '.join(EVAL_SPLITS)}")
        held = self.sequences(heldout=True)
        if split == "heldout":
            return held
        train = self.sequences(heldout=False)
        return train[:: max(1, len(train) // max(1, len(held)))][: max(1, len(held))]

    def features(self, index: torch.Tensor, layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Hidden states ``[..., H]`` (float32) at positions ``index``; with ``layers`` (a drafter's
        feature layers, which must be the data's), the target rows it reads, ``[..., (1 + F) H]``:
        the last state, then the taps."""
        if layers and layers != self.feature_layers:
            raise VerispecError(
                f"a drafter fusing layers {list(layers)} needs their hidden states; the data has "
                f"{list(self.feature_layers) or 'the last layer only'} (train with --feature-layers)"
            )
        if layers and self.raw_taps:
            raise VerispecError(
                f"the data's taps of layers {list(layers)} are raw residual states (EAGLE-3's, "
                "--aux-layers); verispec's EAGLE fuses normed ones (train with --feature-layers)"
            )
        flat = index.reshape(-1).numpy()
        rows = torch.from_numpy(np.asarray(self.hidden[flat], dtype=np.float32))
        if layers and self.taps is not None:
            lower = torch.from_numpy(np.asarray(self.taps[flat], dtype=np.float32))
            rows = torch.cat([rows, lower], dim=-1)
        return rows.reshape(*index.shape, -1)

    def aux(self, index: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
        """An EAGLE-3 drafter's input at positions ``index``: the raw inputs of ``layers`` (each among
        the data's taps, which are kept in layer order), concatenated in ``layers``' order,
        ``[..., len(layers) * H]`` (float32)."""
        missing = [i for i in layers if i not in self.feature_layers]
        if not self.raw_taps or missing or not layers:
            have = f"raw taps of layers {list(self.feature_layers)}" if self.raw_taps else "no raw taps"
            raise VerispecError(
                f"an EAGLE-3 drafter reading layers {list(layers)} needs their raw inputs; the data has "
                f"{have} (train eagle3 with --aux-layers {','.join(map(str, layers))})"
            )
        assert self.taps is not None
        width = self.hidden.shape[1]
        flat = index.reshape(-1).numpy()
        taps = torch.from_numpy(np.asarray(self.taps[flat], dtype=np.float32)).unflatten(-1, (-1, width))
        picked = taps[:, [self.feature_layers.index(i) for i in layers]]
        return picked.reshape(*index.shape, len(layers) * width)

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` how often each token is a label in the training split."""
        return torch.bincount(self.label[self._training_labels()], minlength=vocab_size)

    def _training_labels(self) -> torch.Tensor:
        mask = self.ok.clone()
        for a, b in self.sequences(heldout=True):
            mask[a:b] = False
        return mask

    def frequent_labels(self, n: int) -> tuple[torch.Tensor | None, float]:
        """The ``n`` most frequent labels of the training split (None when n = 0) and the share of
        training labels they cover."""
        counts = torch.bincount(self.label[self._training_labels()], minlength=1)
        if n == 0 or n >= counts.numel():
            return None, 1.0
        top = counts.topk(n)
        return top.indices, float(top.values.sum() / counts.sum().clamp_min(1))


def accuracy_rows(hits: torch.Tensor, count: torch.Tensor, width: int) -> list[dict[str, float]]:
    """The accuracy table every drafter's evaluation returns, one row per depth (or head) from its
    top-1 and top-``width`` ``hits [D, 2]`` over ``count [D]`` positions (a depth without any: 0)."""
    share = hits / count.clamp_min(1)[:, None]
    return [
        {"depth": d + 1, "top1": float(share[d, 0]), f"top{width}": float(share[d, 1]),
         "positions": int(count[d])}
        for d in range(count.numel())
    ]  # fmt: skip
