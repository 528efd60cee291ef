"""One engine step over the running batch: prefill, then decode.

- **prefill**: each new sequence first takes the longest prefix of its prompt that the prefix cache
  holds for its scope (:mod:`verispec.engine.prefix_cache`), then feeds the rest of its prompt
  tokens but the last, in chunks within a per-step token budget (a draft model is fed them too
  where the depth policy expects to use it), one sequence a step on CPU, first come first. Where
  rows are position-invariant and nothing needs what only a prefill hands on
  (:meth:`Step._tail_joins_decode`), the last chunk rides in the step's decode forward instead,
  before the pending token, beside the other sequences' rows (rows are packed, not padded: see
  :class:`~verispec.models.kv.RowBatch`): the first token costs one pass over the weights, not two;
- **decode** (:meth:`Step.decode`): propose -> verify -> commit or roll back -> stats. The
  proposer drafts for every sequence (:mod:`verispec.engine.drafting`); one batched target forward
  scores every row's ``[pending, d_1 .. d_N]`` (a tree's nodes under a tree mask); each row is
  verified on its own by the engine's one verifier (:mod:`verispec.verify.verifier`), its cache
  rolled back to the accepted path, and its tokens committed.

Invariant of a sequence between steps: its target cache holds every committed token but the last,
which is fed at the next step with that step's drafts. Plain decoding is a step with an empty draft
through the same path, so comparisons are fair and a batch of plain and speculating sequences
mixes freely. A row's result never depends on the other rows (see :mod:`verispec.models.attention`),
so greedy output is the same alone or in a batch, speculating or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from verispec.costs import synchronize
from verispec.engine.commit import commit_tokens, token_logprobs
from verispec.engine.drafting import Drafting
from verispec.engine.hooks import HiddenTap, StepCosts
from verispec.engine.prefix_cache import DRAFT
from verispec.engine.scheduler import Scheduler
from verispec.engine.state import RequestOutput, SeqState, StepReport
from verispec.errors import VerispecError
from verispec.models.base import BatchOutput, CausalLM
from verispec.proposers.base import Proposer
from verispec.types import Draft, VerifyResult
from verispec.verify import Verifier
from verispec.verify.tree import tree_attention_inputs

_log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Step:
    """Runs prefill and decode for one engine's running batch, over the engine's parts."""

    target: CausalLM
    proposer: Proposer | None
    verify: Verifier
    drafting: Drafting
    scheduler: Scheduler
    costs: StepCosts
    tap: HiddenTap
    observers: list[Callable[[StepReport], Any]]
    """The engine's step observers, the list itself: observers added later are called too."""

    def run(self) -> list[RequestOutput]:
        """Prefill the next chunks, then decode every prefilled sequence once."""
        outputs = self.prefill()
        ready = [s for s in self.scheduler.running if s.prefilled or s.tail_in_decode]
        if ready:
            outputs += self.guarded(ready, self.decode)
        return outputs

    def decode(self, seqs: list[SeqState]) -> list[RequestOutput]:
        """propose -> verify -> commit or roll back -> stats, every sequence of the batch together."""
        if self.proposer is not None:
            _ = self.costs.policy  # built (costs measured or loaded) outside the step's timings
        started = time.perf_counter()
        drafts = self.drafting.propose(seqs)
        synchronize(self.target)  # on a GPU, the times below are of the work, not of its launches
        proposed = time.perf_counter()
        rows = VerifyRows.of(seqs, drafts)
        scored = self._score(seqs, rows, drafts)
        synchronize(self.target)
        forwarded = time.perf_counter()
        outputs, results = [], []
        for b, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            logits = scored.logits[b]  # [N + 1, V]: after the pending token, then after each node
            result = self.verify(draft, _judged(seq, draft, logits), seq.request.sampling, seq.generator)
            seq.cache.rollback(rows.starts[b], result.kept_rows)
            self.drafting.observe(seq, draft, result)
            hidden = None
            if scored.hidden is not None:  # [tail + N + 1, (1 + F) H]
                tail = rows.starts[b] - rows.cached[b]
                if tail:  # what the prefill of the tail would have handed on
                    self._prefilled_hidden(seq, scored.hidden[b][:tail])
                hidden = scored.hidden[b][tail:][result.kept_rows]
            outputs.append(self._commit(seq, result, logits[result.kept_rows], hidden))
            results.append(result)
            if seq.tail_in_decode and not outputs[-1].finished:  # its prompt is there for requests
                self.scheduler.keep_prefix(seq)  # that start alike, while it runs
        self._record(seqs, drafts, results, rows, (started, proposed, forwarded))
        for seq in seqs:
            seq.tail_in_decode = False
        return outputs

    def prefill(self) -> list[RequestOutput]:
        """Take what the prefix cache holds of new sequences' prompts, then feed the next prompt
        chunk of sequences still prefilling, within the step's token budget, in one batched
        forward. A chunk ends at the next multiple of ``prefill_chunk``, so how a prompt is split
        depends on its length alone, never on what else is running. At most
        :meth:`_prefill_sequences` sequences take a chunk in a step, in arrival order."""
        failed: list[RequestOutput] = []  # a sequence whose reuse fails ends with its error
        for seq in [s for s in self.scheduler.running if not s.reuse_checked]:
            failed += self.guarded([seq], self._reuse)
        chunk = self.scheduler.config.prefill_chunk
        budget, places = chunk, self._prefill_sequences()
        seqs, rows = [], []
        for seq in self.scheduler.running:
            if seq.prefilled:
                continue
            if budget <= 0 or places <= 0:
                break
            places -= 1
            start = seq.cache.length
            end = min(seq.pending_position, (start // chunk + 1) * chunk)
            budget -= end - start
            if end == seq.pending_position and self._tail_joins_decode(seq):
                seq.tail_in_decode = True
                continue
            seqs.append(seq)
            rows.append(seq.token_ids[start:end])
        if not seqs:
            return failed
        return failed + self.guarded(seqs, lambda seqs: self._prefill_chunks(seqs, rows))

    def _prefill_sequences(self) -> int:
        """How many sequences may take a prompt chunk in this step (``prefill_sequences``; by default
        one on CPU, where batching prompts saves no time and makes the first wait for the last)."""
        limit = self.scheduler.config.prefill_sequences
        if limit is not None:
            return limit
        return 1 if self.target.device.type == "cpu" else len(self.scheduler.running)

    def _tail_joins_decode(self, seq: SeqState) -> bool:
        """Whether ``seq``'s last prompt chunk can be fed in the decode forward, before its pending
        token: only where that gives its positions the very bits a prefill would (position-invariant
        rows) and nothing needs what a prefill hands on that the decode forward does not (the prompt
        fed to a draft model, which it would have to catch up on, the prompt's log-probabilities).
        The tail's hidden rows come out of the decode forward as they would out of a prefill; a
        proposer that drafts from them sits that step out (:meth:`Drafting.awaits_features`)."""
        proposer = self.proposer
        return (
            getattr(self.target, "position_invariant", False)
            and (proposer is None or not proposer.backlog(seq.proposer_state, seq.token_ids))
            and seq.request.prompt_logprobs is None
        )

    def guarded(
        self, seqs: list[SeqState], work: Callable[[list[SeqState]], list[RequestOutput]]
    ) -> list[RequestOutput]:
        """Run ``work(seqs)``; if it fails, end those requests with the error and keep serving."""
        try:
            return work(seqs)
        except Exception as exc:
            if not isinstance(exc, VerispecError):  # a bug, not bad input: keep its traceback
                _log.exception("a step failed for requests %s", [s.request.request_id for s in seqs])
            message = str(exc) if isinstance(exc, VerispecError) else f"internal error: {exc!r}"
            for seq in seqs:
                self.scheduler.release(seq, keep=False)
            return [RequestOutput(s.request.request_id, finished=True, error=message) for s in seqs]

    def _reuse(self, seqs: list[SeqState]) -> list[RequestOutput]:
        """Before a sequence's first chunk: take the longest prefix of its prompt that the prefix
        cache holds for its scope, and give the proposer and the tap what the prefill of those
        tokens would have given them (their hidden rows, then the proposer's own cached positions
        where the cache holds them: a draft model's, fed the rest of the tokens, or an EAGLE
        drafter's pairs)."""
        (seq,) = seqs
        seq.reuse_checked = True
        prefix, scope = self.scheduler.prefix, seq.request.cache_scope
        if prefix is None or scope is None:
            return []
        if self._needs_hidden:
            seq.hidden_rows = []
        if seq.request.prompt_logprobs is not None:  # its prompt's logits must be computed
            return []
        reused = prefix.reuse(
            scope, seq.token_ids, seq.cache, limit=seq.pending_position, with_hidden=self._needs_hidden
        )
        if not reused.tokens:
            return []
        seq.stats.cached_prompt_tokens = reused.tokens
        if reused.hidden is not None and seq.hidden_rows is not None:
            seq.hidden_rows.append(reused.hidden)
            self.tap.prefilled(seq, reused.hidden)
            if self.proposer is not None and self.proposer.needs_hidden:
                self.proposer.prefill(seq.proposer_state, reused.hidden)
        if self.proposer is not None and self.drafting.feeds_draft(seq):
            own = self.proposer.prefix_kv(seq.proposer_state)
            fed = 0
            if own is not None:
                fed = prefix.reuse(scope, seq.token_ids, own, limit=reused.tokens, part=DRAFT).tokens
            chunk = self.scheduler.config.prefill_chunk
            for start in range(fed, reused.tokens, chunk):
                end = min(start + chunk, reused.tokens)
                self.proposer.prefill_tokens([seq.proposer_state], [seq.token_ids[start:end]])
        return []

    def _prefill_chunks(self, seqs: list[SeqState], rows: list[list[int]]) -> list[RequestOutput]:
        scored = [s.request.prompt_logprobs is not None for s in seqs]
        starts = [s.cache.length for s in seqs]
        out = self.target.forward_batch(
            [s.cache for s in seqs],
            rows,
            logits_to_keep=[len(r) if want else 0 for r, want in zip(rows, scored, strict=True)],
            hidden_to_keep=[len(r) for r in rows] if self._needs_hidden else None,
            feature_layers=self._feature_layers,
            raw_features=self._raw_features,
        )
        for seq, start, row, logits, want in zip(seqs, starts, rows, out.logits, scored, strict=True):
            if want:  # the chunk's logits score the prompt's next tokens
                nexts = seq.token_ids[start + 1 : start + 1 + len(row)]
                seq.prompt_scores += token_logprobs(logits, nexts, int(seq.request.prompt_logprobs or 0))
        if out.hidden is not None:
            for seq, hidden in zip(seqs, out.hidden, strict=True):
                self._prefilled_hidden(seq, hidden)
        speculating = [b for b, s in enumerate(seqs) if self.drafting.feeds_draft(s)]
        if self.proposer is not None and speculating:
            states = [seqs[b].proposer_state for b in speculating]
            self.proposer.prefill_tokens(states, [rows[b] for b in speculating])
        for seq in seqs:
            if seq.prefilled:  # its prompt is there for requests that start alike, while it runs
                self.scheduler.keep_prefix(seq)
        return []

    def _prefilled_hidden(self, seq: SeqState, hidden: torch.Tensor) -> None:
        """Hand on the hidden rows of prompt tokens just fed: to the rows the prefix cache keeps,
        the tap and a proposer that drafts from them."""
        if seq.hidden_rows is not None:
            seq.hidden_rows.append(hidden)
        self.tap.prefilled(seq, hidden)
        if self.proposer is not None and self.proposer.needs_hidden:
            self.proposer.prefill(seq.proposer_state, hidden)

    def _score(self, seqs: list[SeqState], rows: VerifyRows, drafts: list[Draft]) -> BatchOutput:
        """The target's one forward over every sequence's prompt tail (where it rides along),
        pending token and draft; hidden rows, where needed, for all of them."""
        return self.target.forward_batch(
            [s.cache for s in seqs],
            rows.tokens,
            logits_to_keep=[d.size + 1 for d in drafts],
            hidden_to_keep=[len(r) for r in rows.tokens] if self._needs_hidden else None,
            feature_layers=self._feature_layers,
            raw_features=self._raw_features,
            positions=rows.positions,
            tree_masks=rows.masks,
        )

    def _commit(
        self,
        seq: SeqState,
        result: VerifyResult,
        logits: torch.Tensor,  # [kept, V]: the raw target's rows that gave the committed tokens
        hidden: torch.Tensor | None,  # [kept, (1 + F) H] on the same rows, where anyone needs them
    ) -> RequestOutput:
        """Commit one sequence's tokens; then free it if it finished, else tell the proposer what
        was kept; and hand the tap the hidden states of the tokens fed."""
        wanted = seq.request.logprobs
        scored = None if wanted is None else token_logprobs(logits, result.tokens, wanted)
        before = len(seq.token_ids)
        if hidden is not None and seq.hidden_rows is not None:
            seq.hidden_rows.append(hidden)
        output = commit_tokens(seq, result.tokens, result.num_accepted, self.target.eos_token_ids, scored)
        if self.proposer is not None and seq.proposer_state is not None:
            # a finishing sequence too: a draft model's cache is trimmed to the accepted tokens, so
            # the prefix cache can keep its positions of the reply for the next turn
            self.proposer.update(seq.proposer_state, seq.token_ids, result.num_accepted, hidden)
        if output.finished:
            self.scheduler.release(seq)
        if hidden is not None:
            self.tap.committed(seq, hidden, logits, len(seq.token_ids) - before)
        return output

    def _record(
        self,
        seqs: list[SeqState],
        drafts: list[Draft],
        results: list[VerifyResult],
        rows: VerifyRows,
        times: tuple[float, float, float],
    ) -> None:
        """The step's stats: timings per sequence, the cost model's correction, the step observers."""
        started, proposed, forwarded = times
        self.drafting.observe_step(seqs, drafts)
        done = time.perf_counter()
        for seq in seqs:
            seq.stats.draft_seconds += proposed - started
            seq.stats.verify_seconds += done - proposed
        depths = [d.depth for d in drafts]
        draft_s, target_s = proposed - started, forwarded - proposed
        if rows.cached == rows.starts:  # a forward that also fed prompt tails is no verify step's cost
            self.costs.observe(depths, draft_s, target_s, sum(len(r) for r in rows.tokens), rows.key_queries)
        accepted = [r.num_accepted for r in results]
        report = StepReport(len(seqs), depths, accepted, draft_s, target_s, len(self.scheduler.waiting))
        for observer in self.observers:
            observer(report)

    @property
    def _needs_hidden(self) -> bool:
        return self.tap.observer is not None or (self.proposer is not None and self.proposer.needs_hidden)

    @property
    def _feature_layers(self) -> tuple[int, ...]:
        return self.proposer.feature_layers if self.proposer is not None else ()

    @property
    def _raw_features(self) -> bool:
        return self.proposer.raw_features if self.proposer is not None else False


@dataclass(frozen=True)
class VerifyRows:
    """The target's input for a decode step: per sequence its pending token and draft tokens."""

    starts: list[int]
    """Each sequence's pending token's position (its cache length after the prompt's tail)."""
    tokens: list[list[int]]
    """Per sequence: the rest of its prompt where it rides in this forward, the pending token, the
    draft's tokens."""
    positions: list[list[int]] | None
    """Per row (trees only): the prompt tail's positions, the pending token's, then each node's
    (its parent's + 1)."""
    masks: list[torch.Tensor | None] | None
    """Per row (trees only): which of the row's tokens each may attend to; None for a chain."""
    cached: list[int]
    """Each sequence's cache length before the forward."""

    @classmethod
    def of(cls, seqs: list[SeqState], drafts: list[Draft]) -> VerifyRows:
        cached = [s.cache.length for s in seqs]
        starts = [s.pending_position for s in seqs]
        tokens, positions, masks = [], [], []
        for seq, draft, start, held in zip(seqs, drafts, starts, cached, strict=True):
            tokens.append(seq.token_ids[held:] + draft.tokens.tolist())  # the pending token is the root
            pos, mask = tree_attention_inputs(draft, start)
            if held < start:
                pos = list(range(held, start)) + pos
                mask = None if mask is None else _after_tail(mask, start - held)
            positions.append(pos)
            masks.append(mask)
        if all(m is None for m in masks):  # only chains: the model's causal path
            return cls(starts, tokens, None, None, cached)
        return cls(starts, tokens, positions, masks, cached)

    @property
    def key_queries(self) -> int:
        """Query tokens times the cached keys each attends to, summed: what the context adds to the cost."""
        return sum(len(r) * held for r, held in zip(self.tokens, self.cached, strict=True))


def _after_tail(mask: torch.Tensor, tail: int) -> torch.Tensor:
    """A tree's mask ``[n, n]`` behind ``tail`` prompt tokens in the same row: they attend
    causally among themselves, and every node attends to all of them and to its own ancestors."""
    n = mask.shape[0]
    out = torch.zeros(tail + n, tail + n, dtype=torch.bool)
    out[:tail, :tail] = torch.ones(tail, tail, dtype=torch.bool).tril()
    out[tail:, :tail] = True
    out[tail:, tail:] = mask
    return out


def _judged(seq: SeqState, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
    """The target's rows as the verifier must judge them: with the request's penalties and grammar,
    each row for the context it was computed in (the committed tokens plus the draft tokens before
    it: :meth:`Draft.row_paths <verispec.types.Draft.row_paths>`)."""
    if seq.rules is None:
        return logits
    return seq.rules.rows(logits, seq.token_ids, draft.row_paths())
