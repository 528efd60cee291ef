"""A separate, smaller draft model proposing tokens autoregressively.

The draft keeps its own KV cache. Between steps it holds every committed token it has seen except
those it has not been fed yet; at each proposal it first feeds the committed tokens it lacks (the
target's recovered or bonus token, and after a full acceptance also the last draft token, which
it sampled but never fed: the draft cache lags the target by one token then), then drafts k
tokens, feeding each but the last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.errors import VerispecError
from verispec.models.base import CausalLM, KVCache
from verispec.models.kv import KVBuffer
from verispec.penalties import RequestRules
from verispec.proposers.base import BatchProposer, register
from verispec.sampling import logits_to_probs, make_generator, sample
from verispec.types import Draft

_PROMPT_ROWS = 16
"""A draft's backlog longer than this (tokens it sat out while the policy decoded plainly, or a
prompt it was not given at prefill) is fed all but its last token first, in a pass that keeps no
logits (on the int4 path, the many-row kernel; see :func:`verispec.models.int4.prompt_rows`).
Shorter backlogs (a step's bonus tokens) are not split, as an extra pass costs a whole draft forward."""

_DRAFT_SEED_OFFSET = 0x5EED
"""The draft samples from its own generator, seeded apart from the verifier's, so seeded runs repeat."""


@dataclass
class DraftModelState:
    cache: KVCache
    sampling: SamplingConfig
    generator: torch.Generator
    fed_before_draft: int = 0  # cache length when the last draft started (all committed tokens)
    fed_drafts: int = 0  # draft tokens of the last proposal that were fed into the cache
    drafting: bool = False  # a proposal was made this step (update trims its rejected tokens)
    rules: RequestRules | None = None  # the request's penalties and grammar, as the target's rows get them


@register("draft")
class DraftModelProposer(BatchProposer):
    name = "draft"

    def __init__(self, spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> None:
        if draft is None:
            raise VerispecError("method 'draft' needs a draft model (--draft NAME|FOLDER|FILE.gguf)")
        check_same_vocabulary(target, draft)
        self.model = draft
        self.target_vocab = target.vocab_size
        self.p_min = spec.draft.p_min

    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> DraftModelState:
        seed = None if sampling.seed is None else sampling.seed + _DRAFT_SEED_OFFSET
        return DraftModelState(
            cache=self.model.new_cache(), sampling=sampling, generator=make_generator(seed, self.model.device)
        )

    def backlog(self, state: DraftModelState, token_ids: Sequence[int]) -> int:
        return len(token_ids) - state.cache.length

    def prefill_tokens(self, states: Sequence[DraftModelState], rows: Sequence[Sequence[int]]) -> None:
        self.model.forward_batch([s.cache for s in states], rows, logits_to_keep=[0] * len(rows))

    def propose_batch(
        self,
        states: Sequence[DraftModelState],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        *,
        min_logp: float = -math.inf,  # chains are sized by the policy before drafting
    ) -> list[Draft]:
        """Draft for every sequence together: draft step i is one batched forward over the rows
        still drafting (a row stops at its k, or early under p_min)."""
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        feed: dict[int, list[int]] = {}  # row -> tokens to feed at this draft step
        for b, (state, ids) in enumerate(zip(states, token_ids, strict=True)):
            if ks[b] > 0:
                state.fed_before_draft = len(ids)
                state.fed_drafts = 0
                state.drafting = True
                feed[b] = list(ids[state.cache.length :])  # committed tokens the draft has not seen
        prompts = {b: rows[:-1] for b, rows in feed.items() if len(rows) > _PROMPT_ROWS}
        if prompts:
            self.model.forward_batch(
                [states[b].cache for b in prompts], list(prompts.values()), logits_to_keep=[0] * len(prompts)
            )
            for b in prompts:
                feed[b] = feed[b][-1:]
        for i in range(max(ks, default=0)):
            if not feed:
                break
            rows = list(feed)
            out = self.model.forward_batch(
                [states[b].cache for b in rows], [feed[b] for b in rows], logits_to_keep=[1] * len(rows)
            )
            feed = {}
            for b, row_logits in zip(rows, out.logits, strict=True):
                state = states[b]
                state.fed_drafts = i  # this forward fed the pending tokens (i = 0) or draft token i
                logits = self._fit_vocab(row_logits[-1])
                if state.rules is not None:
                    logits = state.rules.rows(logits[None], token_ids[b], [tokens[b]])[0]
                token = self._next(state, logits, probs[b])
                if token is None:
                    continue  # too unsure: stop before it (known before verification, so exact)
                tokens[b].append(token)
                if i < ks[b] - 1:
                    feed[b] = [token]
        return [
            Draft.chain(
                torch.tensor(t, dtype=torch.long),
                torch.stack(p) if p else None,  # greedy drafts are deterministic proposals
            )
            for t, p in zip(tokens, probs, strict=True)
        ]

    def constrain(self, state: DraftModelState, rules: RequestRules) -> None:
        state.rules = rules

    def prefix_kv(self, state: DraftModelState) -> KVBuffer | None:
        """The draft's cache where its positions are exact to reuse: a draft model whose keys and
        values do not depend on how its forwards were grouped (GGUF or int8 weights on CPU), between
        steps (a proposal's unverified tokens are trimmed by :meth:`update`). A later request that
        starts the same way then skips the draft's prefill of those tokens too, and drafts exactly
        what it would have drafted after computing them."""
        exact = getattr(self.model, "position_invariant", False)
        return state.cache if exact and not state.drafting and isinstance(state.cache, KVBuffer) else None

    def _next(self, state: DraftModelState, logits: torch.Tensor, probs: list[torch.Tensor]) -> int | None:
        """The next draft token (sampled, its distribution appended to ``probs``), or None when the
        draft's confidence is below p_min."""
        if state.sampling.greedy:
            token = int(logits.argmax())
            confident = self.p_min == 0.0 or float(logits.softmax(-1)[token]) >= self.p_min
            return token if confident else None
        row = logits_to_probs(logits, state.sampling)
        if self.p_min and float(row.max()) < self.p_min:
            return None
        probs.append(row)
        return int(sample(row, state.generator))

    def update(
        self,
        state: DraftModelState,
        token_ids: Sequence[int],
        num_accepted: int,
        hidden: torch.Tensor | None = None,
    ) -> None:
        # After a proposal the cache holds the committed tokens plus the fed draft tokens (1..k-1
        # after a full proposal, fewer after an early stop); keep the accepted ones. A step without
        # a proposal fed the draft nothing: its cache (the prompt, fed at prefill) stays as it is.
        if not state.drafting:
            return
        keep = state.fed_before_draft + min(num_accepted, state.fed_drafts)
        state.cache.trim(state.cache.length - keep)
        state.fed_drafts = 0
        state.fed_before_draft = state.cache.length
        state.drafting = False

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary width (padded ids get -inf)."""
        width = logits.shape[-1]
        if width == self.target_vocab:
            return logits
        if width > self.target_vocab:
            return logits[..., : self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def check_same_vocabulary(target: CausalLM, draft: CausalLM) -> None:
    """Refuse a draft whose tokens mean something else: ids only compare within one vocabulary."""
    target_tok = getattr(target, "tokenizer", None)
    draft_tok = getattr(draft, "tokenizer", None)
    if target_tok is not None and draft_tok is not None:
        if target_tok.get_vocab() != draft_tok.get_vocab():
            raise VerispecError(
                f"draft {draft.name} has a different vocabulary ({len(draft_tok)} tokens) than target "
                f"{target.name} ({len(target_tok)} tokens); pick a draft from the same model family"
            )
    elif target.vocab_size != draft.vocab_size:
        raise VerispecError(
            f"draft {draft.name} has {draft.vocab_size} output tokens but target {target.name} has "
            f"{target.vocab_size}; pick a draft from the same model family"
        )
