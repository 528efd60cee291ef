"""The ``medusa`` proposer: a tree of Medusa-head candidates from the target's last hidden state.

Per step and sequence: the heads turn ``h_{m-1}`` (the target's hidden state before the pending
token, see :mod:`verispec.heads.medusa` for why that is the right one) into K distributions over the
draft vocabulary; head i's top ``width`` tokens are the candidates at tree level i+1, and the
``nodes`` best paths by summed log-probability form the tree (:func:`~verispec.heads.trees.product_tree`).
The candidates are deterministic, so verification stays exact for sampling too.

With a request's rules (penalties, grammar), the first level is scored as the target's row there
will be judged: the first head's logits are penalised and masked for the committed tokens (a mask
verification then reuses, see :mod:`verispec.structured`). Deeper heads' candidates do not depend on
the path above them, so under a grammar they are filtered instead of re-scored: each level offers
``GRAMMAR_WIDENING`` times as many candidates, and a path the grammar forbids is not drafted
(checking a path costs microseconds, a mask a millisecond). Where the grammar forces the next token
(a schema's key and its punctuation) that token is the path's only continuation, as in EAGLE: the
heads would not guess key names, and the grammar's mask leaves them nothing else to offer there.

All sequences of a batch run through the heads and the LM head together: one small matmul per step.
When the target runs int8 (the CPU fast path), the heads' Linears are made int8 as well: drafting
reads a quarter of the bytes, and a draft only has to be good, not exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.heads.medusa import MedusaHeads
from verispec.heads.trees import product_tree
from verispec.heads.vocab import VocabHead
from verispec.proposers.base import Proposer, register
from verispec.proposers.heads_base import HeadsProposer, HeadsQuantization, log_probs
from verispec.types import Draft

if TYPE_CHECKING:
    from verispec.config import SamplingConfig, SpecConfig
    from verispec.models.base import CausalLM
    from verispec.penalties import RequestRules


GRAMMAR_WIDENING = 4
"""Under a grammar, candidates per level beyond the first, as a multiple of the tree width: most of a
head's top tokens may be forbidden after a given path (module docstring)."""


@dataclass
class MedusaState:
    last_hidden: torch.Tensor | None = None
    """[H]: the target's hidden state at the position before the pending token."""
    rules: RequestRules | None = None
    """The request's penalties and grammar (module docstring)."""


class MedusaProposer(HeadsProposer):
    name = "medusa"
    kind = "medusa"

    def __init__(
        self,
        heads: MedusaHeads,
        vocab_head: VocabHead,
        *,
        nodes: int,
        width: int,
        quantize: HeadsQuantization = "none",
    ) -> None:
        super().__init__(heads, vocab_head, nodes=nodes, width=width, quantize=quantize)
        self.heads = heads

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> MedusaState:
        return MedusaState()

    def prefill(self, state: MedusaState, hidden: torch.Tensor) -> None:
        if hidden.shape[0]:
            state.last_hidden = hidden[-1].detach().float().clone()

    def update(
        self,
        state: MedusaState,
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        state.last_hidden = self.require_hidden(hidden, self.name)[-1].detach().float().clone()

    @torch.inference_mode()
    def propose_batch(
        self,
        states: Sequence[MedusaState],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        *,
        min_logp: float = -math.inf,  # one pass drafts every level: nothing to save
    ) -> list[Draft]:
        out: list[Draft] = [Draft.empty()] * len(states)
        ready = [i for i, s in enumerate(states) if s.last_hidden is not None and ks[i] > 0]
        if not ready:
            return out  # a one-token prompt: nothing seen yet, the first step decodes plainly
        hidden = torch.stack([states[i].last_hidden for i in ready])  # type: ignore[misc]
        logits = self.vocab_head(self.heads(hidden)).float()  # [B, K, N]
        for b, i in enumerate(ready):
            rules = states[i].rules
            if rules is not None:
                logits[b, :1] = self.under_rules(logits[b, :1], rules, token_ids[i], [[]])
        logp = log_probs(logits)  # [B, K, N]
        top_logp, top_idx = logp.topk(self.width, dim=-1)
        top_ids = self.vocab_head.to_target(top_idx)
        for b, i in enumerate(ready):
            rules = states[i].rules
            if rules is None or rules.constraint is None:
                tree = product_tree(top_logp[b], top_ids[b], self.nodes, ks[i])
            else:
                wide_logp, wide_idx = logp[b].topk(min(logp.shape[-1], self.width * GRAMMAR_WIDENING), dim=-1)
                wide_ids = self.vocab_head.to_target(wide_idx)
                constraint = rules.constraint
                tree = product_tree(
                    wide_logp, wide_ids, self.nodes, ks[i], constraint.fits, constraint.forced
                )
            out[i] = tree if tree.size else Draft.empty()
        return out


@register("medusa")
def _build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
    return MedusaProposer.build(spec, target)
