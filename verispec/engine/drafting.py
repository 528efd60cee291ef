"""The propose stage of a decode step, and what verification teaches it.

Before verification: the depth policy picks each sequence's k from what is known before the step
(measured costs, the sequence's acceptance so far, the batch), the proposer drafts that deep (one
batched pass for a draft model), and a scored tree keeps the best prefix the policy finds worth
its verify rows. Nothing here may look at the target's verdict on this step's drafts: a depth that
did would bias the output (``tests/test_policy.py`` shows one that does). After verification,
:meth:`Drafting.observe` feeds the outcome to the acceptance estimates the next steps' depths use.
"""

from __future__ import annotations

import math

from verispec.config import SpecConfig
from verispec.engine.hooks import StepCosts
from verispec.engine.state import SeqState
from verispec.models.base import CausalLM
from verispec.policy import AcceptancePrior, DepthQuery, TreeCalibration
from verispec.proposers.base import Proposer
from verispec.types import Draft, VerifyResult


class Drafting:
    """Depth choice, drafting and tree sizing for a batch; acceptance bookkeeping after it."""

    def __init__(
        self,
        proposer: Proposer | None,
        costs: StepCosts,
        spec: SpecConfig,
        target: CausalLM,
        draft_model: CausalLM | None,
    ) -> None:
        self.proposer = proposer
        self.max_context = target.max_context
        self.costs = costs
        self.spec = spec
        self.draft_model = draft_model
        self.prior = AcceptancePrior()
        """Acceptance over every sequence, where a new sequence's estimate starts."""
        self.tree_calibration = TreeCalibration()
        """How far the proposer's tree scores are from what verification accepts (scored trees only)."""

    def propose(self, seqs: list[SeqState]) -> list[Draft]:
        """One draft per sequence (empty where it does not speculate this step)."""
        depths = [0 if self.awaits_features(s) else k for s, k in zip(seqs, self._depths(seqs), strict=True)]
        return self._size_trees(seqs, self._draft(seqs, depths))

    def awaits_features(self, seq: SeqState) -> bool:
        """Whether ``seq``'s prompt tail rides in this step's forward while its proposer drafts from
        the target's hidden states: the features of the tail's last token, where a draft starts,
        come out of that very forward, so the sequence cannot speculate in this step (nor does the
        step count as one where it chose not to)."""
        return seq.tail_in_decode and self.proposer is not None and self.proposer.needs_hidden

    def observe(self, seq: SeqState, draft: Draft, result: VerifyResult) -> None:
        """Record one sequence's outcome: its stats, its acceptance estimate, the engine-wide prior
        and, for a scored tree, how well the scores predicted it."""
        depth, accepted = draft.depth, result.num_accepted
        seq.stats.observe(depth, accepted)
        if draft.scores is not None:
            self.tree_calibration.observe(draft.expected, accepted)
        if depth:
            seq.acceptance.observe(depth, accepted)
            self.prior.observe(depth, accepted)
        elif seq.request.num_speculative_tokens and not self.awaits_features(seq):
            seq.acceptance.relax()

    def observe_step(self, seqs: list[SeqState], drafts: list[Draft]) -> None:
        """A step in which speculation was wanted but nothing was drafted lets the prior drift back,
        so one bad stretch cannot keep speculation off for good."""
        wanted = [s for s in seqs if s.request.num_speculative_tokens and not self.awaits_features(s)]
        if not any(d.depth for d in drafts) and wanted:
            self.prior.relax()

    def feeds_draft(self, seq: SeqState) -> bool:
        """Whether ``seq``'s prompt chunks go to the draft model too (decided at its first chunk)."""
        if seq.feeds_draft is None:
            seq.feeds_draft = seq.request.num_speculative_tokens > 0 and self._draft_prefill_pays(seq)
        return seq.feeds_draft

    def _draft_prefill_pays(self, seq: SeqState) -> bool:
        """Feed the draft model the prompt only if the depth policy would start it at the first
        decode step with the whole prompt still to catch up on: the same price, paid now in the
        target's chunks (no stall of the other sequences), or never, where the request has too few
        tokens left to win it back (a long RAG prompt with a short answer). A sequence that skips it
        can still start later: the policy prices its backlog at every step."""
        if self.draft_model is None or self.spec.depth != "adaptive":
            return True
        cap = seq.speculation_cap
        if cap <= 0:
            return False
        query = _depth_query(seq, cap, context=len(seq.token_ids), backlog=len(seq.token_ids))
        return self.costs.policy.choose([query])[0] > 0

    def _depths(self, seqs: list[SeqState]) -> list[int]:
        caps = [s.speculation_cap for s in seqs]
        proposer = self.proposer
        if proposer is None or not any(caps):
            return [0] * len(seqs)
        policy = self.costs.policy
        if proposer.drafts_trees:  # sized after drafting (_size_trees); only the batch cut-off applies here
            return [0] * len(seqs) if policy.disabled(len(seqs)) else caps
        queries = [
            _depth_query(
                s,
                c,
                context=s.pending_position,
                backlog=proposer.backlog(s.proposer_state, s.token_ids) if c else 0,
            )
            for s, c in zip(seqs, caps, strict=True)
        ]
        return policy.choose(queries)

    def _draft(self, seqs: list[SeqState], ks: list[int]) -> list[Draft]:
        drafts = [Draft.empty()] * len(seqs)
        active = [i for i, k in enumerate(ks) if k > 0]
        if self.proposer is None or not active:
            return drafts
        states = [seqs[i].proposer_state for i in active]
        token_ids = [seqs[i].token_ids for i in active]
        min_logp = -math.inf
        if self.proposer.drafts_trees:
            min_logp = self._tree_floor(
                [s.pending_position for s in seqs], self.proposer.max_tree_size(max(ks))
            )
            if min_logp >= 0.0:  # not even a certain node would be kept: drafting cannot pay
                return drafts
        proposed = self.proposer.propose_batch(states, token_ids, [ks[i] for i in active], min_logp=min_logp)
        for i, draft in zip(active, proposed, strict=True):
            if draft.depth > ks[i]:
                raise RuntimeError(f"proposer drafted {draft.depth} deep, more than the {ks[i]} asked for")
            drafts[i] = self._within_context(seqs[i], draft)
        return drafts

    def _within_context(self, seq: SeqState, draft: Draft) -> Draft:
        """``draft`` cut to the verify rows the target's context has room for after the pending token.

        Depth is capped by the tokens a sequence may still generate, so a chain always fits; a tree
        has more nodes than depth, and each node takes a cache row until the rollback, so near the
        end of the context a tree keeps its first nodes (parents come first: still a tree). The cut
        depends on the context alone, so it is exact for deterministic candidates; a tree of sampled
        candidates cannot be cut (its siblings must stay i.i.d.) and is dropped instead."""
        room = self.max_context - seq.pending_position - 1
        if draft.size <= room:
            return draft
        return draft.prefix(room) if draft.probs is None and room > 0 else Draft.empty()

    def _tree_floor(self, contexts: list[int], nodes: int) -> float:
        """The path log-probability below which the policy will keep no tree node this step: its
        gain floor (:meth:`~verispec.policy.DepthPolicy.node_gain_floor`) through the drafter's
        calibration. Known before drafting, from costs and past steps only, so drafting less by it
        cannot bias the output."""
        floor = self.costs.policy.node_gain_floor(contexts, nodes)
        if floor <= 0.0:
            return -math.inf
        return math.log(floor / self.tree_calibration.factor)

    def _size_trees(self, seqs: list[SeqState], drafts: list[Draft]) -> list[Draft]:
        """Keep the best prefix of each scored tree that the depth policy finds worth verifying.

        The policy sees each node's calibrated acceptance probability as the gain of one more verify
        token, so a confident tree stays large and a doubtful one shrinks, as the batch's costs allow.
        Only the drafter's scores and past outcomes decide: exact, as the candidates are deterministic.
        """
        scored = {
            i: self.tree_calibration.gains(d.scores.tolist())
            for i, d in enumerate(drafts)
            if d.scores is not None and d.size
        }
        if not scored:
            return drafts
        queries = [
            DepthQuery(cap=len(scored.get(i, ())), survival=scored.get(i, ()), context=s.pending_position)
            for i, s in enumerate(seqs)
        ]
        budgets = self.costs.policy.choose(queries)
        return [
            d if i not in scored else d.prefix(budgets[i]) if budgets[i] > 0 else Draft.empty()
            for i, d in enumerate(drafts)
        ]


def _depth_query(seq: SeqState, cap: int, *, context: int, backlog: int) -> DepthQuery:
    """What the depth policy is told about ``seq`` (at a decode step, or at prefill about its first)."""
    return DepthQuery(
        cap=cap,
        survival=seq.acceptance.survival(cap),
        context=context,
        backlog=backlog,
        remaining=seq.budget - seq.num_generated,
    )
