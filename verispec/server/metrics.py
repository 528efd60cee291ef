"""Prometheus metrics, one registry per app (so tests and several apps in a process stay apart).

Three sources feed them:

- :class:`CountRequests`, an ASGI middleware, counts every HTTP answer by route and status;
- :class:`RequestTimer`, one per generation request, times the first token, the gaps between tokens
  and the whole request, and counts tokens and how each request ended;
- :meth:`ServerMetrics.observe_step`, registered in ``engine.step_observers``, sees every decode
  step on the engine thread: batch size, queue length, depth chosen per sequence and what was
  accepted. The acceptance gauges are ratios of these counters since the start, with the
  definitions of :mod:`verispec.metrics` (mean accepted length counts the target's own token, so
  plain decoding scores 1.0).

Inter-token latency is amortized: a step that delivers n tokens to a request after a gap of t
observes t / n once per token, so speculation's several tokens per step show up as lower latency
rather than as one long gap and n - 1 zero gaps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from verispec.engine import StepReport
from verispec.engine.prefix_cache import PrefixCache

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
DEPTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


class ServerMetrics:
    """Every ``verispec_*`` metric of one app, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float], *labels: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=self.registry)

        self.requests = counter(
            "verispec_requests", "HTTP requests answered, by route and status", "endpoint", "status"
        )
        self.finished = counter(
            "verispec_requests_finished",
            "Generation requests by how they ended: stop, length, eos, aborted (client left) or error",
            "reason",
        )
        self.prompt_tokens = counter("verispec_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("verispec_generation_tokens", "Tokens generated and sent to clients")
        self.ttft = histogram(
            "verispec_time_to_first_token_seconds",
            "From the request's arrival to its first generated token",
            LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "verispec_inter_token_latency_seconds",
            "Gap between a request's tokens after the first, amortized over the tokens of one step",
            TOKEN_GAP_BUCKETS,
        )
        self.latency = histogram(
            "verispec_request_latency_seconds",
            "From a generation request's arrival to its end",
            LATENCY_BUCKETS,
            "endpoint",
        )
        self.drafted = counter("verispec_draft_tokens", "Draft tokens proposed for verification")
        self.accepted = counter("verispec_accepted_tokens", "Draft tokens accepted by the target")
        self.position_drafted = counter(
            "verispec_position_draft_tokens",
            "Draft tokens proposed at each position of a step's draft (1 = first)",
            "position",
        )
        self.position_accepted = counter(
            "verispec_position_accepted_tokens",
            "Draft tokens accepted at each position of a step's draft (1 = first)",
            "position",
        )
        self.verify_rows = counter(
            "verispec_sequence_steps", "Decode steps summed over sequences (target passes per sequence)"
        )
        self._drafted = self._accepted = self._rows = 0
        gauge(
            "verispec_acceptance_rate", "Accepted / drafted tokens since start (0 before any draft)"
        ).set_function(lambda: self._accepted / self._drafted if self._drafted else 0.0)
        gauge(
            "verispec_mean_accepted_length",
            "Tokens committed per target pass per sequence since start (1.0 = plain decoding)",
        ).set_function(lambda: (self._accepted + self._rows) / self._rows if self._rows else 0.0)
        self.batch_size = gauge("verispec_batch_size", "Sequences decoding together")
        self.waiting = gauge("verispec_waiting_requests", "Requests queued behind the batch")
        self.mean_depth = gauge(
            "verispec_step_mean_depth", "Mean draft length over the sequences of the last step"
        )
        self.depth = histogram(
            "verispec_step_depth", "Draft length chosen per sequence and step", DEPTH_BUCKETS
        )
        self.step_seconds = histogram(
            "verispec_step_seconds",
            "Time of one decode step's phases: draft (proposing) and target (verification forward)",
            LATENCY_BUCKETS,
            "phase",
        )

    def watch_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Gauges read from the engine's prefix cache at each scrape (plain attribute reads)."""
        if cache is None:
            return
        Gauge(
            "verispec_prefix_cache_bytes", "Memory held by the prefix cache's blocks", registry=self.registry
        ).set_function(lambda: cache.nbytes)
        Gauge(
            "verispec_prefix_cache_hit_rate",
            "Prompt tokens taken from the prefix cache / prompt tokens looked up, since start",
            registry=self.registry,
        ).set_function(lambda: cache.hits / cache.queried if cache.queried else 0.0)

    def observe_step(self, report: StepReport) -> None:
        """A step observer (runs on the engine thread; prometheus_client is thread-safe)."""
        self.batch_size.set(report.batch_size)
        self.waiting.set(report.waiting)
        drafted, accepted = sum(report.drafted), sum(report.accepted)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.verify_rows.inc(report.batch_size)
        self._drafted += drafted
        self._accepted += accepted
        self._rows += report.batch_size
        for k in report.drafted:
            self.depth.observe(k)
        self.mean_depth.set(drafted / len(report.drafted) if report.drafted else 0.0)
        self._positions(self.position_drafted, report.drafted)
        self._positions(self.position_accepted, report.accepted)
        self.step_seconds.labels("draft").observe(report.draft_seconds)
        self.step_seconds.labels("target").observe(report.target_seconds)

    @staticmethod
    def _positions(counter: Counter, lengths: Iterable[int]) -> None:
        """Count, for each position i, the rows whose length reaches it (one ``inc`` per position)."""
        lengths = sorted(lengths, reverse=True)
        position = 0
        while lengths and lengths[0] > position:
            reached = sum(1 for n in lengths if n > position)
            counter.labels(str(position + 1)).inc(reached)
            position += 1

    def queue(self, running: int, waiting: int) -> None:
        """The engine's current batch and queue (set at scrape time: steps stop when idle)."""
        self.batch_size.set(running)
        self.waiting.set(waiting)


class RequestTimer:
    """Latency and token accounting for one generation request."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.start = time.perf_counter()
        self._last: float | None = None
        self._done = False

    def admitted(self, prompt_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int) -> None:
        """``n`` tokens arrived together (one engine step)."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            gap = (now - self._last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self._last = now
        self.metrics.generation_tokens.inc(n)

    def finish(self, reason: str) -> None:
        """Record how the request ended (once; later calls are ignored)."""
        if self._done:
            return
        self._done = True
        self.metrics.finished.labels(reason).inc()
        self.metrics.latency.labels(self.endpoint).observe(time.perf_counter() - self.start)


class CountRequests:
    """ASGI middleware: ``verispec_requests_total{endpoint, status}`` for every HTTP answer.

    The endpoint label is the matched route's path template (``/v1/models/{model}``), or ``other``
    for paths no route serves, so a scanner cannot blow up the label set.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: Sequence[object]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the router's own list: routes added after the middleware count too

    def _endpoint(self, scope: Scope) -> str:
        partial = "other"  # a known path with the wrong method (405) keeps its route's label
        for route in self.routes:
            matches = getattr(route, "matches", None)
            match = matches(scope)[0] if matches is not None else Match.NONE
            if match == Match.FULL:
                return str(getattr(route, "path", "other"))
            if match == Match.PARTIAL and partial == "other":
                partial = str(getattr(route, "path", "other"))
        return partial

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = self._endpoint(scope)
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if not counted:  # an unhandled error: the server's outermost layer answers 500
                self.metrics.requests.labels(endpoint, "500").inc()
