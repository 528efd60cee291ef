"""``verispec bench serve``: throughput and latency of the server under concurrent users, per depth policy.

For each policy a fresh ``verispec serve`` process starts on a free loopback port (see
:mod:`verispec.bench.server_proc`), is warmed up, and then serves every concurrency level in turn:
closed-loop streaming users (:mod:`verispec.bench.load`) send Spec-Bench prompts, the same ones to
every policy, and the server's ``/metrics`` counters, scraped before and after each level, give the depth
the policy chose. Repeats run all levels again (repeat outer, level inner), so a level's repeats
are spread over the server's run and their spread shows the noise.

Policies:

- ``plain``: a server started with ``--method none`` (no proposer, no draft model loaded). A
  speculative server with speculation switched off per request would also decode plainly, but it
  would still hold the draft model in memory and run the speculative bookkeeping; the baseline is
  what a user would run without speculation.
- ``fixed``: ``--depth-policy fixed -k K``: every sequence drafts K tokens every step.
- ``adaptive``: ``--depth-policy adaptive -k K``: K is the most; the policy chooses per sequence
  and step from measured costs and acceptance.

Every policy gets its own server process, so no state (metrics, acceptance estimates, caches)
carries from one to the next, and only one model set is in memory at a time.

Conversations: with ``--turns all`` (the default for the workloads made of conversations,
``code_edit``, ``tool_calls`` and ``mt_bench_6turn``) each simulated user runs its conversation
turn by turn, each turn a new request carrying the whole history, as chat clients do; the other
datasets send a prompt's first turn only, as this benchmark always has. TTFT is reported per turn.

Cross-request reuse: the server shares cached prompts and outputs only within a cache scope, which
comes from the caller's API key (``--api-key``, sent as ``Authorization: Bearer``; the servers
started here get it through ``$VERISPEC_API_KEY``, so it is on no command line) or, without keys,
from ``--shared-cache``, which ``--cache-scope shared`` (the default) starts them with. Every level
(and repeat) names its own OpenAI ``user``, which narrows the scope: levels send the same first
conversations, and a level must not find them already cached by the one before.

Requests per level default to ``max(12, 2 x users)``: at one user a dozen requests already average
over prompts, while at 16 users a level must hold at least two requests per user, or the level
is mostly the ramp-down of its slowest request. Each level sends the first N prompts of one list,
ordered so that every prefix mixes the categories evenly (:func:`pick_prompts`): Spec-Bench's
summarization and RAG prompts are ten times longer than the others, and a level that drew more of
them would measure prefill, not concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from verispec.bench import environment
from verispec.bench.datasets import CONVERSATIONS, BenchPrompt, load_dataset
from verispec.bench.load import RequestSpec, client_for, run_level
from verispec.bench.replies import ReplyCheck, across_policies, against
from verispec.bench.scrape import Scrape, parse_metrics, spec_delta
from verispec.bench.serve_stats import LevelStats, LevelSummary, level_stats, summarize
from verispec.bench.server_proc import RssSampler, ServerProcess, ServerRun
from verispec.bench.settings import CACHE_SCOPES, SERVE_METHODS
from verispec.errors import VerispecError

SCHEMA = "verispec-bench-serve/1"
POLICIES = ("plain", "fixed", "adaptive")
TURNS = ("all", "first")
API_KEY_ENV = "VERISPEC_API_KEY"
"""Where ``verispec serve`` reads its key when given no ``--api-key`` (:mod:`verispec.server.auth`)."""
PLAIN_IS = "a separate server started with --method none (no proposer or draft model loaded)"
MB = 2**20


@dataclass(frozen=True)
class ServeBenchSettings(ServerRun):
    """Everything ``bench serve`` is asked to do; :meth:`validate` checks it before any server starts."""

    policies: tuple[str, ...] = POLICIES
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests_per_level: int | None = None
    """Requests sent at every level; None means ``max(12, 2 x users)`` for each level."""
    max_tokens: int = 128
    repeats: int = 1
    warmup: int = 4
    request_timeout: float = 600.0
    turns: str | None = None
    """``all``: every turn of a conversation, a request each; ``first``: its first turn only; None:
    ``all`` for the datasets made of conversations (:data:`~verispec.bench.datasets.CONVERSATIONS`),
    else ``first``."""
    cache_scope: str = "shared"
    """``shared``: the requests of a level share a cache scope (servers without a key start with
    ``--shared-cache``); ``private``: servers keep every request private."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as ``Authorization: Bearer``; the servers started here require it. Never written out."""

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or max(self.concurrency)

    @property
    def all_turns(self) -> bool:
        """Whether conversations run every turn (else their first turn only)."""
        return self.turns == "all" or (self.turns is None and self.dataset in CONVERSATIONS)

    def requests_at(self, concurrency: int) -> int:
        """Conversations run at the level with ``concurrency`` users (a request each, or one per turn)."""
        return self.requests_per_level or max(12, 2 * concurrency)

    def user_for(self, level: str) -> str | None:
        """The OpenAI ``user`` of a level's requests: a scope of its own where caches are shared."""
        return f"bench-{level}" if self.cache_scope == "shared" else None

    def validate(self) -> None:
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise VerispecError(f"--policies: choose from {', '.join(POLICIES)}, got {', '.join(unknown)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise VerispecError("--concurrency: every level must be >= 1")
        for name in ("max_tokens", "repeats", "batch_size"):
            if getattr(self, name) < 1:
                raise VerispecError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise VerispecError(f"--warmup must be >= 0, got {self.warmup}")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise VerispecError(f"--requests-per-level must be >= 1, got {self.requests_per_level}")
        if self.speculative_method not in SERVE_METHODS:
            raise VerispecError(
                f"--method must be one of {', '.join(SERVE_METHODS)}, got {self.speculative_method!r}"
            )
        if self.turns not in (None, *TURNS):
            raise VerispecError(f"--turns must be one of {', '.join(TURNS)}, got {self.turns!r}")
        if self.cache_scope not in CACHE_SCOPES:
            raise VerispecError(
                f"--cache-scope must be one of {', '.join(CACHE_SCOPES)}, got {self.cache_scope!r}"
            )
        if self.cache_scope == "private" and self.api_key:
            raise VerispecError(
                "--cache-scope private needs a server without API keys (a key's requests share its "
                "tenant's caches); leave out --api-key"
            )
        self.validate_server()

    def server_args_for(self, policy: str) -> list[str]:
        """The ``verispec serve`` flags of ``policy`` (host and port are added by the process)."""
        method = "none" if policy == "plain" else self.speculative_method
        flags = self.server_flags(method, policy, max(self.concurrency))
        if self.cache_scope == "shared" and not self.api_key:  # before --server-args, which stay last
            flags.insert(len(flags) - len(self.server_args), "--shared-cache")
        return flags

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["max_batch_size"] = self.batch_size
        out["plain_is"] = PLAIN_IS
        out["turns"] = "all" if self.all_turns else "first"
        out["api_key"] = "(given)" if self.api_key else None
        return out

    def specs(self, prompts: Sequence[BenchPrompt], user: str | None) -> list[RequestSpec]:
        """A conversation per prompt, every turn of it or its first, in ``user``'s scope."""
        return [
            RequestSpec(prompt, self.max_tokens, turns=len(prompt.turns) if self.all_turns else 1, user=user)
            for prompt in prompts
        ]


def pick_prompts(
    dataset: str,
    count: int,
    *,
    data_dir: Path | None = None,
    categories: Sequence[str] | None = None,
    seed: int = 0,
) -> list[BenchPrompt]:
    """``count`` prompts taking the categories in turn, each category's in a seeded random order,
    cycling if the set is smaller: any first N hold every category about N / categories times."""
    prompts = load_dataset(
        dataset,  # type: ignore[arg-type]
        data_dir=data_dir,
        categories=list(categories) if categories else None,
    )
    if not prompts:
        raise VerispecError(f"no prompts in {dataset} match the given categories")
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    rng = random.Random(seed)
    for group in by_category.values():
        rng.shuffle(group)
    interleaved = [p for row in itertools.zip_longest(*by_category.values()) for p in row if p is not None]
    return list(itertools.islice(itertools.cycle(interleaved), count))


async def scrape(client: httpx.AsyncClient) -> Scrape | None:
    """The server's ``/metrics``, or None where it has none (the numbers then come from usage chunks)."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _bench_policy(
    server: ServerProcess,
    settings: ServeBenchSettings,
    prompts: Sequence[BenchPrompt],
    warmup: Sequence[BenchPrompt],
    policy: str,
    progress: Progress,
) -> tuple[list[tuple[LevelStats, dict[str, Any]]], RssSampler]:
    """Warm ``server`` up on ``warmup``, then run every repeat of every level on the first prompts;
    the stats with their raw records."""
    users = max(settings.concurrency)
    out: list[tuple[LevelStats, dict[str, Any]]] = []
    sampler = RssSampler(server.pid)
    sampler.start()
    try:
        async with client_for(server.base_url, users, settings.request_timeout, settings.api_key) as client:
            models = await client.get("/v1/models")
            if models.status_code == 200:  # what the server says it runs: the record of what was measured
                server.models = models.json().get("data")
            elif models.status_code == 401:
                raise VerispecError(f"{policy}: the server refused the API key: {models.text[:300]}")
            if warmup:
                warm = settings.specs(warmup, settings.user_for("warmup"))
                run = await run_level(client, warm, min(len(warm), users))
                bad = [r.error for r in run.results if not r.ok]
                if bad:
                    raise VerispecError(f"{policy}: warm-up request failed: {bad[0]}")
            for repeat in range(settings.repeats):
                for concurrency in settings.concurrency:
                    # level N runs the first N conversations, in a cache scope of its own
                    specs = settings.specs(
                        prompts[: settings.requests_at(concurrency)],
                        settings.user_for(f"r{repeat}-u{concurrency}"),
                    )
                    before = await scrape(client)
                    run = await run_level(client, specs, concurrency)
                    after = await scrape(client)
                    if not server.alive():
                        raise VerispecError(
                            f"the {policy} server died; its log ends with:\n{server.log_tail()}"
                        )
                    delta = spec_delta(before, after) if before and after else None
                    stats = level_stats(policy, repeat, run, delta)
                    record = {
                        **stats.to_dict(),
                        "metrics": delta.to_dict() if delta else None,
                        "requests": [r.to_dict() for r in run.results],
                    }
                    out.append((stats, record))
                    progress(_progress_line(stats, settings.repeats))
                    if stats.failed:
                        first = next(r for r in run.results if not r.ok)
                        progress(f"  {stats.failed} request(s) failed, e.g. {first.error}")
    finally:
        await sampler.stop()
    return out, sampler


def _progress_line(s: LevelStats, repeats: int) -> str:
    ttft = f"{s.ttft_mean:.2f}" if s.ttft_mean is not None else "-"
    depth = f"{s.mean_depth:.2f}" if s.mean_depth is not None else "-"
    turns = ""
    if len(s.ttft_by_turn) > 1:
        turns = (
            " (by turn " + "/".join("-" if t is None else f"{t:.2f}" for t in s.ttft_by_turn.values()) + ")"
        )
    return (
        f"{s.policy:<9} users {s.concurrency:>3}  repeat {s.repeat + 1}/{repeats}: "
        f"{s.throughput:7.2f} tok/s, TTFT {ttft} s{turns}, depth {depth}, {s.wall_seconds:.1f} s"
    )


@dataclass
class ServeBenchRun:
    """What :func:`run_serve_bench` measured, ready for :func:`results_dict`."""

    settings: ServeBenchSettings
    command: str
    prompts: list[BenchPrompt]
    levels: list[LevelStats]
    records: list[dict[str, Any]]
    servers: list[dict[str, Any]]
    environment: dict[str, Any]
    wall_seconds: float
    replies: list[ReplyCheck] = field(default_factory=list)
    """Whether the replies matched across policies and, where asked, another run's."""

    @property
    def summaries(self) -> list[LevelSummary]:
        return summarize(self.levels)

    def check_replies(self, other: Path | None = None) -> list[ReplyCheck]:
        """Compare the replies of every policy with the first policy's and, given ``other`` (another
        run's results.json or its folder), with that run's; kept for :func:`results_dict`."""
        ours = results_dict(self)
        self.replies = across_policies(ours)
        if other is not None:
            path = other / "results.json" if other.is_dir() else other
            try:
                theirs = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise VerispecError(f"--compare-replies: cannot read {path}: {exc}") from exc
            if theirs.get("schema") != SCHEMA:
                raise VerispecError(f"--compare-replies: {path} is not a bench serve results.json")
            self.replies += against(ours, theirs, str(other))
        return self.replies


def run_serve_bench(
    settings: ServeBenchSettings, command: str, out_dir: Path, progress: Progress = _stderr
) -> ServeBenchRun:
    """Start one server per policy, measure every level, and stop it; results.json grows after each
    policy, so an interrupted run keeps what it measured."""
    settings.validate()
    measured = max(settings.requests_at(c) for c in settings.concurrency)
    prompts = pick_prompts(
        settings.dataset,
        measured + settings.warmup,
        data_dir=settings.data_dir,
        categories=settings.categories,
        seed=settings.seed,
    )
    prompts, warmup = prompts[:measured], prompts[measured:]  # warm up on prompts no level sends
    run = ServeBenchRun(
        settings=settings,
        command=command,
        prompts=prompts,
        levels=[],
        records=[],
        servers=[],
        environment={
            "machine": environment.machine(busy=True),
            "versions": environment.versions(),
            "git_commit": environment.git_commit(),
        },
        wall_seconds=0.0,
    )
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    for policy in settings.policies:
        args = settings.server_args_for(policy)
        progress(f"{policy}: starting verispec serve {' '.join(args)}")
        log = out_dir / f"server-{policy}.log"
        log.unlink(missing_ok=True)
        with (
            _key_for_servers(settings.api_key),
            ServerProcess(args, log, startup_timeout=settings.startup_timeout) as server,
        ):
            progress(f"{policy}: healthy after {server.startup_seconds:.1f} s (pid {server.pid})")
            levels, sampler = asyncio.run(_bench_policy(server, settings, prompts, warmup, policy, progress))
        run.levels += [stats for stats, _ in levels]
        run.records += [record for _, record in levels]
        peak = sampler.peak
        run.servers.append(
            {
                "policy": policy,
                "args": args,
                "command": server.command,
                "startup_seconds": server.startup_seconds,
                "rss_peak_mb": peak / MB if peak else None,
                "log": log.name,
                "models": server.models,
            }
        )
        run.wall_seconds = time.perf_counter() - start
        write_results(run, out_dir)
    run.environment["machine"]["load_average_end"] = environment.load_average()
    return run


@contextlib.contextmanager
def _key_for_servers(api_key: str | None) -> Iterator[None]:
    """``$VERISPEC_API_KEY`` set to ``api_key`` while a server starts (it inherits the environment and
    reads the key from there), so the key is on no command line, log or results file; restored after."""
    if not api_key:
        yield
        return
    before = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = api_key
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(API_KEY_ENV, None)
        else:
            os.environ[API_KEY_ENV] = before


def results_dict(run: ServeBenchRun) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": run.command,
        **run.environment,
        "settings": run.settings.to_dict(),
        "prompts": [{"dataset": p.dataset, "category": p.category, "id": p.id} for p in run.prompts],
        "wall_seconds": run.wall_seconds,
        "servers": run.servers,
        "summary": [s.to_dict() for s in run.summaries],
        "replies": [c.to_dict() for c in run.replies],
        "levels": run.records,
    }


def write_results(run: ServeBenchRun, out_dir: Path) -> Path:
    path = out_dir / "results.json"
    path.write_text(json.dumps(results_dict(run), indent=1) + "\n")
    return path
