"""Medusa heads (Cai et al. 2024): K small residual blocks on the target's last hidden state.

Head i maps the hidden state ``h_j`` (the target's state after token j, whose LM-head output is the
target's prediction of token j+1) to a state whose LM-head output predicts token ``j + 2 + i``. Each
head is ``h + SiLU(W h + b)`` (``num_layers`` such blocks), read out through the target's own
frozen LM head, so a head only has to *move* the hidden state. W starts at zero, so an untrained
head predicts what the LM head does; training moves it one, two, ... tokens ahead.

How that fits the engine's step (:mod:`verispec.engine`): the pending token ``x_m`` (the last
committed one, fed this step) was produced by the target's LM head on ``h_{m-1}``, the last hidden
state the proposer has. Heads on ``h_{m-1}`` therefore predict ``x_{m+1}, x_{m+2}, ...``: head 0
gives the tree's first level (children of the pending token), head i its level i+1. This is exactly
the layout of the original Medusa, where the tree's root is the LM head's own next token; the
heads are trained the usual way and no step is lost, including the first one after the prompt.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int = 4
    """K: head i predicts the token i + 2 positions after the hidden state's own token."""
    num_layers: int = 1
    """Residual blocks per head."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))``; the linear starts at zero, so the block starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; ``forward(h [..., H]) -> [..., K, H]`` hidden states for the target's LM head.

    Parameter names (``medusa_head.{i}.{layer}.linear.weight``/``.bias``) follow the original Medusa
    checkpoints (FasterDecoding/Medusa), whose heads also end in a per-head LM head copy
    (``medusa_head.{i}.{num_layers}.weight``); here that copy is the target's own head, not stored.
    """

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(hidden) for head in self.medusa_head], dim=-2)
