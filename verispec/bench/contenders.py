"""A contender is anything the benchmark times: a verispec method or another tool's decoding.

They all take the same prompt token ids (the harness applies the chat template once, with the
target's tokenizer) and return a :class:`Turn`, timed the same way: wall time around the whole call,
prefill included. So a contender differs from another only in how it decodes.

``references`` says which plain decoding a contender's greedy output must equal (the lossless
check): the first of them that ran. verispec methods and transformers' plain ``generate`` must equal
verispec's plain decoding; transformers' assisted and prompt-lookup modes must equal its plain mode;
llama.cpp computes with quantized arithmetic, so only its prompt lookup is checked, against
llama.cpp plain.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from verispec.bench.records import SpecCounts, Turn
from verispec.bench.settings import PLAIN, BenchSettings
from verispec.config import DraftModelConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.structured import Structured


class Contender(Protocol):
    name: str
    references: tuple[str, ...]
    """Plain decodings this one's output must equal, in order of preference (empty: not checked)."""
    description: dict[str, object]
    """Settings that define this contender, for the report (k, library defaults it runs with, ...)."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Turn:
        """Greedy-decode up to ``max_new_tokens`` after ``prompt_ids``, timed."""
        ...


@dataclass(frozen=True)
class Skipped:
    """A requested contender that cannot run here, and why (shown in the report, never silent)."""

    name: str
    reason: str


class EngineContender:
    """A verispec method: one :class:`SpecEngine` over the shared, already loaded target."""

    def __init__(self, name: str, engine: SpecEngine, structured: Structured | None = None) -> None:
        self.name = name
        self.engine = engine
        self.structured = structured
        """JSON mode's grammar (``--json-schema``), the same for every method."""
        self.references: tuple[str, ...] = () if name == PLAIN else (PLAIN,)
        spec = engine.spec
        self.description: dict[str, object] = {"backend": "verispec", "method": spec.method}
        if spec.method is not None:
            self.description["num_speculative_tokens"] = spec.num_speculative_tokens
            self.description["depth_policy"] = spec.depth
        if spec.method == "ngram":
            self.description["ngram"] = {"max_ngram": spec.ngram.max_ngram, "min_ngram": spec.ngram.min_ngram}
        if spec.method == "draft":
            self.description["draft"] = spec.draft.model
        heads = getattr(engine.proposer, "description", None)  # what heads proposers (+ lookup) report
        if heads is not None:
            self.description["heads"] = heads

    def generate(self, prompt_ids: list[int], max_new_tokens: int, cache_scope: str | None = None) -> Turn:
        """Streamed, for the time to the first token; in ``cache_scope`` (None: private)."""
        started = time.perf_counter()
        first = None
        events = []
        stream = self.engine.stream(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            structured=self.structured,
            cache_scope=cache_scope,
        )
        for event in stream:
            if first is None:
                first = time.perf_counter() - started
            events.append(event)
        seconds = time.perf_counter() - started
        stats = events[-1].stats
        assert stats is not None, "the engine's last event carries the generation's stats"
        return Turn(
            prompt_tokens=len(prompt_ids),
            token_ids=[event.token_id for event in events],
            seconds=seconds,
            counts=SpecCounts.from_stats(stats),
            ttft=first,
            cached_prompt_tokens=stats.cached_prompt_tokens,
        )


def engine_contenders(
    settings: BenchSettings, target: HFCausalLM, draft: HFCausalLM | None
) -> list[EngineContender]:
    """One engine per verispec method, all sharing the loaded target (and draft) weights."""
    out = []
    structured = None if settings.json_schema is None else Structured("json", settings.json_schema)
    for name in settings.methods:
        method = None if name == PLAIN else name
        spec = SpecConfig(
            method=method,  # type: ignore[arg-type]
            num_speculative_tokens=settings.num_speculative_tokens,
            ngram=settings.ngram,
            draft=DraftModelConfig(model=settings.draft if method == "draft" else None),
            depth=settings.depth,  # type: ignore[arg-type]  # fixed: each method at the k it is given
            heads=settings.heads,
            tree_nodes=settings.tree_nodes,
            tree_width=settings.tree_width,
        )
        own_draft = draft if method == "draft" else None
        proposer = build_proposer(spec, target, own_draft)
        engine = SpecEngine(target, proposer, spec, tokenizer=target.tokenizer, draft=own_draft)
        out.append(EngineContender(name, engine, structured))
    return out
