"""The target's LM head, frozen and optionally restricted to a draft vocabulary.

Heads predict tokens through the target's own LM head (they only move the hidden state), so they
ship no vocabulary-sized weights. The full head is the costliest part of drafting on a CPU: one row
of the 1.5B's 152k x 1536 head reads 233 MB (int8). Like EAGLE-3, heads can be trained for and
draft over the N most frequent tokens of the training data only: the head is cut to those rows
(a tenth of the cost for N = 16k), and a token outside them is never proposed, which costs
acceptance only where the target would have chosen a rare token. The draft vocabulary is saved with
the heads (``draft_vocab``, target token ids in draft-index order).

Drafting uses the target's head as it runs (a GGUF file's own blocks, int8 or int4 on the CPU fast
paths, rows sliced without re-quantizing), or an int8 head's rows re-quantized to int4 where the
heads run int4 (:func:`~verispec.proposers.heads_base.heads_quantization`: at a few rows the int4
kernel's product costs 40-65% of fbgemm's int8); training uses its float weights (de-quantized for a quantized
target, so the heads learn the head they will draft with).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from verispec.models.gguf_linear import GGUFLinear
from verispec.models.int4 import Int4Linear, quantize_weight
from verispec.models.quant import RowwiseInt8Linear


def float_lm_head_weight(target: Any) -> torch.Tensor:
    """[V, H] float32 weights of the target's LM head (de-quantized if it runs int8 or int4)."""
    head = target.lm_head
    if isinstance(head, Int4Linear | GGUFLinear):
        return head.dequantized()
    if isinstance(head, RowwiseInt8Linear):
        int8, scales = head.int8_parts()
        return (int8[:, : head.in_features].float() * scales[:, None]).contiguous()
    return head.weight.detach().float().cpu()


class VocabHead(nn.Module):
    """Logits over the draft vocabulary from hidden states ``[..., H]`` (all of it if ``vocab`` is None).

    The weights are the target's and are never trained: registered as buffers, not parameters.
    """

    def __init__(
        self, target: Any, vocab: torch.Tensor | None, *, for_training: bool = False, int4: bool = False
    ) -> None:
        super().__init__()
        ids = vocab.long() if vocab is not None else None
        self.register_buffer("vocab", ids if ids is not None else torch.empty(0, dtype=torch.long))
        self.size = int(ids.numel()) if ids is not None else int(target.vocab_size)
        self.target_size = int(target.vocab_size)
        self.softcap = getattr(target, "softcap", None)
        head = target.lm_head
        self.linear: nn.Module | None = None
        if not for_training and isinstance(head, Int4Linear | GGUFLinear):  # its rows as they are
            self.linear = head.rows(ids) if ids is not None else head
            self.register_buffer("weight", torch.empty(0))
        elif int4 and not for_training:
            weight = float_lm_head_weight(target)
            weight = weight[ids] if ids is not None else weight
            self.linear = Int4Linear(*quantize_weight(weight), None, tuple(weight.shape))
            self.register_buffer("weight", torch.empty(0))
        elif not for_training and isinstance(head, RowwiseInt8Linear):
            int8, scales = head.int8_parts()
            if ids is not None:
                int8, scales = int8[ids], scales[ids]
            self.linear = RowwiseInt8Linear(int8.contiguous(), scales.contiguous(), None)
            self.register_buffer("weight", torch.empty(0))
        else:
            weight = float_lm_head_weight(target)
            self.register_buffer("weight", (weight[ids] if ids is not None else weight).contiguous())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden.float()) if self.linear is not None else hidden @ self.weight.T
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary indices."""
        return self.vocab[draft_ids] if self.vocab.numel() else draft_ids

    def target_to_draft(self, vocab_size: int) -> torch.Tensor:
        """[V] int64: each target token's draft index, or -1 outside the draft vocabulary."""
        if not self.vocab.numel():
            return torch.arange(vocab_size)
        out = torch.full((vocab_size,), -1, dtype=torch.long)
        out[self.vocab] = torch.arange(self.vocab.numel())
        return out
