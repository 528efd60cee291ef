"""The engine: many sequences decoding together, each speculating as deep as the policy says.

:class:`SpecEngine` wires four parts and exposes them as one object:

- request building (:mod:`verispec.engine.requests`): validation, chat templates,
  fill-in-the-middle, grammars;
- scheduling (:mod:`verispec.engine.scheduler`): the waiting queue, admission into the batch,
  abort, the retry hint;
- the step (:mod:`verispec.engine.step`): prefill, then decode as propose -> verify -> commit or
  roll back -> stats, with the propose stage in :mod:`verispec.engine.drafting`;
- two hooks (:mod:`verispec.engine.hooks`): the depth policy's cost model and the distillation tap.

The verifier is chosen once, here, from :attr:`SpecConfig.acceptance
<verispec.config.SpecConfig.acceptance>`; the step calls it for every draft, chain or tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from verispec.config import SchedulerConfig, SpecConfig
from verispec.costs import StepCostModel
from verispec.engine.drafting import Drafting
from verispec.engine.hooks import HiddenObserver, HiddenTap, StepCosts
from verispec.engine.prefix_cache import PrefixCache
from verispec.engine.requests import Prompt, RequestBuilder
from verispec.engine.scheduler import Scheduler
from verispec.engine.state import Request, RequestOutput, SeqState, StepReport, TokenLogprobs
from verispec.engine.step import Step
from verispec.errors import VerispecError
from verispec.fim import FimPrompt
from verispec.models.base import CausalLM
from verispec.policy import AcceptancePrior, DepthPolicy, TreeCalibration
from verispec.proposers.base import Proposer
from verispec.types import Generation, TokenEvent
from verispec.verify import make_verifier

LOCAL_SCOPE = "local"
"""The cache scope of :meth:`SpecEngine.generate`, :meth:`~SpecEngine.stream` and
:meth:`~SpecEngine.generate_batch` requests: one process's own caller. A server gives each request
its caller's scope instead (:attr:`Request.cache_scope <verispec.engine.state.Request.cache_scope>`)."""


def prefix_cache(target: CausalLM, config: SchedulerConfig) -> PrefixCache | None:
    """A prefix cache of ``config``'s budget, where ``target`` computes every position the same
    way however its forwards are grouped (else reuse would not be exact); None otherwise."""
    if config.prefix_cache_gb <= 0 or not getattr(target, "position_invariant", False):
        return None
    return PrefixCache(int(config.prefix_cache_gb * 1e9))


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
        self.step_observers: list[Callable[[StepReport], Any]] = []
        """Callables given every :class:`StepReport` (the server's metrics)."""
        k = spec.num_speculative_tokens if proposer is not None else 0
        self.requests = RequestBuilder(target, tokenizer, k)
        self._costs = StepCosts(spec, target, draft, costs)
        self._drafting = Drafting(proposer, self._costs, spec, target, draft)
        config = scheduler or SchedulerConfig()
        self._queue = Scheduler(
            config,
            target,
            tokenizer,
            proposer,
            self._drafting.prior,
            self.requests.constraint,
            prefix_cache(target, config),
        )
        self._tap = HiddenTap(target.hidden_size)
        self._step = Step(
            target,
            proposer,
            make_verifier(spec.acceptance),
            self._drafting,
            self._queue,
            self._costs,
            self._tap,
            self.step_observers,
        )

    # ----------------------------------------------------------------- requests

    def make_request(self, prompt: Prompt, **options: Any) -> Request:
        """Validate a request; raises :class:`VerispecError` with a message fit for the user. The
        options are those of :meth:`verispec.engine.requests.RequestBuilder.make_request`."""
        return self.requests.make_request(prompt, **options)

    def encode(self, prompt: Prompt) -> list[int]:
        return self.requests.encode(prompt)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, ready for the reply."""
        return self.requests.apply_chat_template(messages, tools)

    def fill_in_middle(self, prefix: str, suffix: str) -> FimPrompt:
        """The prompt asking the target for the text between ``prefix`` and ``suffix``."""
        return self.requests.fill_in_middle(prefix, suffix)

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes, built on the first call (on the thread that owns the tokenizer)."""
        return self.requests.token_bytes()

    # ----------------------------------------------------------------- scheduling

    def add(self, request: Request) -> None:
        """Queue a request; raises :class:`~verispec.errors.QueueFullError` behind a full queue."""
        self._queue.add(request)

    def add_all(self, requests: Seq[Request]) -> None:
        """Queue several requests (the choices of one API request) all or none."""
        self._queue.add_all(requests)

    def abort(self, request_id: str) -> bool:
        """Drop a request (its client went away); frees its cache. False if it is not here."""
        return self._queue.abort(request_id)

    def has_work(self) -> bool:
        return self._queue.has_work()

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about the time for one running request to finish."""
        return self._queue.retry_after()

    @property
    def scheduler(self) -> SchedulerConfig:
        return self._queue.config

    @scheduler.setter
    def scheduler(self, config: SchedulerConfig) -> None:
        self._queue.config = config

    @property
    def waiting(self) -> Seq[SeqState]:
        return self._queue.waiting

    @property
    def running(self) -> list[SeqState]:
        return self._queue.running

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Admit, prefill and decode once; returns what each touched request produced."""
        self._queue.admit()
        return self._step.run()

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Keys and values of ended requests, reused by later ones of their scope (None: off)."""
        return self._queue.prefix

    @property
    def policy(self) -> DepthPolicy:
        """The depth policy, built on first use (the adaptive one measures costs, or loads them)."""
        return self._costs.policy

    @policy.setter
    def policy(self, policy: DepthPolicy) -> None:
        self._costs.policy = policy

    @property
    def costs(self) -> StepCostModel | None:
        return self._costs.model

    @property
    def prior(self) -> AcceptancePrior:
        """Acceptance over every sequence, where a new sequence's estimate starts."""
        return self._drafting.prior

    @property
    def tree_calibration(self) -> TreeCalibration:
        """How far the proposer's tree scores are from what verification accepts (trees only)."""
        return self._drafting.tree_calibration

    @property
    def hidden_observer(self) -> HiddenObserver | None:
        """Given the target's last hidden state after every token it is fed (the distillation tap,
        :class:`~verispec.engine.hooks.HiddenObserver`): ``verispec distill --keep-hidden`` keeps
        them as training data."""
        return self._tap.observer

    @hidden_observer.setter
    def hidden_observer(self, observer: HiddenObserver | None) -> None:
        self._tap.observer = observer

    # ----------------------------------------------------------------- conveniences

    def generate(self, prompt: Prompt, **kwargs: Any) -> Generation:
        """Generate to completion; see :meth:`make_request` for the arguments."""
        return self.generate_batch([prompt], **kwargs)[0]

    def generate_batch(
        self, prompts: Seq[Prompt], *, each: Seq[Mapping[str, Any]] | None = None, **kwargs: Any
    ) -> list[Generation]:
        """Generate for several prompts decoding together in batches: the same settings for each,
        except those ``each[i]`` gives prompt i (e.g. its own ``structured`` output).

        These conveniences serve one caller, so their requests share one cache scope,
        :data:`LOCAL_SCOPE`, unless ``cache_scope`` says otherwise (None: private)."""
        if each is not None and len(each) != len(prompts):
            raise VerispecError(f"each: {len(each)} settings for {len(prompts)} prompts")
        own = each if each is not None else [{}] * len(prompts)
        kwargs.setdefault("cache_scope", LOCAL_SCOPE)
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
        kwargs.setdefault("cache_scope", LOCAL_SCOPE)
        for out in self._drive([self.make_request(prompt, **kwargs)]):
            yield from out.events

    def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Generation:
        """Generate a reply to chat ``messages`` through the model's chat template."""
        return self.generate(self.apply_chat_template(messages), **kwargs)

    def plain_engine(self) -> SpecEngine:
        """The same target without speculation, for fair side-by-side measurements."""
        return SpecEngine(
            self.target,
            None,
            replace(self.spec, method=None),
            tokenizer=self.tokenizer,
            scheduler=self.scheduler,
        )

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
