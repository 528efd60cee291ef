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

A batch drafts together (:meth:`EagleProposer.propose_batch`): one catch-up pass for all sequences
and one pass per level over every tree still expanding, rows and keys padded to the longest and
masked out, then one LM-head product over all their rows. At a handful of rows a pass costs about a
weight read, so a batch of n pays one read per level instead of n.

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

    def propose(self, state: EagleState, token_ids: Sequence[int], k: int) -> Draft | DraftTree:
        return self.propose_batch([state], [token_ids], [k])[0]

    @torch.inference_mode()
    def propose_batch(
        self, states: Sequence[EagleState], token_ids: Sequence[Sequence[int]], ks: Sequence[int]
    ) -> list[Draft | DraftTree]:
        """Draft every sequence's tree level by level, all sequences in one drafter pass per level
        (and one catch-up pass): the drafter's and the LM head's weights are read once per level
        for the batch instead of once per sequence, which is what a level costs at small row counts.
        """
        self._catch_up(states, token_ids)
        trees = [
            _Tree(state, k) if state.last_out is not None and k >= 1 else None
            for state, k in zip(states, ks, strict=True)  # k < 1 or a one-token prompt: no draft
        ]
        live = [t for t in trees if t is not None]
        if live:
            guesses = torch.stack([t.state.last_out for t in live if t.state.last_out is not None])
            for t, guess, logp in zip(live, guesses, self._logp(guesses), strict=True):
                t.level = t.add_children(-1, guess, logp, 0.0, self)
        for depth in range(1, max((t.k for t in live), default=0)):
            expanding = []
            for t in live:
                if depth < t.k:
                    chosen = sorted(t.level, key=lambda n, t=t: -t.scores[n])[: self.width]
                    if t.scores[chosen[0]] >= self.expand_min_logp:
                        expanding.append((t, chosen))
            if not expanding:
                break
            out = self._expand(expanding, depth)
            logp = self._logp(torch.cat([o[: len(c)] for o, (_, c) in zip(out, expanding, strict=True)]))
            row = 0
            for o, (t, chosen) in zip(out, expanding, strict=True):
                t.level = []
                for r, n in enumerate(chosen):
                    t.level += t.add_children(n, o[r], logp[row], t.scores[n], self)
                    row += 1
        return [Draft.empty() if t is None else t.best(self.nodes) for t in trees]

    def _expand(self, expanding: list[tuple[_Tree, list[int]]], depth: int) -> torch.Tensor:
        """One drafter pass over the chosen nodes of several trees: each row attends to its
        sequence's cache, its expanded ancestors and itself (a tree mask); rows and keys are padded
        to the batch's longest and masked out. Returns the outputs ``[B, R, H]`` and stores each
        tree's new draft keys/values."""
        rows = max(len(c) for _, c in expanding)
        pasts = [t.state.cache.length + t.draft_k.shape[1] for t, _ in expanding]
        past = max(pasts)
        embeds, features, positions, mask, keys, values = self._padded(len(expanding), rows, past)
        mask[:, torch.arange(rows), past + torch.arange(rows)] = True  # itself (also padded rows)
        for i, (t, chosen) in enumerate(expanding):
            cached = t.state.cache.length
            embeds[i, : len(chosen)] = self._embed([t.tokens[n] for n in chosen])
            features[i, : len(chosen)] = torch.stack([t.inputs[n] for n in chosen])
            positions[i] = t.state.fed + depth - 1
            mask[i, : len(chosen), :cached] = True
            for r, n in enumerate(chosen):
                mask[i, r, [cached + s for s in t.ancestors[n]]] = True
                t.slot[n] = t.draft_k.shape[1] + r
            keys[i, :, :cached], keys[i, :, cached : pasts[i]] = t.state.cache.keys, t.draft_k
            values[i, :, :cached], values[i, :, cached : pasts[i]] = t.state.cache.values, t.draft_v
        out, new_k, new_v = self.drafter(embeds, features, positions, mask, past=(keys, values))
        for i, (t, chosen) in enumerate(expanding):
            t.draft_k = torch.cat([t.draft_k, new_k[i, :, : len(chosen)]], dim=1)
            t.draft_v = torch.cat([t.draft_v, new_v[i, :, : len(chosen)]], dim=1)
        return out

    def _padded(self, b: int, rows: int, past: int) -> tuple[torch.Tensor, ...]:
        """Zeroed drafter inputs for ``b`` sequences padded to ``rows`` new pairs and ``past`` cached
        keys: embeddings and features ``[b, rows, H]``, positions ``[b, rows]``, a mask with nothing
        visible ``[b, rows, past + rows]``, and keys and values ``[b, kv, past, d]``."""
        cfg = self.drafter.config
        h, kv, d = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim
        return (
            torch.zeros(b, rows, h),
            torch.zeros(b, rows, h),
            torch.zeros(b, rows, dtype=torch.long),
            torch.zeros(b, rows, past + rows, dtype=torch.bool),
            torch.zeros(b, kv, past, d),
            torch.zeros(b, kv, past, d),
        )

    def _logp(self, features: torch.Tensor) -> torch.Tensor:
        return self.vocab_head(features).float().log_softmax(dim=-1)

    def _catch_up(self, states: Sequence[EagleState], token_ids: Sequence[Sequence[int]]) -> None:
        """Feed the pairs whose target features arrived since the last step: one forward for all
        sequences, each row seeing its sequence's cache and its own earlier new pairs (causal),
        padded rows and keys masked out."""
        todo = []
        for state, ids in zip(states, token_ids, strict=True):
            if not state.pending:
                continue
            features = torch.cat(state.pending)
            state.pending.clear()
            if state.fed + features.shape[0] != len(ids) - 1:
                raise RuntimeError(
                    f"eagle proposer out of step: {state.fed + features.shape[0]} target features for "
                    f"{len(ids)} tokens"
                )
            todo.append((state, ids, features))
        if not todo:
            return
        rows = max(f.shape[0] for _, _, f in todo)
        past = max(state.fed for state, _, _ in todo)
        embeds, features, positions, mask, keys, values = self._padded(len(todo), rows, past)
        mask[:, :, past:] = torch.ones(rows, rows, dtype=torch.bool).tril()
        for i, (state, ids, new) in enumerate(todo):
            n, start = new.shape[0], state.fed
            embeds[i, :n] = self._embed(ids[start + 1 : start + n + 1])
            features[i, :n] = new
            positions[i] = torch.arange(start, start + rows)
            mask[i, :, :start] = True
            keys[i, :, :start], values[i, :, :start] = state.cache.keys, state.cache.values
        out, new_k, new_v = self.drafter(
            embeds, features, positions, mask, past=(keys, values) if past else None
        )
        for i, (state, _, new) in enumerate(todo):
            n = new.shape[0]
            state.cache.append(new_k[i, :, :n], new_v[i, :, :n])
            state.fed += n
            state.last_out = out[i, n - 1].clone()


@dataclass
class _Tree:
    """One sequence's tree while it is drafted: nodes in the order they were added."""

    state: EagleState
    k: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    """Path scores: summed draft log-probabilities from the root."""
    inputs: list[torch.Tensor] = field(default_factory=list)
    """Per node: the feature its own pair carries (its parent's drafter output)."""
    ancestors: list[list[int]] = field(default_factory=list)
    """Per node: the draft KV slots of its expanded ancestors."""
    slot: dict[int, int] = field(default_factory=dict)
    level: list[int] = field(default_factory=list)
    """The newest level's nodes."""
    draft_k: torch.Tensor = field(init=False)
    draft_v: torch.Tensor = field(init=False)
    """Keys and values ``[kv, D, d]`` of the expanded nodes (temporary, never cached)."""

    def __post_init__(self) -> None:
        cached = self.state.cache.keys
        self.draft_k = cached.new_empty(cached.shape[0], 0, cached.shape[2])
        self.draft_v = self.draft_k.clone()

    def best(self, nodes: int) -> DraftTree:
        return best_subtree(self.tokens, self.parents, self.scores, nodes)

    def add_children(
        self, parent: int, feature: torch.Tensor, logp: torch.Tensor, base: float, proposer: EagleProposer
    ) -> list[int]:
        """The ``width`` best next tokens of ``parent`` (-1: the root) as new nodes."""
        top_logp, top_idx = logp.topk(proposer.width)
        new = []
        for lp, tok in zip(top_logp.tolist(), proposer.vocab_head.to_target(top_idx).tolist(), strict=True):
            new.append(len(self.tokens))
            self.tokens.append(tok)
            self.parents.append(parent)
            self.scores.append(base + lp)
            self.inputs.append(feature)
            self.ancestors.append([] if parent < 0 else [*self.ancestors[parent], self.slot[parent]])
        return new


@register("eagle")
def _build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
    return EagleProposer.build(spec, target)
