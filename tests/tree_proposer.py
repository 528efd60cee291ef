"""A small token-tree proposer for tests: the draft model's top two tokens, each followed by the
draft's greedy next token (a 2-wide, 2-deep tree of deterministic candidates). It also records the
target hidden states the engine hands it, so tests can check them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.models.hf import HFCausalLM
from verispec.proposers.base import Proposer
from verispec.types import Draft


class TopTwoTree(Proposer):
    name = "test-top-two-tree"
    needs_hidden = True

    def __init__(self, draft: HFCausalLM) -> None:
        self.draft = draft

    def new_state(self, prompt_ids: Sequence[int], sampling: object) -> list[torch.Tensor]:
        return []  # the target hidden states received so far

    def prefill(self, state: list[torch.Tensor], hidden: torch.Tensor) -> None:
        state.append(hidden)

    def _next_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.draft.model(input_ids=torch.tensor([ids])).logits[0, -1]

    def propose(self, state: list[torch.Tensor], token_ids: Sequence[int], k: int) -> Draft:
        first = self._next_logits(list(token_ids)).topk(2).indices.tolist()
        if k < 2:
            return Draft(tokens=torch.tensor(first), parents=torch.tensor([-1, -1]))
        second = [int(self._next_logits([*token_ids, f]).argmax()) for f in first]
        return Draft(tokens=torch.tensor(first + second), parents=torch.tensor([-1, -1, 0, 1]))

    def update(
        self,
        state: list[torch.Tensor],
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        assert hidden is not None and hidden.shape[0] == num_accepted + 1
        state.append(hidden)
