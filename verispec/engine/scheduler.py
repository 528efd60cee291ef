"""Scheduling: who waits, who runs, and what each running sequence owns.

Continuous batching: requests wait in arrival order and join the running batch between steps
while it has fewer than ``max_batch_size`` sequences; a sequence leaves it when it finishes, fails
or is aborted, and its KV memory and proposer state are freed then. The queue behind a full batch
is bounded (``max_waiting``): a request beyond it is refused with a retry hint instead of waiting
without end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.config import SchedulerConfig
from verispec.detok import IncrementalDetokenizer
from verispec.engine.prefix_cache import DRAFT, PrefixCache
from verispec.engine.state import Request, SeqState
from verispec.errors import QueueFullError, VerispecError
from verispec.models.base import CausalLM
from verispec.penalties import RequestRules
from verispec.policy import AcceptanceEstimate, AcceptancePrior
from verispec.proposers.base import Proposer
from verispec.sampling import make_generator
from verispec.structured import Constraint


@dataclass(eq=False, repr=False)
class Scheduler:
    """The waiting queue and the running batch of one engine."""

    config: SchedulerConfig
    target: CausalLM
    tokenizer: Any | None
    proposer: Proposer | None
    prior: AcceptancePrior
    """The engine-wide acceptance each new sequence's estimate starts from."""
    constraint: Callable[[str], Constraint]
    """Compiles a request's grammar into a matcher for its sequence."""
    prefix: PrefixCache | None = None
    """Where sequences leave their keys and values when they end, for later requests of their scope
    (None: the target's reuse would not be exact, or the budget is 0)."""
    waiting: deque[SeqState] = field(default_factory=deque, init=False)
    running: list[SeqState] = field(default_factory=list, init=False)
    _by_id: dict[str, SeqState] = field(default_factory=dict, init=False)

    def add(self, request: Request) -> None:
        """Queue a request; raises :class:`QueueFullError` when ``max_waiting`` requests already wait
        behind a full batch.

        Requests that the next step will admit into free batch slots do not count: a burst that
        fits in the batch is never refused because it arrived between two steps.
        """
        if request.request_id in self._by_id:
            raise VerispecError(f"request id {request.request_id!r} is already in use")
        behind = self._behind_full_batch()
        if behind >= self.config.max_waiting:
            raise QueueFullError(
                f"{behind} requests are waiting behind a full batch (the limit); retry shortly",
                self.retry_after(),
            )
        seq = self._sequence(request)
        self.waiting.append(seq)
        self._by_id[request.request_id] = seq

    def add_all(self, requests: Sequence[Request]) -> None:
        """Queue several requests (the choices of one API request) all or none: refused together
        where the last would not fit behind a full batch, so no choice runs for an answer that
        cannot be given."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise VerispecError(f"request ids must differ, got {ids}")
        behind = self._behind_full_batch()
        if len(requests) > 1 and behind + len(requests) - 1 >= self.config.max_waiting:
            raise QueueFullError(
                f"{len(requests)} sequences would wait behind a full batch, over the limit of "
                f"{self.config.max_waiting}; retry shortly or ask for fewer choices",
                self.retry_after(),
            )
        for request in requests:
            self.add(request)

    def admit(self) -> None:
        """Move waiting sequences into free batch slots, each with its proposer state started."""
        while self.waiting and len(self.running) < self.config.max_batch_size:
            seq = self.waiting.popleft()
            if self.proposer is not None:
                seq.proposer_state = self.proposer.new_state(seq.request.prompt_ids, seq.request.sampling)
                self.proposer.set_scope(seq.proposer_state, seq.request.cache_scope)
                if seq.rules is not None:
                    self.proposer.constrain(seq.proposer_state, seq.rules)
            self.running.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request (its client went away); frees its cache. False if it is not here."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        return True

    def release(self, seq: SeqState, *, keep: bool = True) -> None:
        """Take a finished, failed or aborted sequence out of the batch and free what it holds;
        with ``keep`` (not after a failure, which may have left its cache half-written) its keys and
        values go to the prefix cache first."""
        if keep:
            self.keep_prefix(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._by_id.pop(seq.request.request_id, None)
        if self.proposer is not None and seq.proposer_state is not None:
            self.proposer.release(seq.proposer_state)
            seq.proposer_state = None
        seq.cache = self.target.new_cache()  # drop the KV memory now, not when the caller lets go

    def keep_prefix(self, seq: SeqState) -> None:
        """Store ``seq``'s cached positions in the prefix cache, where it has one and a scope, and
        the proposer's own (a draft model's) where it has positions exact to reuse."""
        scope = seq.request.cache_scope
        if self.prefix is None or scope is None or not seq.reuse_checked:
            return
        hidden = None
        if seq.hidden_rows is not None:  # the engine keeps hidden rows: blocks need theirs
            if not seq.hidden_rows:
                return
            hidden = torch.cat(seq.hidden_rows)
        self.prefix.keep(scope, seq.token_ids, seq.cache, hidden)
        if self.proposer is not None and seq.proposer_state is not None:
            own = self.proposer.prefix_kv(seq.proposer_state)
            if own is not None:
                self.prefix.keep(scope, seq.token_ids, own, part=DRAFT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about the time for one running request to finish."""
        return max(1, min(60, len(self.waiting) // max(1, self.config.max_batch_size) + 1))

    def _behind_full_batch(self) -> int:
        """Waiting requests beyond those the next step admits into free batch slots (negative while
        slots are free)."""
        return len(self.waiting) - max(0, self.config.max_batch_size - len(self.running))

    def _sequence(self, request: Request) -> SeqState:
        """A new sequence for ``request``: an empty cache, its own random stream, its rules."""
        prompt = request.prompt_ids
        seq = SeqState(
            request=request,
            token_ids=list(prompt),
            cache=self.target.new_cache(),
            generator=make_generator(request.sampling.seed, self.target.device),
            detok=IncrementalDetokenizer(self.tokenizer, prompt, request.stop) if self.tokenizer else None,
            budget=min(request.max_new_tokens, self.target.max_context - len(prompt)),
            acceptance=AcceptanceEstimate(self.prior),
            admitted_at=time.perf_counter(),
        )
        if request.grammar is not None or request.penalties is not None:
            constraint = self.constraint(request.grammar) if request.grammar is not None else None
            seq.rules = RequestRules(request.penalties, constraint, len(prompt))
        seq.stats.prompt_tokens = len(prompt)
        return seq
