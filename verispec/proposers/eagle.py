"""The ``eagle`` proposer: an EAGLE layer drafts a dynamic tree (EAGLE-2) from the target's features.

Per sequence the drafter keeps a KV cache of its true-feature pairs ``(h_j, x_{j+1})`` (see
:mod:`verispec.heads.eagle`). A step:

1. catch up: feed the pairs whose target features arrived since the last step (the prompt's after
   prefill; the pending and accepted tokens' after each verify) in one forward; the output of the
   last one is the drafter's guess of the target's next feature and gives the first level's
   candidates (children of the pending token);
2. expand (EAGLE-2): for each further level, take the ``width`` best nodes of the newest level by
   path score (summed draft log-probabilities), run them through the layer together (each attends
   to the cache, its draft ancestors and itself: a tree mask), and give each its ``width`` best
   next tokens; stop once no node of the newest level has a path probability of
   ``expand_min_prob``, since their children could only score lower and the depth policy keeps
   almost no such node (1.5B, 4 HumanEval prompts: 3% of kept nodes below 0.05, a quarter of them
   accepted), while every expansion is one more drafter pass;
3. rerank: keep the ``nodes`` best-scoring nodes of everything expanded, at most k deep.

Draft keys and values of step 2 are temporary and never enter the cache, so nothing has to be rolled
back after verification: the true features of what was accepted come in with the next update.
Candidates are the draft's top tokens (deterministic), so sampling verification stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from verispec.heads.eagle import DraftCache, EagleDrafter
from verispec.heads.trees import best_subtree
from verispec.heads.vocab import VocabHead
from verispec.proposers.base import Proposer, register
from verispec.proposers.heads_base import HeadsProposer
from verispec.types import Draft
from verispec.verify.tree import DraftTree

if TYPE_CHECKING:
    from verispec.config import SamplingConfig, SpecConfig
    from verispec.models.base import CausalLM


EXPAND_MIN_PROB = 0.05
"""A level whose best path probability is below this is not expanded (module docstring, step 2)."""


@dataclass
class EagleState:
    cache: DraftCache
    fed: int = 0
    """Pairs in the cache: features h_0 .. h_{fed-1} with the tokens after them."""
    pending: list[torch.Tensor] = field(default_factory=list)
    """Target features received but not yet fed ([n, H] chunks, in order)."""
    last_out: torch.Tensor | None = None
    """[H]: the drafter's output at the last fed pair, its guess of the next target feature."""


class EagleProposer(HeadsProposer):
    name = "eagle"
    kind = "eagle"

    def __init__(
        self,
        drafter: EagleDrafter,
        vocab_head: VocabHead,
        embeddings: torch.nn.Module,
        *,
        nodes: int,
        width: int,
        quantize: bool = False,
        expand_min_prob: float = EXPAND_MIN_PROB,
    ) -> None:
        super().__init__(drafter, vocab_head, nodes=nodes, width=width, quantize=quantize)
        self.drafter = drafter
        self.embeddings = embeddings
        self.expand_min_logp = math.log(expand_min_prob) if expand_min_prob > 0 else -math.inf

    @classmethod
    def _target_parts(cls, target: Any) -> tuple[Any, ...]:
        return (target.model.get_input_embeddings(),)

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> EagleState:
        return EagleState(cache=DraftCache.empty(self.drafter.config))

    def prefill(self, state: EagleState, hidden: torch.Tensor) -> None:
        if hidden.shape[0]:
            state.pending.append(hidden.detach().float().clone())

    def update(
        self,
        state: EagleState,
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        state.pending.append(self.require_hidden(hidden, self.name).detach().float().clone())

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        return self.embeddings(torch.as_tensor(list(ids), dtype=torch.long)).float()

    @torch.inference_mode()
    def propose(self, state: EagleState, token_ids: Sequence[int], k: int) -> Draft | DraftTree:
        self._catch_up(state, token_ids)
        if state.last_out is None or k < 1:
            return Draft.empty()  # a one-token prompt: no target feature yet
        m = state.fed  # position of the first draft level's pairs
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        inputs: list[torch.Tensor] = []  # per node: the feature its own pair will carry
        ancestors: list[list[int]] = []  # per node: draft KV slots of its expanded ancestors
        slot: dict[int, int] = {}

        def add_children(parent: int, feature: torch.Tensor, logp: torch.Tensor, base: float) -> list[int]:
            top_logp, top_idx = logp.topk(self.width)
            ids = self.vocab_head.to_target(top_idx).tolist()
            new = []
            for lp, tok in zip(top_logp.tolist(), ids, strict=True):
                new.append(len(tokens))
                tokens.append(tok)
                parents.append(parent)
                scores.append(base + lp)
                inputs.append(feature)
                ancestors.append([] if parent < 0 else [*ancestors[parent], slot[parent]])
            return new

        level = add_children(-1, state.last_out, self._logp(state.last_out[None])[0], 0.0)
        draft_k = state.cache.keys.new_empty(state.cache.keys.shape[0], 0, state.cache.keys.shape[2])
        draft_v = draft_k.clone()
        for depth in range(1, k):
            chosen = sorted(level, key=lambda n: -scores[n])[: self.width]
            if scores[chosen[0]] < self.expand_min_logp:
                break
            past = state.cache.length + draft_k.shape[1]
            mask = torch.zeros(len(chosen), past + len(chosen), dtype=torch.bool)
            mask[:, : state.cache.length] = True
            for row, n in enumerate(chosen):
                mask[row, [state.cache.length + s for s in ancestors[n]]] = True
                mask[row, past + row] = True
                slot[n] = draft_k.shape[1] + row
            out, new_k, new_v = self.drafter(
                self._embed([tokens[n] for n in chosen])[None],
                torch.stack([inputs[n] for n in chosen])[None],
                torch.full((len(chosen),), m + depth - 1),
                mask,
                past=(
                    torch.cat([state.cache.keys, draft_k], dim=1)[None],
                    torch.cat([state.cache.values, draft_v], dim=1)[None],
                ),
            )
            draft_k = torch.cat([draft_k, new_k[0]], dim=1)
            draft_v = torch.cat([draft_v, new_v[0]], dim=1)
            logp = self._logp(out[0])
            level = [
                c for row, n in enumerate(chosen) for c in add_children(n, out[0, row], logp[row], scores[n])
            ]
        return best_subtree(tokens, parents, scores, self.nodes)

    def _logp(self, features: torch.Tensor) -> torch.Tensor:
        return self.vocab_head(features).float().log_softmax(dim=-1)

    def _catch_up(self, state: EagleState, token_ids: Sequence[int]) -> None:
        """Feed the pairs whose target features arrived since the last step (one forward)."""
        if not state.pending:
            return
        features = torch.cat(state.pending)
        state.pending.clear()
        n, start = features.shape[0], state.fed
        if start + n != len(token_ids) - 1:
            raise RuntimeError(
                f"eagle proposer out of step: {start + n} target features for {len(token_ids)} tokens"
            )
        mask = torch.ones(n, start + n, dtype=torch.bool)
        mask[:, start:] = torch.ones(n, n, dtype=torch.bool).tril()
        out, keys, values = self.drafter(
            self._embed(token_ids[start + 1 : start + n + 1])[None],
            features[None],
            torch.arange(start, start + n),
            mask,
            past=(state.cache.keys[None], state.cache.values[None]) if start else None,
        )
        state.cache.append(keys[0], values[0])
        state.fed = start + n
        state.last_out = out[0, -1].clone()


@register("eagle")
def _build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
    return EagleProposer.build(spec, target)
