"""Verifiers that are wrong in known ways, for the exactness tests to prove their power: each must
fail the chi-square check that the real verifier passes (tests/verify/test_rejection.py on a
synthetic language model, tests/test_engine_distribution.py in the whole engine).

- ``keeps every draft`` (blatant): every draft token is committed, then a bonus token from the target.
- ``recovers from the target`` (subtle): the right acceptance test, but the token after a rejection
  is sampled from the target's row instead of the residual.

Both make the same last move, which is where they go wrong: the token after the draft tokens they
keep is sampled from the target's own row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft, VerifyResult
from verispec.verify import rejection_sample

ChainVerifier = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None], VerifyResult
]
"""A verifier with :func:`~verispec.verify.rejection_sample`'s arguments: draft tokens [k], draft
probabilities [k, V] or None, target probabilities [k+1, V] and a generator."""

Mistake = Literal["keeps every draft", "recovers from the target"]
MISTAKES: tuple[Mistake, ...] = ("keeps every draft", "recovers from the target")


def wrong_verifier(mistake: Mistake) -> ChainVerifier:
    """A chain verifier that makes ``mistake`` (see the module docstring)."""

    def verify(
        draft_tokens: torch.Tensor,  # [k]
        draft_probs: torch.Tensor | None,  # [k, V]
        target_probs: torch.Tensor,  # [k+1, V]
        generator: torch.Generator | None,
    ) -> VerifyResult:
        k = int(draft_tokens.shape[0])
        if mistake == "keeps every draft":
            kept = draft_tokens.tolist()
        else:
            result = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
            if result.bonus:
                return result
            kept = result.tokens[:-1]
        return VerifyResult([*kept, int(sample(target_probs[len(kept)], generator))], len(kept), k)

    return verify


def on_logits(
    verifier: ChainVerifier,
) -> Callable[[Draft, torch.Tensor, SamplingConfig, torch.Generator | None], VerifyResult]:
    """``verifier`` as the engine calls a verifier: a chain draft and the target's logits over it
    ([k+1, V]), turned into probabilities by the same sampling transform the engine uses."""

    def verify(
        draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> VerifyResult:
        return verifier(draft.tokens, draft.probs, logits_to_probs(target_logits, sampling), generator)

    return verify
