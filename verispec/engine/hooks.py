"""The two things a step serves beside decoding, each behind a small hook the step calls once.

- :class:`HiddenTap`, the distillation tap: hands an observer (``verispec distill --keep-hidden``)
  the target's last-layer hidden state after every token it is fed, so the heads' hidden-state
  store needs no second pass of the target over the replies. Without an observer it does nothing.
- :class:`StepCosts`, the cost-model setup: the depth policy, built on first use from step costs
  measured on this machine (or loaded from the cache, or given), and corrected by every step's
  measured times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from verispec.config import SpecConfig
from verispec.costs import StepCostModel, load_or_measure
from verispec.engine.state import SeqState
from verispec.models.base import CausalLM
from verispec.policy import DepthPolicy, make_policy


class HiddenObserver(Protocol):
    """Receives the target's last-layer hidden state after every token of a request, in order."""

    def prefilled(self, request_id: str, hidden: torch.Tensor) -> None:
        """``hidden [n, H]``: after the next n prompt tokens (the prompt's last token comes later,
        as the first decode step's pending token)."""

    def committed(self, request_id: str, hidden: torch.Tensor, greedy: torch.Tensor) -> None:
        """``hidden [n, H]``: after a decode step's pending token and after each token it appended
        that was fed (the last token of a reply never is); ``greedy [n]``: the unadjusted target's
        argmax there."""


class HiddenTap:
    """Forwards the target's hidden rows to :attr:`observer`, cut to the last layer's state."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self.observer: HiddenObserver | None = None

    def last_layer(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's state of hidden rows that may carry a proposer's feature layers too."""
        return hidden[..., : self.hidden_size]

    def prefilled(self, seq: SeqState, hidden: torch.Tensor) -> None:
        """``hidden [n, (1 + F) H]``: the rows of a prefill chunk of ``seq``."""
        if self.observer is not None:
            self.observer.prefilled(seq.request.request_id, self.last_layer(hidden))

    def committed(
        self,
        seq: SeqState,
        hidden: torch.Tensor,  # [kept, (1 + F) H]: the kept verify rows (pending token, accepted path)
        logits: torch.Tensor,  # [kept, V]: the target's raw logits on the same rows
        appended: int,  # tokens the step appended (a stop can cut it short)
    ) -> None:
        """A decode step's kept rows, up to the last one whose token was fed: the pending token's and
        each appended draft token's (the token the step adds itself is fed at the next step)."""
        if self.observer is not None:
            fed = min(appended + 1, hidden.shape[0])
            greedy = logits[:fed].argmax(-1)  # the raw target's, as a store pass keeps
            self.observer.committed(seq.request.request_id, self.last_layer(hidden[:fed]), greedy)


class StepCosts:
    """The depth policy and the cost model it trades acceptance against."""

    def __init__(
        self, spec: SpecConfig, target: CausalLM, draft: CausalLM | None, model: StepCostModel | None
    ) -> None:
        """``model``: given costs; None measures them on first use where the policy is adaptive."""
        self.spec = spec
        self.target = target
        self.draft = draft
        self.model = model
        self._policy: DepthPolicy | None = None

    @property
    def policy(self) -> DepthPolicy:
        """The depth policy, built on first use (the adaptive one measures costs, or loads them):
        call it before timing a step, so a measurement is never timed as part of one."""
        if self._policy is None:
            if self.spec.depth == "adaptive" and self.model is None:
                from verispec.models.registry import cache_root

                self.model = load_or_measure(self.target, self.draft, cache_root() / "costs")
            self._policy = make_policy(self.spec.depth, self.model, self.spec.disable_by_batch_size)
        return self._policy

    @policy.setter
    def policy(self, policy: DepthPolicy) -> None:
        self._policy = policy

    def observe(
        self,
        drafted: Sequence[int],
        draft_seconds: float,
        target_seconds: float,
        tokens: int,
        key_queries: int,
    ) -> None:
        """Correct the cost model by one decode step's measured times: its target forward over
        ``tokens`` tokens attending to ``key_queries`` cached keys in all, and its draft-model steps
        (``drafted``: each sequence's depth)."""
        if self._policy is None or self.model is None:
            return
        self.model.observe_target(tokens, target_seconds, key_queries)
        levels = [sum(1 for k in drafted if k > j) for j in range(max(drafted, default=0))]
        if levels and self.draft is not None:
            self.model.observe_draft(levels, draft_seconds)
