"""The engine: many sequences decoding together, each speculating as deep as the policy says.

One :meth:`SpecEngine.step`:

1. admit waiting requests while fewer than ``max_batch_size`` are running (continuous batching:
   sequences join and leave between steps);
2. prefill: each new sequence feeds all its prompt tokens but the last, in chunks whose boundaries
   depend on the prompt alone, within a per-step token budget (a draft model is fed them too where
   the depth policy expects to use it);
3. decode: the depth policy picks k per sequence from what is known before verification; the
   proposer drafts for every sequence (one batched pass for a draft model); one batched target
   forward scores every row's ``[pending, d_1 .. d_k]``; each row is verified on its own, its cache
   trimmed back to the accepted prefix, and its tokens emitted.

Invariant of a sequence between steps: its target cache holds every committed token but the last,
which is fed at the next step with that step's drafts. Plain decoding is a step with k = 0 through
the same path, so comparisons are fair and a batch of plain and speculating sequences mixes freely.
A row's result never depends on the other rows (see :mod:`verispec.models.attention`), so greedy
output is the same alone or in a batch, speculating or not.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any, Protocol

import torch

from verispec.config import MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS, SamplingConfig, SchedulerConfig, SpecConfig
from verispec.costs import StepCostModel, load_or_measure
from verispec.detok import IncrementalDetokenizer, token_bytes_table
from verispec.errors import QueueFullError, VerispecError
from verispec.fim import FimPrompt, fim_prompt
from verispec.metrics import SpecStats
from verispec.models.base import CausalLM, KVCache
from verispec.penalties import Penalties, RequestRules, chain_paths, tree_paths
from verispec.policy import (
    AcceptanceEstimate,
    AcceptancePrior,
    DepthPolicy,
    DepthQuery,
    TreeCalibration,
    make_policy,
)
from verispec.proposers.base import Proposer
from verispec.sampling import make_generator
from verispec.structured import Constraint, Structured, ll_tokenizer
from verispec.types import Draft, FinishReason, Generation, TokenEvent
from verispec.verify import typical, verify
from verispec.verify.tree import DraftTree, tree_attention_inputs, verify_tree

Prompt = str | Seq[int]
_ids = count()
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]
"""A token's log-probability and the most likely tokens at its position, (id, log-probability)."""


@dataclass(frozen=True)
class Request:
    """One generation request, validated (see :meth:`SpecEngine.make_request`)."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int = 0
    """Most draft tokens per step for this request; 0 turns speculation off for it."""
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    logprobs: int | None = None
    """None: no log-probabilities; n: each token's, with the n most likely tokens at its position."""
    prompt_logprobs: int | None = None
    """The same for the prompt's tokens (scoring a text, as ``echo`` with ``logprobs`` asks)."""
    penalties: Penalties | None = None
    """Logit bias and repetition penalties, applied to each verified row for its own context."""
    grammar: str | None = None
    """llguidance grammar the output must match (:mod:`verispec.structured`), masked the same way."""
    stop_token_ids: frozenset[int] = frozenset()
    """Tokens that end the output as EOS does (finish reason ``stop``)."""


@dataclass
class SeqState:
    """Everything that belongs to one running sequence."""

    request: Request
    token_ids: list[int]  # committed tokens, prompt included
    cache: KVCache
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    budget: int  # tokens it may generate
    acceptance: AcceptanceEstimate
    admitted_at: float
    proposer_state: Any = None
    stats: SpecStats = field(default_factory=SpecStats)
    steps: int = 0
    feeds_draft: bool | None = None
    """Whether its prompt chunks are fed to the draft model as the target prefills them; decided
    at its first chunk (see :meth:`SpecEngine._draft_prefill_pays`)."""
    rules: RequestRules | None = None
    """With penalties or a grammar: them, the grammar's matcher following this sequence's output."""
    prompt_scores: list[TokenLogprobs] = field(default_factory=list)
    """With ``prompt_logprobs``: the prompt's tokens after the first, scored as prefill goes."""

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prefilled(self) -> bool:
        return self.cache.length >= len(self.token_ids) - 1


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, or an error that ended it."""

    request_id: str
    events: list[TokenEvent] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """On a request's first output, where it asked for them: one entry per prompt token, the first
    None (nothing predicts it)."""


class HiddenObserver(Protocol):
    """Receives the target's last-layer hidden state after every token of a request, in order."""

    def prefilled(self, request_id: str, hidden: torch.Tensor) -> None:
        """``hidden [n, H]``: after the next n prompt tokens (the prompt's last token comes later,
        as the first decode step's pending token)."""

    def committed(self, request_id: str, hidden: torch.Tensor, greedy: torch.Tensor) -> None:
        """``hidden [n, H]``: after a decode step's pending token and after each token it appended
        that was fed (the last token of a reply never is); ``greedy [n]``: the unadjusted target's
        argmax there."""


@dataclass(frozen=True)
class StepReport:
    """One decode step, for metrics: batch size, per-sequence depth and outcome, and timings."""

    batch_size: int
    drafted: list[int]
    accepted: list[int]
    draft_seconds: float
    target_seconds: float
    waiting: int


class SpecEngine:
    """Speculative decoding of a batch of sequences over a target model and an optional proposer.

    Synchronous and single-threaded: :meth:`add` and :meth:`step` drive it (the server runs
    :meth:`step` in a loop on its own thread); :meth:`generate`, :meth:`stream` and
    :meth:`generate_batch` are conveniences over them.
    """

    def __init__(
        self,
        target: CausalLM,
        proposer: Proposer | None,
        spec: SpecConfig,
        tokenizer: Any | None = None,
        draft: CausalLM | None = None,
        scheduler: SchedulerConfig | None = None,
        costs: StepCostModel | None = None,
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.spec = spec
        self.tokenizer = tokenizer
        self.draft = draft
        self.scheduler = scheduler or SchedulerConfig()
        self._costs = costs
        self._policy: DepthPolicy | None = None
        self.prior = AcceptancePrior()
        self.tree_calibration = TreeCalibration()
        """How far the proposer's tree scores are from what verification accepts (trees only)."""
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self._by_id: dict[str, SeqState] = {}
        self.step_observers: list[Any] = []
        """Callables given every :class:`StepReport` (the server's metrics)."""
        self.hidden_observer: HiddenObserver | None = None
        """Given the target's last hidden state after every token it is fed (see
        :class:`HiddenObserver`): ``verispec distill --keep-hidden`` keeps them as training data, so
        the heads' hidden-state store needs no second pass of the target over the replies."""
        self._token_bytes: list[bytes] | None = None
        self._grammar_tokenizer: Any = None

    # ----------------------------------------------------------------- requests

    def make_request(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Seq[str] = (),
        stop_token_ids: Seq[int] = (),
        num_speculative_tokens: int | None = None,
        request_id: str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        structured: Structured | None = None,
    ) -> Request:
        """Validate a request; raises :class:`VerispecError` with a message fit for the user.

        ``num_speculative_tokens``: None takes the engine's k, 0 turns speculation off, and a value
        above the engine's k is cut to it. ``logprobs``: None for none, else each token's
        log-probability under the target plus that many (<= :data:`MAX_LOGPROBS`) most likely
        tokens (``TokenEvent.logprob`` and ``top_logprobs``); ``prompt_logprobs`` the same for the
        prompt's tokens (``RequestOutput.prompt_logprobs``, ``Generation.prompt_logprobs``).
        Penalties and ``logit_bias`` (token id -> value added to its logit) follow vLLM's rules
        (:mod:`verispec.penalties`); log-probabilities stay the target's raw ones, as vLLM's default.
        ``structured`` constrains the output to a JSON schema, regex, choice or Lark grammar
        (:mod:`verispec.structured`); the grammar is compiled here, so a bad one is refused here.
        ``stop_token_ids`` end the output like EOS does (kept in ``token_ids``, finish reason
        ``stop``), as vLLM's.
        """
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise VerispecError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        penalties = Penalties(
            presence_penalty, frequency_penalty, repetition_penalty, tuple((logit_bias or {}).items())
        )
        penalties.check_vocab(self.target.vocab_size)
        grammar = None
        if structured is not None:
            grammar = structured.grammar()
            self._constraint(grammar)  # compiles it: errors now, not once queued
        if max_new_tokens < 1:
            raise VerispecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) >= self.target.max_context:
            raise VerispecError(
                f"the prompt has {len(prompt_ids)} tokens but {self.target.name} has a context of "
                f"{self.target.max_context}; shorten the prompt"
            )
        if stop and self.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer; this model folder has none")
        bad = [t for t in stop_token_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise VerispecError(f"stop_token_ids out of range [0, {self.target.vocab_size}): {bad[:5]}")
        k = self.spec.num_speculative_tokens
        if num_speculative_tokens is not None:
            if not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                raise VerispecError(
                    f"num_speculative_tokens must be between 0 (no speculation) and "
                    f"{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens}"
                )
            k = min(k, num_speculative_tokens)
        if self.proposer is None:
            k = 0
        extra = {"request_id": request_id} if request_id is not None else {}
        return Request(
            prompt_ids,
            sampling,
            max_new_tokens,
            tuple(stop),
            k,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            penalties=penalties if penalties.active else None,
            grammar=grammar,
            stop_token_ids=frozenset(stop_token_ids),
            **extra,
        )

    def add(self, request: Request) -> None:
        """Queue a request; raises :class:`QueueFullError` when ``max_waiting`` requests already wait
        behind a full batch.

        Requests that the next step will admit into free batch slots do not count: a burst that
        fits in the batch is never refused because it arrived between two steps.
        """
        if request.request_id in self._by_id:
            raise VerispecError(f"request id {request.request_id!r} is already in use")
        behind = self._behind_full_batch()
        if behind >= self.scheduler.max_waiting:
            raise QueueFullError(
                f"{behind} requests are waiting behind a full batch (the limit); retry shortly",
                self.retry_after(),
            )
        seq = SeqState(
            request=request,
            token_ids=list(request.prompt_ids),
            cache=self.target.new_cache(),
            generator=make_generator(request.sampling.seed, self.target.device),
            detok=IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.stop)
            if self.tokenizer
            else None,
            budget=min(request.max_new_tokens, self.target.max_context - len(request.prompt_ids)),
            acceptance=AcceptanceEstimate(self.prior),
            admitted_at=time.perf_counter(),
        )
        if request.grammar is not None or request.penalties is not None:
            constraint = self._constraint(request.grammar) if request.grammar is not None else None
            seq.rules = RequestRules(request.penalties, constraint, len(request.prompt_ids))
        seq.stats.prompt_tokens = len(request.prompt_ids)
        self.waiting.append(seq)
        self._by_id[request.request_id] = seq

    def add_all(self, requests: Seq[Request]) -> None:
        """Queue several requests (the choices of one API request) all or none: refused together
        where the last would not fit behind a full batch, so no choice runs for an answer that
        cannot be given."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise VerispecError(f"request ids must differ, got {ids}")
        behind = self._behind_full_batch()
        if len(requests) > 1 and behind + len(requests) - 1 >= self.scheduler.max_waiting:
            raise QueueFullError(
                f"{len(requests)} sequences would wait behind a full batch, over the limit of "
                f"{self.scheduler.max_waiting}; retry shortly or ask for fewer choices",
                self.retry_after(),
            )
        for request in requests:
            self.add(request)

    def _behind_full_batch(self) -> int:
        """Waiting requests beyond those the next step admits into free batch slots (negative while
        slots are free)."""
        return len(self.waiting) - max(0, self.scheduler.max_batch_size - len(self.running))

    def abort(self, request_id: str) -> bool:
        """Drop a request (its client went away); frees its cache. False if it is not here."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about the time for one running request to finish."""
        return max(1, min(60, len(self.waiting) // max(1, self.scheduler.max_batch_size) + 1))

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Admit, prefill and decode once; returns what each touched request produced."""
        while self.waiting and len(self.running) < self.scheduler.max_batch_size:
            seq = self.waiting.popleft()
            if self.proposer is not None:
                seq.proposer_state = self.proposer.new_state(seq.request.prompt_ids, seq.request.sampling)
                if seq.rules is not None:
                    self.proposer.constrain(seq.proposer_state, seq.rules)
            self.running.append(seq)
        outputs: list[RequestOutput] = []
        self._prefill(outputs)
        ready = [s for s in self.running if s.prefilled]
        if ready:
            outputs.extend(self._guarded(ready, self._decode))
        return outputs

    def _prefill(self, outputs: list[RequestOutput]) -> None:
        """Feed the next prompt chunk of sequences still prefilling, within the step's token budget,
        in one batched forward. A chunk ends at the next multiple of ``prefill_chunk``, so how a
        prompt is split depends on its length alone, never on what else is running."""
        chunk = self.scheduler.prefill_chunk
        budget = chunk
        seqs, rows = [], []
        for seq in self.running:
            if seq.prefilled:
                continue
            if budget <= 0:
                break
            start = seq.cache.length
            end = min(len(seq.token_ids) - 1, (start // chunk + 1) * chunk)
            seqs.append(seq)
            rows.append(seq.token_ids[start:end])
            budget -= end - start
        if seqs:

            def run(seqs: list[SeqState]) -> list[RequestOutput]:
                scored = [s.request.prompt_logprobs is not None for s in seqs]
                starts = [s.cache.length for s in seqs]
                out = self.target.forward_batch(
                    [s.cache for s in seqs],
                    rows,
                    logits_to_keep=[len(r) if want else 0 for r, want in zip(rows, scored, strict=True)],
                    hidden_to_keep=[len(r) for r in rows] if self._needs_hidden else None,
                    feature_layers=self._feature_layers,
                )
                for seq, start, row, logits, want in zip(seqs, starts, rows, out.logits, scored, strict=True):
                    if want:  # the chunk's logits score the prompt's next tokens
                        nexts = seq.token_ids[start + 1 : start + 1 + len(row)]
                        seq.prompt_scores += _logprobs(logits, nexts, int(seq.request.prompt_logprobs or 0))
                if out.hidden is not None:
                    for seq, hidden in zip(seqs, out.hidden, strict=True):
                        if self.hidden_observer is not None:
                            self.hidden_observer.prefilled(seq.request.request_id, self._last_layer(hidden))
                        if self.proposer is not None and self.proposer.needs_hidden:
                            self.proposer.prefill(seq.proposer_state, hidden)
                speculating = [b for b, s in enumerate(seqs) if self._feeds_draft(s)]
                if self.proposer is not None and speculating:
                    self.proposer.prefill_tokens(
                        [seqs[b].proposer_state for b in speculating], [rows[b] for b in speculating]
                    )
                return []

            outputs.extend(self._guarded(seqs, run))

    def _feeds_draft(self, seq: SeqState) -> bool:
        if seq.feeds_draft is None:
            seq.feeds_draft = seq.request.num_speculative_tokens > 0 and self._draft_prefill_pays(seq)
        return seq.feeds_draft

    def _draft_prefill_pays(self, seq: SeqState) -> bool:
        """Feed the draft model the prompt only if the depth policy would start it at the first
        decode step with the whole prompt still to catch up on: the same price, paid now in the
        target's chunks (no stall of the other sequences), or never, where the request has too few
        tokens left to win it back (a long RAG prompt with a short answer). A sequence that skips it
        can still start later: the policy prices its backlog at every step."""
        if self.draft is None or self.spec.depth != "adaptive":
            return True
        cap = _speculation_cap(seq)
        if cap <= 0:
            return False
        query = _depth_query(seq, cap, context=len(seq.token_ids), backlog=len(seq.token_ids))
        return self.policy.choose([query])[0] > 0

    def _guarded(self, seqs: list[SeqState], work: Any) -> list[RequestOutput]:
        """Run ``work(seqs)``; if it fails, end those requests with the error and keep serving."""
        try:
            return work(seqs)
        except Exception as exc:
            message = str(exc) if isinstance(exc, VerispecError) else f"internal error: {exc!r}"
            for seq in seqs:
                self._release(seq)
            return [RequestOutput(s.request.request_id, finished=True, error=message) for s in seqs]

    def _decode(self, seqs: list[SeqState]) -> list[RequestOutput]:
        if self.proposer is not None:
            _ = self.policy  # built (costs measured or loaded) outside the step's timings
        t0 = time.perf_counter()
        ks = self._depths(seqs)
        drafts = self._size_trees(seqs, self._propose(seqs, ks))
        t1 = time.perf_counter()
        starts = [s.cache.length for s in seqs]
        rows, positions, masks = [], [], []
        for seq, draft, start in zip(seqs, drafts, starts, strict=True):
            pending = seq.token_ids[start:]
            rows.append(pending + draft.tokens.tolist())
            if isinstance(draft, DraftTree):  # the target's pending token is one token: the root
                pos, mask = tree_attention_inputs(draft, start)
                positions.append(pos)
                masks.append(mask)
            else:
                positions.append(list(range(start, start + len(rows[-1]))))
                masks.append(None)
        trees = any(m is not None for m in masks)
        out = self.target.forward_batch(
            [s.cache for s in seqs],
            rows,
            logits_to_keep=[_nodes(d) + 1 for d in drafts],
            return_hidden=self._needs_hidden,
            feature_layers=self._feature_layers,
            positions=positions if trees else None,
            tree_masks=masks if trees else None,
        )
        t2 = time.perf_counter()
        outputs, accepted = [], []
        lossy = self.spec.acceptance == "typical"  # Medusa's typical acceptance: LOSSY, opt-in only
        for b, (seq, draft, logits) in enumerate(zip(seqs, drafts, out.logits, strict=True)):
            judged = _adjusted(seq, draft, logits)
            if isinstance(draft, DraftTree):
                verify_tree_with = typical.verify_tree if lossy else verify_tree
                tree_result = verify_tree_with(draft, judged, seq.request.sampling, seq.generator)
                kept_rows = [0] + [i + 1 for i in tree_result.path]
                seq.cache.compact(starts[b], kept_rows)
                tokens, num_accepted, depth = tree_result.tokens, tree_result.num_accepted, _depth(draft)
                if draft.scores is not None:
                    self.tree_calibration.observe(float(draft.scores.exp().sum()), num_accepted)
            else:
                result = (typical.verify if lossy else verify)(
                    draft, judged, seq.request.sampling, seq.generator
                )
                seq.cache.trim(draft.k - result.num_accepted)
                tokens, num_accepted, depth = result.tokens, result.num_accepted, draft.k
                kept_rows = list(range(num_accepted + 1))
            seq.stats.observe(depth, num_accepted)
            if depth:
                seq.acceptance.observe(depth, num_accepted)
                self.prior.observe(depth, num_accepted)
            elif seq.request.num_speculative_tokens:
                seq.acceptance.relax()
            accepted.append(num_accepted)
            hidden = out.hidden[b][kept_rows] if out.hidden is not None else None
            wanted = seq.request.logprobs
            scored = None if wanted is None else _logprobs(logits[kept_rows], tokens, wanted)
            length = len(seq.token_ids)
            outputs.append(self._commit(seq, tokens, num_accepted, hidden, scored))
            if hidden is not None and self.hidden_observer is not None:
                # Rows after the pending token and after each token appended that was fed (a stop
                # can cut the step short; the last token appended was not fed unless it was a draft).
                fed = min(len(seq.token_ids) - length + 1, len(kept_rows))
                greedy = logits[kept_rows[:fed]].argmax(-1)  # the raw target's, as a store pass keeps
                self.hidden_observer.committed(seq.request.request_id, self._last_layer(hidden[:fed]), greedy)
        depths = [_depth(d) for d in drafts]
        if not any(depths) and any(s.request.num_speculative_tokens for s in seqs):
            self.prior.relax()  # nothing drafted this step, though speculation was wanted
        t3 = time.perf_counter()
        for seq in seqs:
            seq.stats.draft_seconds += t1 - t0
            seq.stats.verify_seconds += t3 - t1
        tokens = sum(len(r) for r in rows)
        key_queries = sum(len(r) * start for r, start in zip(rows, starts, strict=True))
        self._report(seqs, depths, accepted, t1 - t0, t2 - t1, tokens, key_queries)
        return outputs

    @property
    def _needs_hidden(self) -> bool:
        return self.hidden_observer is not None or (self.proposer is not None and self.proposer.needs_hidden)

    def _last_layer(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's state of hidden rows that may carry a proposer's feature layers too."""
        return hidden[..., : self.target.hidden_size]

    @property
    def _feature_layers(self) -> tuple[int, ...]:
        return self.proposer.feature_layers if self.proposer is not None else ()

    def _depths(self, seqs: list[SeqState]) -> list[int]:
        caps = [_speculation_cap(s) for s in seqs]
        if self.proposer is None or not any(caps):
            return [0] * len(seqs)
        proposer = self.proposer
        if proposer.drafts_trees:  # sized after drafting (_size_trees); only the batch cut-off applies here
            return [0] * len(seqs) if self.policy.disabled(len(seqs)) else caps
        queries = [
            _depth_query(
                s,
                c,
                context=s.cache.length,
                backlog=proposer.backlog(s.proposer_state, s.token_ids) if c else 0,
            )
            for s, c in zip(seqs, caps, strict=True)
        ]
        return self.policy.choose(queries)

    def _propose(self, seqs: list[SeqState], ks: list[int]) -> list[Draft | DraftTree]:
        drafts: list[Draft | DraftTree] = [Draft.empty()] * len(seqs)
        active = [i for i, k in enumerate(ks) if k > 0]
        if self.proposer is None or not active:
            return drafts
        states = [seqs[i].proposer_state for i in active]
        token_ids = [seqs[i].token_ids for i in active]
        if self.proposer.drafts_trees:
            min_logp = self._tree_floor([s.cache.length for s in seqs], self.proposer.max_tree_size(max(ks)))
            if min_logp >= 0.0:  # not even a certain node would be kept: drafting cannot pay
                return drafts
            proposed = self.proposer.propose_batch(
                states, token_ids, [ks[i] for i in active], min_logp=min_logp
            )
        else:
            proposed = self.proposer.propose_batch(states, token_ids, [ks[i] for i in active])
        for i, draft in zip(active, proposed, strict=True):
            if _depth(draft) > ks[i]:
                raise RuntimeError(f"proposer drafted {_depth(draft)} deep, more than the {ks[i]} asked for")
            drafts[i] = draft
        return drafts

    def _tree_floor(self, contexts: list[int], nodes: int) -> float:
        """The path log-probability below which the policy will keep no tree node this step: its
        gain floor (:meth:`~verispec.policy.DepthPolicy.node_gain_floor`) through the drafter's
        calibration. Known before drafting, from costs and past steps only, so drafting less by it
        cannot bias the output."""
        floor = self.policy.node_gain_floor(contexts, nodes)
        if floor <= 0.0:
            return -math.inf
        return math.log(floor / self.tree_calibration.factor)

    def _size_trees(self, seqs: list[SeqState], drafts: list[Draft | DraftTree]) -> list[Draft | DraftTree]:
        """Keep the best prefix of each scored tree that the depth policy finds worth verifying.

        The policy sees each node's calibrated acceptance probability as the gain of one more verify
        token, so a confident tree stays large and a doubtful one shrinks, as the batch's costs allow.
        Only the drafter's scores and past outcomes decide: exact, as the candidates are deterministic.
        """
        scored = {
            i: self.tree_calibration.gains(d.scores.tolist())
            for i, d in enumerate(drafts)
            if isinstance(d, DraftTree) and d.scores is not None and d.size
        }
        if not scored:
            return drafts
        queries = [
            DepthQuery(cap=len(scored.get(i, ())), survival=scored.get(i, ()), context=s.cache.length)
            for i, s in enumerate(seqs)
        ]
        budgets = self.policy.choose(queries)
        out = list(drafts)
        for i in scored:
            tree = drafts[i]
            assert isinstance(tree, DraftTree)
            out[i] = tree.prefix(budgets[i]) if budgets[i] > 0 else Draft.empty()
        return out

    def _commit(
        self,
        seq: SeqState,
        tokens: list[int],
        num_accepted: int,
        hidden: torch.Tensor | None,
        scored: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        """Append the step's tokens one at a time (EOS, a stop string or the length limit can cut the
        step short), emit their events (with ``scored``, their log-probabilities), and tell the
        proposer what was kept."""
        output = RequestOutput(seq.request.request_id)
        if seq.steps == 0 and seq.request.prompt_logprobs is not None:
            output.prompt_logprobs = [None, *seq.prompt_scores]
        eos_ids = self.target.eos_token_ids
        finish: FinishReason | None = None
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            seq.stats.num_output_tokens += 1
            text = seq.detok.add(token) if seq.detok else ""
            if token in eos_ids:
                finish = "eos"
            elif token in seq.request.stop_token_ids or (seq.detok and seq.detok.stopped):
                finish = "stop"
            elif seq.num_generated >= seq.budget:
                finish = "length"
            if finish is not None and seq.detok:
                text += seq.detok.flush()
            if finish is None and seq.rules is not None and seq.rules.constraint is not None:
                seq.rules.constraint.advance(token)
            seq.stats.total_seconds = time.perf_counter() - seq.admitted_at
            output.events.append(
                TokenEvent(
                    token_id=token,
                    text=text,
                    from_draft=i < num_accepted,
                    logprob=scored[i][0] if scored else None,
                    step=seq.steps,
                    finish_reason=finish,
                    stats=seq.stats if finish is not None else None,
                    top_logprobs=scored[i][1] if scored else (),
                )
            )
            if finish is not None:
                break
        seq.steps += 1
        if finish is not None:
            output.finished = True
            self._release(seq)
        elif self.proposer is not None and seq.proposer_state is not None:
            self.proposer.update(seq.proposer_state, seq.token_ids, num_accepted, hidden)
        return output

    def _release(self, seq: SeqState) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._by_id.pop(seq.request.request_id, None)
        if self.proposer is not None and seq.proposer_state is not None:
            self.proposer.release(seq.proposer_state)
            seq.proposer_state = None
        seq.cache = self.target.new_cache()  # drop the KV memory now, not when the caller lets go

    def _report(
        self,
        seqs: list[SeqState],
        drafted: list[int],
        accepted: list[int],
        draft_s: float,
        target_s: float,
        tokens: int,
        key_queries: int,
    ) -> None:
        if self._policy is not None and self._costs is not None:
            self._costs.observe_target(tokens, target_s, key_queries)
            levels = [sum(1 for k in drafted if k > j) for j in range(max(drafted, default=0))]
            if levels and self.draft is not None:
                self._costs.observe_draft(levels, draft_s)
        report = StepReport(len(seqs), drafted, accepted, draft_s, target_s, len(self.waiting))
        for observer in self.step_observers:
            observer(report)

    @property
    def policy(self) -> DepthPolicy:
        """The depth policy, built on first use (the adaptive one measures costs, or loads them)."""
        if self._policy is None:
            if self.spec.depth == "adaptive" and self._costs is None:
                from verispec.models.registry import cache_root

                self._costs = load_or_measure(self.target, self.draft, cache_root() / "costs")
            self._policy = make_policy(self.spec.depth, self._costs, self.spec.disable_by_batch_size)
        return self._policy

    @property
    def costs(self) -> StepCostModel | None:
        return self._costs

    # ----------------------------------------------------------------- conveniences

    def generate(self, prompt: Prompt, **kwargs: Any) -> Generation:
        """Generate to completion; see :meth:`make_request` for the arguments."""
        return self.generate_batch([prompt], **kwargs)[0]

    def generate_batch(
        self, prompts: Seq[Prompt], *, each: Seq[Mapping[str, Any]] | None = None, **kwargs: Any
    ) -> list[Generation]:
        """Generate for several prompts decoding together in batches: the same settings for each,
        except those ``each[i]`` gives prompt i (e.g. its own ``structured`` output)."""
        if each is not None and len(each) != len(prompts):
            raise VerispecError(f"each: {len(each)} settings for {len(prompts)} prompts")
        own = each if each is not None else [{}] * len(prompts)
        requests = [self.make_request(p, **{**kwargs, **mine}) for p, mine in zip(prompts, own, strict=True)]
        events: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
        scores: dict[str, list[TokenLogprobs | None] | None] = {}
        for out in self._drive(requests):
            events[out.request_id].extend(out.events)
            if out.prompt_logprobs is not None:
                scores[out.request_id] = out.prompt_logprobs
        return [_generation(r, events[r.request_id], scores.get(r.request_id)) for r in requests]

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[TokenEvent]:
        """Yield one :class:`TokenEvent` per generated token as soon as it is committed.

        Arguments as :meth:`make_request`. The last event carries the ``finish_reason`` and stats.
        """
        for out in self._drive([self.make_request(prompt, **kwargs)]):
            yield from out.events

    def _drive(self, requests: list[Request]) -> Iterator[RequestOutput]:
        """Run the step loop until ``requests`` finish; their outputs in order, errors raised."""
        pending = {r.request_id for r in requests}
        queued = list(requests)
        try:
            while pending:
                while queued and len(self.waiting) < self.scheduler.max_waiting:
                    self.add(queued.pop(0))
                for out in self.step():
                    if out.request_id not in pending:
                        continue
                    if out.error is not None:
                        raise VerispecError(out.error)
                    yield out
                    if out.finished:
                        pending.discard(out.request_id)
        finally:
            for request_id in pending:
                self.abort(request_id)

    def plain_engine(self) -> SpecEngine:
        """The same target without speculation, for fair side-by-side measurements."""
        return SpecEngine(
            self.target,
            None,
            replace(self.spec, method=None),
            tokenizer=self.tokenizer,
            scheduler=self.scheduler,
        )

    def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Generation:
        """Generate a reply to chat ``messages`` through the model's chat template."""
        return self.generate(self.apply_chat_template(messages), **kwargs)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, ready for the reply;
        ``tools`` (OpenAI's function definitions) are shown to the model where its template takes them."""
        tok = self._require_tokenizer("chat messages")
        template = getattr(tok, "chat_template", None)
        if not template:
            raise VerispecError(f"{self.target.name} has no chat template; send a plain prompt instead")
        if tools and "tools" not in template:
            raise VerispecError(f"{self.target.name}'s chat template does not take tools")
        ids = tok.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def fill_in_middle(self, prefix: str, suffix: str) -> FimPrompt:
        """The prompt ids asking the target for the text between ``prefix`` and ``suffix``, and the
        tokens that end it (pass them as ``stop_token_ids``; :mod:`verispec.fim`). Refused for a
        model not trained for it."""
        return fim_prompt(self._require_tokenizer("suffix"), prefix, suffix)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise VerispecError("the prompt is empty")
            return list(self._require_tokenizer("a text prompt").encode(prompt))
        ids = [int(i) for i in prompt]
        if not ids:
            raise VerispecError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.target.vocab_size]
        if bad:
            raise VerispecError(f"prompt token ids out of range [0, {self.target.vocab_size}): {bad[:5]}")
        return ids

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes (:func:`~verispec.detok.token_bytes_table`), built on the first
        call: make it on the thread that owns the tokenizer (fast tokenizers are not thread-safe);
        the list is never changed afterwards, so any thread may read it."""
        if self._token_bytes is None:
            if self.tokenizer is None:
                raise VerispecError(
                    f"logprobs need a tokenizer to name the tokens, and {self.target.name} has none"
                )
            self._token_bytes = token_bytes_table(self.tokenizer)
        return self._token_bytes

    def _constraint(self, grammar: str) -> Constraint:
        """A matcher for ``grammar`` over this target's vocabulary (llguidance's tokenizer view is
        built on first use, ~1.5 s for Qwen's 151,936 ids, on the engine thread)."""
        if self._grammar_tokenizer is None:
            tok = self._require_tokenizer("structured output")
            self._grammar_tokenizer = ll_tokenizer(tok, self.target.vocab_size, self.target.eos_token_ids)
        return Constraint(self._grammar_tokenizer, grammar, self.target.vocab_size)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise VerispecError(
                f"{what} needs a tokenizer, and {self.target.name} has none; pass token ids instead"
            )
        return self.tokenizer


def _nodes(draft: Draft | DraftTree) -> int:
    return draft.size if isinstance(draft, DraftTree) else draft.k


def _depth(draft: Draft | DraftTree) -> int:
    """Most tokens the draft can add: its length, or a tree's depth."""
    if isinstance(draft, DraftTree):
        return max(draft.depths(), default=0)
    return draft.k


def _generation(
    request: Request, events: list[TokenEvent], prompt_logprobs: list[TokenLogprobs | None] | None
) -> Generation:
    last = events[-1]
    assert last.finish_reason is not None and last.stats is not None
    return Generation(
        token_ids=[e.token_id for e in events],
        text="".join(e.text for e in events),
        finish_reason=last.finish_reason,
        stats=last.stats,
        prompt_token_ids=list(request.prompt_ids),
        events=events,
        prompt_logprobs=prompt_logprobs,
    )


def _adjusted(seq: SeqState, draft: Draft | DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """The target's rows as the verifier must judge them: with the request's penalties and grammar,
    each row for the context it was computed in (the committed tokens plus the draft tokens before it)."""
    if seq.rules is None:
        return logits
    drafted = draft.tokens.tolist()
    if isinstance(draft, DraftTree):
        paths = tree_paths(drafted, draft.parents.tolist())
    else:
        paths = chain_paths(drafted)
    return seq.rules.rows(logits, seq.token_ids, paths)


def _speculation_cap(seq: SeqState) -> int:
    """Most draft tokens this sequence may take now: its request's k, cut by the tokens it may still
    generate (the step's own token included); 0 when the request turned speculation off."""
    return min(seq.request.num_speculative_tokens, seq.budget - seq.num_generated - 1)


def _depth_query(seq: SeqState, cap: int, *, context: int, backlog: int) -> DepthQuery:
    """What the depth policy is told about ``seq`` (at a decode step, or at prefill about its first)."""
    return DepthQuery(
        cap=cap,
        survival=seq.acceptance.survival(cap),
        context=context,
        backlog=backlog,
        remaining=seq.budget - seq.num_generated,
    )


def _logprobs(logits: torch.Tensor, tokens: list[int], alternatives: int) -> list[TokenLogprobs]:
    """Each committed token's log-probability and the ``alternatives`` most likely tokens, from the
    target's logits at its position (``logits[i]`` predicted ``tokens[i]``).

    The raw distribution, before temperature, top-k and top-p (as vLLM reports by default): it
    describes the model, not the sampler, and is the same whether the token was drafted and accepted
    or decoded plainly, since the verify rows score exactly as plain decoding does.
    """
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if not alternatives:
        return [(lp, ()) for lp in chosen]
    top = rows.topk(alternatives, dim=-1)
    return [
        (lp, tuple(zip(ids, values, strict=True)))
        for lp, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist(), strict=True)
    ]
