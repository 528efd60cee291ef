"""A separate, smaller draft model proposing tokens autoregressively.

The draft keeps its own KV cache. Between steps it holds every committed token it has seen except
those it has not been fed yet; at each proposal it first feeds the committed tokens it lacks (the
target's recovered or bonus token, and after a full acceptance also the last draft token, which
it sampled but never fed: the draft cache lags the target by one token then), then drafts k
tokens, feeding each but the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.config import SamplingConfig, SpecConfig
from verispec.errors import VerispecError
from verispec.models.base import CausalLM, KVCache
from verispec.proposers.base import Proposer, register
from verispec.sampling import logits_to_probs, make_generator, sample
from verispec.types import Draft

_DRAFT_SEED_OFFSET = 0x5EED
"""The draft samples from its own generator, seeded apart from the verifier's, so seeded runs repeat."""


@dataclass
class DraftModelState:
    cache: KVCache
    sampling: SamplingConfig
    generator: torch.Generator
    fed_before_draft: int = 0  # cache length when the last draft started (all committed tokens)
    fed_drafts: int = 0  # draft tokens of the last proposal that were fed into the cache


@register("draft")
class DraftModelProposer(Proposer):
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

    def propose(self, state: DraftModelState, token_ids: Sequence[int], k: int) -> Draft:
        pending = list(token_ids[state.cache.length :])
        state.fed_before_draft = len(token_ids)
        state.fed_drafts = 0
        greedy = state.sampling.greedy
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        next_input = torch.tensor([pending], dtype=torch.long)  # [1, P]
        for i in range(k):
            logits = self._fit_vocab(self.model.forward(next_input, state.cache).logits[0, -1])  # [V]
            state.fed_drafts = i  # this forward fed the pending tokens (i = 0) or draft token i
            if greedy:
                token = int(logits.argmax())
                confident = self.p_min == 0.0 or float(logits.softmax(-1)[token]) >= self.p_min
            else:
                row = logits_to_probs(logits, state.sampling)
                confident = self.p_min == 0.0 or float(row.max()) >= self.p_min
                token = int(sample(row, state.generator))
                probs.append(row)
            if not confident:
                # A draft this unsure is likely rejected; stop before it. Known before
                # verification, so stopping here cannot bias the output.
                if probs:
                    probs.pop()
                break
            tokens.append(token)
            if i < k - 1:
                next_input = torch.tensor([[token]], dtype=torch.long)
        return Draft(
            tokens=torch.tensor(tokens, dtype=torch.long),
            probs=torch.stack(probs) if probs else None,  # greedy drafts are deterministic proposals
        )

    def update(self, state: DraftModelState, token_ids: Sequence[int], num_accepted: int) -> None:
        # The cache holds the committed tokens plus the fed draft tokens (1..k-1 after a full
        # proposal, fewer after an early stop); keep the accepted ones.
        keep = state.fed_before_draft + min(num_accepted, state.fed_drafts)
        state.cache.trim(state.cache.length - keep)
        state.fed_drafts = 0
        state.fed_before_draft = state.cache.length

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
