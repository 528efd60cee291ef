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
   accepted), while every expansion is one more drafter pass; stop too below the engine's
   ``min_logp``, the policy's floor for this step (on the 1.5B int4 path a second verify token
   costs ~20% of a step, so it keeps one node in most steps: the floor saved ~2 of ~7 ms of
   drafting per step at the same accepted length, docs/design.md#node-gain-floor), and within a level expand
   only the nodes at or above that floor (the same 16-node budget: 8.2 -> 6.5 ms of drafting per
   step, docs/design.md#eagle-drafting-cost), so that a wide budget (EAGLE-2's 60 tokens, for hardware where
   verify rows are nearly free) costs little drafting where they are not;
3. rerank: keep the ``nodes`` best-scoring nodes of everything expanded, at most k deep.

A batch drafts together (:meth:`EagleProposer.propose_batch`): one catch-up pass for all sequences
and one pass per level over every tree still expanding (:meth:`EagleDrafter.step`: the Linears over
all rows at once, attention per sequence over its own cache), then one LM-head product over all
their rows. At a handful of rows a pass costs about a weight read, so a batch of n pays one read per
level instead of n.

Draft keys and values of step 2 go to scratch slots past the cache's committed ones, which the next
step's true pairs overwrite, so nothing has to be rolled back after verification: the true features
of what was accepted come in with the next update.
Candidates are the draft's top tokens (deterministic), so sampling verification stays exact.

Where the drafter's pairs are the same bits however they were grouped
(:attr:`~verispec.heads.eagle.EagleDrafter.position_invariant`), the prefix cache keeps them beside the
target's keys and values (:meth:`EagleProposer.prefix_kv`): a chat's next turn or an agent's next
call then feeds the drafter only its new positions, not the whole conversation again (a 700-token
tool-calling transcript cost ~0.3 s of catch-up per call on a 2-core CPU, a sixth of the call).

With a request's penalties or grammar (:meth:`~verispec.proposers.heads_base.HeadsProposer.constrain`),
each expanded node's draft logits are adjusted for its own context (the committed tokens plus its
path) before its children are chosen: the same rows the verification will judge, so under a JSON
schema the heads draft only tokens the grammar allows, with the probabilities renormalised over
them, and the grammar's masks computed here are the ones verification reuses
(:class:`~verispec.structured.Constraint` remembers them until the next committed token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from verispec.heads.eagle import DraftCache, DraftRows, EagleDrafter
from verispec.heads.trees import best_subtree
from verispec.heads.vocab import VocabHead
from verispec.models.kv import KVBuffer
from verispec.proposers.base import Proposer, register
from verispec.proposers.heads_base import HeadsProposer, HeadsQuantization, log_probs
from verispec.types import Draft

if TYPE_CHECKING:
    from verispec.config import SamplingConfig, SpecConfig
    from verispec.models.base import CausalLM
    from verispec.penalties import RequestRules


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
    rules: RequestRules | None = None
    """The request's penalties and grammar, applied to the draft's rows as to the target's."""


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
        quantize: HeadsQuantization = "none",
        expand_min_prob: float = EXPAND_MIN_PROB,
    ) -> None:
        super().__init__(drafter, vocab_head, nodes=nodes, width=width, quantize=quantize)
        self.drafter = drafter
        self.feature_layers = drafter.config.feature_layers
        self.embeddings = embeddings
        self.expand_min_logp = math.log(expand_min_prob) if expand_min_prob > 0 else -math.inf

    @classmethod
    def _target_parts(cls, target: Any) -> tuple[Any, ...]:
        return (target.model.get_input_embeddings(),)

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> EagleState:
        return EagleState(cache=DraftCache(self.drafter.config, device=self.device))

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

    def prefix_kv(self, state: EagleState) -> KVBuffer | None:
        """The sequence's true pairs, for the prefix cache, where they are exact to reuse
        (:attr:`~verispec.heads.eagle.EagleDrafter.position_invariant`); see :class:`PairSlots`."""
        if not getattr(self.drafter, "position_invariant", False):
            return None
        return PairSlots(state)

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's true features from the engine's hidden rows ``[n, (1 + F) H]``."""
        return self.drafter.fuse(hidden)

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)
        return self.embeddings(ids).float()

    @torch.inference_mode()
    def propose_batch(
        self,
        states: Sequence[EagleState],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        *,
        min_logp: float = -math.inf,
    ) -> list[Draft]:
        """Draft every sequence's tree level by level, all sequences in one drafter pass per level
        (and one catch-up pass): the drafter's and the LM head's weights are read once per level
        for the batch instead of once per sequence, which is what a level costs at small row counts.
        A level is expanded only while its best node scores at least ``expand_min_prob`` and
        ``min_logp`` (the policy's floor: children of a node below it cannot be kept either), and of
        its ``width`` best nodes only those at ``min_logp`` or above: with a wide tree budget on
        hardware where a verify row is dear, most of them are below it, and each would cost a
        drafter row for children the policy drops (the fixed policy has no floor: unchanged).
        """
        floor = max(self.expand_min_logp, min_logp)
        self._catch_up(states, token_ids)
        trees = [
            _Tree(state, k, ids) if state.last_out is not None and k >= 1 else None
            for state, k, ids in zip(states, ks, token_ids, strict=True)  # k < 1, one-token prompt: none
        ]
        live = [t for t in trees if t is not None]
        if live:
            roots = torch.stack([t.state.last_out for t in live if t.state.last_out is not None])
            self._add_children([(t, -1) for t in live], roots)
        for depth in range(1, max((t.k for t in live), default=0)):
            expanding = []
            for t in live:
                if depth < t.k:
                    above = [n for n in t.level if t.scores[n] >= min_logp]  # children score lower
                    chosen = sorted(above, key=lambda n, t=t: -t.scores[n])[: self.width]
                    if chosen and t.scores[chosen[0]] >= floor:
                        expanding.append((t, chosen))
            if not expanding:
                break
            out = self._expand(expanding, depth)
            self._add_children([(t, n) for t, chosen in expanding for n in chosen], out)
        return [Draft.empty() if t is None else t.best(self.nodes) for t in trees]

    def _add_children(self, parents: list[tuple[_Tree, int]], features: torch.Tensor) -> None:
        """Give each parent node (-1: the tree's root) its ``width`` best next tokens under the
        drafter's outputs ``features [len(parents), H]`` (and its request's rules); the new nodes
        are their trees' newest level. One LM-head product and one top-k for all of them.

        Where the grammar forces the next token (:meth:`~verispec.structured.Constraint.forced`:
        a schema's next key, its quotes and colon) that token is the node's only child, with
        certainty, in or out of the draft vocabulary: the heads cannot know the key names, and
        llguidance's masks allow only the canonical tokens of forced text, so out of the draft
        vocabulary the heads would have no child to offer at all. The target writes them
        (docs/design.md#forced-tokens), and the tree spends its nodes on the values the heads can guess."""
        logits = self.vocab_head(features).float()
        ruled: dict[int, tuple[_Tree, RequestRules, list[int]]] = {}
        for row, (t, _) in enumerate(parents):
            if t.state.rules is not None:
                ruled.setdefault(id(t), (t, t.state.rules, []))[2].append(row)
        forced: dict[int, int] = {}
        for t, rules, rows in ruled.values():
            paths = [t.path(parents[r][1]) for r in rows]
            logits[rows] = self.under_rules(logits[rows], rules, t.ids, paths)
            if rules.constraint is not None:
                for row, path in zip(rows, paths, strict=True):
                    if next_forced := rules.constraint.forced(path)[:1]:
                        forced[row] = next_forced[0]
        top_logp, top_idx = log_probs(logits).topk(self.width, dim=-1)  # -inf: ruled out, no child
        tokens = self.vocab_head.to_target(top_idx).tolist()
        logps = top_logp.tolist()
        for row, token in forced.items():
            tokens[row], logps[row] = [token], [0.0]
        for t, _ in parents:
            t.level = []
        rows = zip(parents, features, tokens, logps, strict=True)
        for (t, parent), feature, toks, row_logps in rows:
            t.level += t.add_children(parent, feature, toks, row_logps)

    def _expand(self, expanding: list[tuple[_Tree, list[int]]], depth: int) -> torch.Tensor:
        """One drafter pass over the chosen nodes of several trees, ``[rows, H]`` in their order:
        each row attends to its sequence's cache, its expanded ancestors and itself (a tree mask);
        its key and value go to the cache's scratch slots (:class:`~verispec.heads.eagle.DraftCache`)."""
        nodes = [(t, n) for t, chosen in expanding for n in chosen]
        embeds = self._embed([t.tokens[n] for t, n in nodes])
        features = torch.stack([t.inputs[n] for t, n in nodes])
        groups = []
        for t, chosen in expanding:
            cached, count = t.state.cache.length, len(chosen)
            slot = cached + t.drafted
            mask = torch.zeros(count, slot + count, dtype=torch.bool)
            mask[:, :cached] = True
            for r, n in enumerate(chosen):
                mask[r, [cached + s for s in t.ancestors[n]] + [slot + r]] = True
                t.slot[n] = t.drafted + r
            t.drafted += count
            positions = torch.full((count,), t.state.fed + depth - 1, dtype=torch.long)
            groups.append(DraftRows(t.state.cache, slot, positions, mask))
        return self.drafter.step(embeds, features, groups)

    def _catch_up(self, states: Sequence[EagleState], token_ids: Sequence[Sequence[int]]) -> None:
        """Feed the pairs whose target features arrived since the last step: one pass for all
        sequences, each row seeing its sequence's cache and its own earlier new pairs (causal)."""
        todo, ids, features, groups = [], [], [], []
        for state, seq_ids in zip(states, token_ids, strict=True):
            if not state.pending:
                continue
            new = torch.cat(state.pending)
            state.pending.clear()
            start, n = state.fed, new.shape[0]
            if start + n != len(seq_ids) - 1:
                raise RuntimeError(
                    f"eagle proposer out of step: {start + n} target features for {len(seq_ids)} tokens"
                )
            todo.append((state, n))
            ids += seq_ids[start + 1 : start + n + 1]
            features.append(new)
            causal = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
            positions = torch.arange(start, start + n)
            groups.append(DraftRows(state.cache, start, positions, causal, catch_up=True))
        if not todo:
            return
        out = self.drafter.step(self._embed(ids), self._features(torch.cat(features)), groups)
        row = 0
        for state, n in todo:
            state.cache.commit(n)
            state.fed += n
            row += n
            state.last_out = out[row - 1].clone()


class PairSlots(KVBuffer):
    """A sequence's true pairs as the prefix cache stores and reuses positions: slot s holds pair
    s - 1, slot 0 nothing.

    The prefix cache hands a position to a prompt that shares the tokens up to it. Pair j (feature
    h_j with token j+1) also depends on token j+1, so it sits at slot j+1, with the tokens that
    decide it: a prompt sharing n tokens with a stored sequence takes its first n - 1 pairs, never
    one whose next token differs. Filling this buffer (:meth:`advance` after the cache wrote its
    slots) moves the pairs into the sequence's drafter cache and drops their hidden rows, which the
    engine hands over first, from the features still to feed.
    """

    def __init__(self, state: EagleState) -> None:
        super().__init__()
        self.state = state
        if state.fed:
            keys, values = state.cache.keys, state.cache.values  # [kv, fed, d]
            blank = keys.new_zeros(keys.shape[0], 1, keys.shape[2])
            self.write(0, 0, torch.cat([blank, keys], dim=1), torch.cat([blank, values], dim=1))
            super().advance(state.fed + 1)

    def advance(self, n: int) -> None:
        super().advance(n)
        pairs = self.length - 1
        if pairs <= 0:
            return
        state = self.state
        waiting = torch.cat(state.pending) if state.pending else None
        if state.fed or waiting is None or waiting.shape[0] <= pairs:
            raise RuntimeError(
                "eagle proposer: reused pairs need an empty drafter cache and the reused positions' "
                "hidden rows first"
            )
        state.cache.write(0, self.keys[0][:, 1 : pairs + 1], self.values[0][:, 1 : pairs + 1])
        state.cache.commit(pairs)
        state.fed = pairs
        state.pending = [waiting[pairs:]]


@dataclass
class _Tree:
    """One sequence's tree while it is drafted: nodes in the order they were added."""

    state: EagleState
    k: int
    ids: Sequence[int]
    """The sequence's committed token ids (the context of the root)."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    """Path scores: summed draft log-probabilities from the root."""
    inputs: list[torch.Tensor] = field(default_factory=list)
    """Per node: the feature its own pair carries (its parent's drafter output)."""
    ancestors: list[list[int]] = field(default_factory=list)
    """Per node: the scratch slots (after the cache's committed ones) of its expanded ancestors."""
    slot: dict[int, int] = field(default_factory=dict)
    """Expanded nodes' scratch slots."""
    drafted: int = 0
    """Scratch slots used so far (nodes expanded)."""
    level: list[int] = field(default_factory=list)
    """The newest level's nodes."""

    def best(self, nodes: int) -> Draft:
        if not self.tokens:  # the rules allowed nothing the heads can draft
            return Draft.empty()
        return best_subtree(self.tokens, self.parents, self.scores, nodes)

    def path(self, node: int) -> list[int]:
        """The tokens from the root to ``node`` (-1: the root, an empty path)."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def add_children(
        self, parent: int, feature: torch.Tensor, tokens: list[int], logps: list[float]
    ) -> list[int]:
        """``tokens`` (with their draft log-probabilities) as children of ``parent`` (-1: the root)."""
        base = self.scores[parent] if parent >= 0 else 0.0
        ancestors = [] if parent < 0 else [*self.ancestors[parent], self.slot[parent]]
        new = []
        for tok, lp in zip(tokens, logps, strict=True):
            if lp == -math.inf:  # ruled out (top-k fills a row with fewer allowed tokens than width)
                continue
            new.append(len(self.tokens))
            self.tokens.append(tok)
            self.parents.append(parent)
            self.scores.append(base + lp)
            self.inputs.append(feature)
            self.ancestors.append(ancestors)
        return new


@register("eagle")
def _build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
    return EagleProposer.build(spec, target)
