"""The one verifier the engine calls, chosen once from the config.

A verifier is a pure function of one sequence's draft and the target's logits over it: it returns
the tokens to commit and the accepted path (:class:`~verispec.types.VerifyResult`), whatever shape
the draft has. The engine builds it once, from :attr:`SpecConfig.acceptance
<verispec.config.SpecConfig.acceptance>`, and its step calls it without asking what the proposer
drafted: a chain is a tree whose parents are i - 1.

- ``exact`` (:func:`verify`): a chain goes to the chain kernel of :mod:`verispec.verify.rejection`
  (exact rejection sampling, the reference; its random stream is the one plain decoding and every
  seeded test rely on), a tree to the walk of :mod:`verispec.verify.tree`, which on a chain reduces
  to the same rule.
- ``typical`` (:func:`~verispec.verify.typical.verify_typical`): Medusa's typical acceptance, LOSSY
  at temperature > 0.
"""

from __future__ import annotations

from typing import Protocol

import torch

from verispec.config import Acceptance, SamplingConfig
from verispec.types import Draft, VerifyResult
from verispec.verify.rejection import verify_chain
from verispec.verify.tree import verify_tree
from verispec.verify.typical import verify_typical


class Verifier(Protocol):
    """Decides which of one sequence's draft tokens to keep, and the one token the target adds."""

    def __call__(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [N + 1, V]: row 0 after the pending token, row i + 1 after node i
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> VerifyResult: ...


def verify(
    draft: Draft,
    target_logits: torch.Tensor,  # [N + 1, V]: row 0 after the pending token, row i + 1 after node i
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Exact verification of any draft: the output follows the target's distribution (greedy: its
    argmax). Chains take the chain kernel, so their results and random stream are exactly
    :func:`~verispec.verify.rejection.verify_chain`'s."""
    rule = verify_chain if draft.is_chain else verify_tree
    return rule(draft, target_logits, sampling, generator)


def make_verifier(acceptance: Acceptance) -> Verifier:
    """The verifier for ``acceptance``: ``exact`` (:func:`verify`) or ``typical`` (LOSSY)."""
    if acceptance == "exact":
        return verify
    if acceptance == "typical":
        return verify_typical
    raise ValueError(f"acceptance must be exact or typical, got {acceptance!r}")
