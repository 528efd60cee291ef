"""Training an EAGLE drafter: batches of (feature, next token) pairs, training-time test, accuracy.

Training-time test (EAGLE-3) unrolls the drafter ``--unroll`` times over a batch: pass d feeds the
drafter the features pass d - 1 predicted, under the masks that give each query exactly the keys a
depth-d draft node sees at inference (:func:`~verispec.heads.eagle.unrolled_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from verispec.heads.eagle import EagleDrafter, unrolled_masks
from verispec.heads.vocab import VocabHead
from verispec.training.config import TrainSettings
from verispec.training.tokens import IGNORE, TokenData, accuracy_rows


@dataclass
class EagleBatch:
    embeds: torch.Tensor  # [B, L, H] embeddings of x_{j+1}
    features: torch.Tensor  # [B, L, H] h_j ([B, L, (1 + F) H] with the taps of F feature layers)
    next_features: torch.Tensor  # [B, L, H] h_{j+1}
    label: torch.Tensor  # [B, L] label of x_{j+2}
    greedy: torch.Tensor  # [B, L] the target's argmax for x_{j+2}
    valid: torch.Tensor  # [B, L]


def pair_positions(
    seqs: list[tuple[int, int]], total: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, L]`` store positions j of each sequence's pairs, of their next tokens j + 1, and which are
    real: sequences padded to the longest with their own first position, never valid."""
    length = max(b - a - 1 for a, b in seqs)
    index = torch.zeros(len(seqs), length, dtype=torch.long)
    valid = torch.zeros(len(seqs), length, dtype=torch.bool)
    for row, (a, b) in enumerate(seqs):
        n = b - a - 1
        index[row, :n] = torch.arange(a, a + n)
        index[row, n:] = a
        valid[row, :n] = True
    return index, (index + 1).clamp_max(total - 1), valid


def eagle_batch(
    data: TokenData, embeddings: torch.Tensor, seqs: list[tuple[int, int]], layers: tuple[int, ...] = ()
) -> EagleBatch:
    """Pairs ``(h_j, x_{j+1})`` of each sequence, padded to the longest (padding is never valid and,
    coming after every real position, never attended to by one); ``layers``: the drafter's feature
    layers, whose taps come with ``h_j``."""
    feat_idx, nxt, valid = pair_positions(seqs, data.total)
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
    return accuracy_rows(hits, count, width)


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
