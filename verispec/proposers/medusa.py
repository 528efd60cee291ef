"""The ``medusa`` proposer: a tree of Medusa-head candidates from the target's last hidden state.

Per step and sequence: the heads turn ``h_{m-1}`` (the target's hidden state before the pending
token, see :mod:`verispec.heads.medusa` for why that is the right one) into K distributions over the
draft vocabulary; head i's top ``width`` tokens are the candidates at tree level i+1, and the
``nodes`` best paths by summed log-probability form the tree (:func:`~verispec.heads.trees.product_tree`).
The candidates are deterministic, so verification stays exact for sampling too.

All sequences of a batch run through the heads and the LM head together: one small matmul per step.
When the target runs int8 (the CPU fast path), the heads' Linears are made int8 as well: drafting
reads a quarter of the bytes, and a draft only has to be good, not exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verispec.errors import VerispecError
from verispec.heads.io import LoadedHeads, load_heads, resolve_heads_folder
from verispec.heads.medusa import MedusaHeads
from verispec.heads.trees import product_tree
from verispec.heads.vocab import VocabHead
from verispec.proposers.base import Proposer, register
from verispec.types import Draft
from verispec.verify.tree import DraftTree

if TYPE_CHECKING:
    from verispec.config import SamplingConfig, SpecConfig
    from verispec.models.base import CausalLM


@dataclass
class MedusaState:
    last_hidden: torch.Tensor | None = None
    """[H]: the target's hidden state at the position before the pending token."""


class MedusaProposer(Proposer):
    name = "medusa"
    needs_hidden = True
    drafts_trees = True

    def __init__(
        self, heads: MedusaHeads, vocab_head: VocabHead, *, nodes: int, width: int, quantize: bool = False
    ) -> None:
        if nodes < 1 or width < 1:
            raise VerispecError(f"tree nodes and width must be >= 1, got nodes={nodes} width={width}")
        self.heads = heads.eval()
        if quantize:
            from verispec.models.quant import quantize_int8_dynamic

            quantize_int8_dynamic(self.heads)
        self.vocab_head = vocab_head
        self.nodes = nodes
        self.width = min(width, vocab_head.size)
        self.description: dict[str, object] = {
            "tree_nodes": nodes,
            "tree_width": self.width,
            "draft_vocab": vocab_head.size,
            "int8": quantize,
        }
        """What defines this proposer, for benchmark reports."""
        self.num_heads = heads.config.num_heads

    @classmethod
    def from_loaded(cls, loaded: LoadedHeads, target: Any, spec: SpecConfig | None = None) -> MedusaProposer:
        assert isinstance(loaded.module, MedusaHeads)
        nodes = (spec.tree_nodes if spec is not None else None) or loaded.tree["nodes"]
        width = (spec.tree_width if spec is not None else None) or loaded.tree["width"]
        proposer = cls(
            loaded.module,
            VocabHead(target, loaded.draft_vocab),
            nodes=nodes,
            width=width,
            quantize=getattr(target, "quantization", "none") in ("int8", "int4"),
        )
        proposer.description["heads"] = str(loaded.path) if loaded.path is not None else None
        return proposer

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
        if hidden is None:
            raise RuntimeError("the medusa proposer needs the target's hidden states (needs_hidden)")
        state.last_hidden = hidden[-1].detach().float().clone()

    def propose(self, state: MedusaState, token_ids: Sequence[int], k: int) -> Draft | DraftTree:
        return self.propose_batch([state], [token_ids], [k])[0]

    @torch.inference_mode()
    def propose_batch(
        self, states: Sequence[MedusaState], token_ids: Sequence[Sequence[int]], ks: Sequence[int]
    ) -> list[Draft | DraftTree]:
        out: list[Draft | DraftTree] = [Draft.empty()] * len(states)
        ready = [i for i, s in enumerate(states) if s.last_hidden is not None and ks[i] > 0]
        if not ready:
            return out  # a one-token prompt: nothing seen yet, the first step decodes plainly
        hidden = torch.stack([states[i].last_hidden for i in ready])  # type: ignore[misc]
        logp = self.vocab_head(self.heads(hidden)).log_softmax(dim=-1)  # [B, K, N]
        top_logp, top_idx = logp.topk(self.width, dim=-1)
        top_ids = self.vocab_head.to_target(top_idx)
        for b, i in enumerate(ready):
            out[i] = product_tree(top_logp[b], top_ids[b], self.nodes, min(ks[i], self.num_heads))
        return out


@register("medusa")
def _build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
    folder = resolve_heads_folder(spec.heads, "medusa", target.name)
    return MedusaProposer.from_loaded(load_heads(folder, target, kind="medusa"), target, spec)
