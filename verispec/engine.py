"""The decoding step: propose -> verify -> commit or roll back -> record stats.

Invariant of a sequence between steps: the target's KV cache holds every committed token but the
last one, which is fed at the next step together with that step's draft tokens. One target forward
over ``[pending..., d_1 .. d_k]`` yields the k+1 distributions the verifier needs; after it the
cache is trimmed back to the accepted prefix, and the token the target added (recovered or bonus)
becomes the next pending token. Plain decoding is the same step with k = 0, so comparisons are fair.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.detok import IncrementalDetokenizer
from verispec.errors import VerispecError
from verispec.metrics import SpecStats
from verispec.models.base import CausalLM, KVCache
from verispec.proposers.base import Proposer
from verispec.sampling import make_generator
from verispec.types import Draft, FinishReason, Generation, TokenEvent, VerifyResult
from verispec.verify import verify

Prompt = str | Sequence[int]


@dataclass
class SequenceState:
    """Everything that belongs to one sequence being decoded."""

    token_ids: list[int]  # committed tokens, prompt included
    prompt_len: int
    cache: KVCache
    sampling: SamplingConfig
    generator: torch.Generator
    proposer_state: Any = None
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


class SpecEngine:
    """Speculative decoding of one sequence at a time over a target model and an optional proposer."""

    def __init__(
        self,
        target: CausalLM,
        proposer: Proposer | None,
        spec: SpecConfig,
        tokenizer: Any | None = None,
        draft: CausalLM | None = None,
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.spec = spec
        self.tokenizer = tokenizer
        self.draft = draft

    # ----------------------------------------------------------------- public API

    def generate(self, prompt: Prompt, **kwargs: Any) -> Generation:
        """Generate to completion; see :meth:`stream` for the arguments."""
        events: list[TokenEvent] = []
        stream = self._run(prompt, **kwargs)
        try:
            while True:
                events.append(next(stream))
        except StopIteration as stop:
            seq, finish = stop.value
        return Generation(
            token_ids=seq.token_ids[seq.prompt_len :],
            text="".join(e.text for e in events),
            finish_reason=finish,
            stats=seq.stats,
            prompt_token_ids=seq.token_ids[: seq.prompt_len],
            events=events,
        )

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[TokenEvent]:
        """Yield one :class:`TokenEvent` per generated token as soon as it is committed.

        Arguments: ``max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=()``
        and ``num_speculative_tokens`` (defaults to the engine's). ``prompt`` is a string (needs a
        tokenizer) or a list of token ids. The last event carries the ``finish_reason``.
        """
        yield from self._run(prompt, **kwargs)

    def plain_engine(self) -> SpecEngine:
        """The same target without speculation, for fair side-by-side measurements."""
        return SpecEngine(self.target, None, replace(self.spec, method=None), tokenizer=self.tokenizer)

    def chat(self, messages: list[dict[str, str]], **kwargs: Any) -> Generation:
        """Generate a reply to chat ``messages`` through the model's chat template."""
        return self.generate(self.apply_chat_template(messages), **kwargs)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self._require_tokenizer("chat messages")
        if not getattr(tok, "chat_template", None):
            raise VerispecError(f"{self.target.name} has no chat template; send a plain prompt instead")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

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

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise VerispecError(
                f"{what} needs a tokenizer, and {self.target.name} has none; pass token ids instead"
            )
        return self.tokenizer

    # ----------------------------------------------------------------- the loop

    def _run(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        num_speculative_tokens: int | None = None,
    ) -> Iterator[TokenEvent]:
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if max_new_tokens < 1:
            raise VerispecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        k_max = self.spec.num_speculative_tokens
        if num_speculative_tokens is not None:
            k_max = replace(self.spec, num_speculative_tokens=num_speculative_tokens).num_speculative_tokens
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) >= self.target.max_context:
            raise VerispecError(
                f"the prompt has {len(prompt_ids)} tokens but {self.target.name} has a context of "
                f"{self.target.max_context}; shorten the prompt"
            )
        if stop and self.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer; this model folder has none")
        seq = self._start(prompt_ids, sampling)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop) if self.tokenizer else None
        budget = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        eos_ids = self.target.eos_token_ids
        started = time.perf_counter()
        finish: FinishReason | None = None
        step = 0
        try:
            while finish is None:
                room = budget - seq.num_generated
                result = self._step(seq, min(k_max, room - 1) if self.proposer is not None else 0)
                for i, token in enumerate(result.tokens):
                    seq.token_ids.append(token)
                    seq.stats.num_output_tokens += 1
                    text = detok.add(token) if detok else ""
                    if token in eos_ids:
                        finish = "eos"
                    elif detok and detok.stopped:
                        finish = "stop"
                    elif seq.num_generated >= budget:
                        finish = "length"
                    if finish is not None and detok:
                        text += detok.flush()
                    seq.stats.total_seconds = time.perf_counter() - started
                    yield TokenEvent(
                        token_id=token,
                        text=text,
                        from_draft=i < result.num_accepted,
                        logprob=None,
                        step=step,
                        finish_reason=finish,
                        stats=seq.stats if finish is not None else None,
                    )
                    if finish is not None:
                        break
                step += 1
        finally:
            seq.stats.total_seconds = time.perf_counter() - started
            if self.proposer is not None:
                self.proposer.release(seq.proposer_state)
        return seq, finish

    def _start(self, prompt_ids: list[int], sampling: SamplingConfig) -> SequenceState:
        seq = SequenceState(
            token_ids=list(prompt_ids),
            prompt_len=len(prompt_ids),
            cache=self.target.new_cache(),
            sampling=sampling,
            generator=make_generator(sampling.seed, self.target.device),
        )
        seq.stats.prompt_tokens = len(prompt_ids)
        if self.proposer is not None:
            seq.proposer_state = self.proposer.new_state(prompt_ids, sampling)
        return seq

    def _step(self, seq: SequenceState, k: int) -> VerifyResult:
        """One step: propose up to k tokens, score them with one target forward, verify, commit."""
        t0 = time.perf_counter()
        draft = self._propose(seq, k)
        t1 = time.perf_counter()
        target_logits = self._score(seq, draft)  # [k+1, V]
        result = verify(draft, target_logits, seq.sampling, seq.generator)
        self._commit(seq, draft, result)
        t2 = time.perf_counter()
        seq.stats.draft_seconds += t1 - t0
        seq.stats.verify_seconds += t2 - t1
        seq.stats.observe(draft.k, result.num_accepted)
        return result

    def _propose(self, seq: SequenceState, k: int) -> Draft:
        if self.proposer is None or k < 1:
            return Draft.empty()
        draft = self.proposer.propose(seq.proposer_state, seq.token_ids, k)
        if draft.k > k:
            raise RuntimeError(f"proposer returned {draft.k} draft tokens, more than the {k} asked for")
        return draft

    def _score(self, seq: SequenceState, draft: Draft) -> torch.Tensor:
        """Target logits at the k+1 positions that judge the draft: [k+1, V]."""
        if seq.cache.length == 0 and len(seq.token_ids) > 1:
            # Prefill all prompt tokens but the last on their own, whatever the draft: the prompt is
            # then processed by the same call with or without speculation, and only the short
            # decode/verify calls need batch-invariant kernels (see verispec.models.attention).
            self.target.forward(torch.tensor([seq.token_ids[:-1]]), seq.cache)
        pending = seq.token_ids[seq.cache.length :]
        input_ids = torch.tensor([pending + draft.tokens.tolist()], dtype=torch.long)  # [1, P + k]
        out = self.target.forward(input_ids, seq.cache, logits_to_keep=draft.k + 1)
        return out.logits[0]

    def _commit(self, seq: SequenceState, draft: Draft, result: VerifyResult) -> None:
        """Roll the target cache back to the accepted prefix and tell the proposer what was kept.

        The committed tokens themselves are appended by the caller, one at a time, so that EOS,
        stop strings and the length limit can cut a step short.
        """
        seq.cache.trim(draft.k - result.num_accepted)
        if self.proposer is not None:
            self.proposer.update(seq.proposer_state, seq.token_ids + result.tokens, result.num_accepted)
