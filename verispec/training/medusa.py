"""Training Medusa heads: the loss of every head at a batch of positions, and accuracy per depth.

Head i at position j predicts token j + 2 + i; its label is the target's argmax there (or, with soft
labels, the target's distribution: its LM head on the state whose output the label is).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from verispec.heads.medusa import MedusaHeads
from verispec.heads.vocab import VocabHead
from verispec.training.tokens import IGNORE, TokenData, accuracy_rows


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
    return accuracy_rows(hits, count, width)
