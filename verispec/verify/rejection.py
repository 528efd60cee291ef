"""Verification: which draft tokens to keep, and the one token the target adds.

Vocabulary, used with these meanings throughout verispec:

- **draft tokens**: the k tokens a proposer suggests for one sequence in one step, with the
  proposer's distribution at each position (``draft_probs``), or ``None`` for a deterministic
  proposal, which is treated as one-hot on the proposed token.
- **accepted**: draft tokens the verifier keeps. Draft token i is accepted with probability
  ``min(1, target_probs[i, t_i] / draft_probs[i, t_i])``; verification stops at the first rejection.
- **recovered**: the token sampled at the first rejection, position i, from the residual
  ``normalize(max(0, target_probs[i] - draft_probs[i]))``.
- **bonus**: the token sampled from ``target_probs[k]`` when all k draft tokens were accepted.

Every step therefore commits the accepted tokens plus exactly one token of the target's own
(recovered or bonus), and the committed text is distributed exactly as if the target had sampled
it alone (Leviathan et al. 2023, Chen et al. 2023). With temperature 0 the target's probabilities
are one-hot and this reduces to greedy verification, which also has its own small path below.

A deterministic proposal (prompt lookup, Medusa and EAGLE candidates) is verified by *sampling and
matching*: the target samples its own token at each position, one draw per position in order, and
the draft token is kept while it equals that sample. That is the rule above with one-hot draft rows
(the draft token is kept with probability ``p(t_i)``, and a rejection's token is ``p`` without
``t_i``), but it spends the random stream exactly as plain decoding does: one draw per committed
token, from the same probabilities. So with a seed, and logits that do not depend on how many
tokens a forward scores (the int8 and int4 paths), sampled output with these proposers is token
for token what plain decoding samples, however deep each step drafted.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft, VerifyResult


def rejection_sample(
    draft_tokens: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, V], or None: deterministic proposal, one-hot
    target_probs: torch.Tensor,  # [k+1, V], rows sum to 1
    generator: torch.Generator | None,
) -> VerifyResult:
    """Exact speculative sampling of one sequence's draft tokens against the target's probabilities.

    A sampled proposal (``draft_probs`` given) draws exactly k uniforms and one token per call,
    whatever the outcome, so a seeded generator gives reproducible results. A deterministic one
    (``draft_probs`` None) and k = 0 (plain decoding) sample and match (module docstring).
    """
    k = _check_shapes(draft_tokens, draft_probs, target_probs, "target_probs")
    if draft_probs is None or k == 0:
        return sample_and_match(draft_tokens, target_probs, generator)
    vocab = target_probs.shape[-1]
    draft_probs = draft_probs.to(target_probs.dtype)

    positions = torch.arange(k, device=target_probs.device)  # [k]
    drafted = draft_tokens.to(target_probs.device)  # proposers build token ids on the CPU
    target_token_probs = target_probs[positions, drafted]  # [k]
    draft_token_probs = draft_probs[positions, drafted]  # [k]
    uniforms = torch.rand(
        k, generator=generator, device=target_probs.device, dtype=target_probs.dtype
    )  # [k], in [0, 1)
    # u < target / draft, multiplied out so that a zero draft probability cannot divide by zero.
    accepted = uniforms * draft_token_probs < target_token_probs  # [k] bool
    num_accepted = int(accepted.long().cumprod(dim=0).sum())  # length of the all-accepted prefix

    # Residual at the first rejection. A zero draft row appended at position k makes the same
    # formula give target_probs[k] there, the bonus token's distribution.
    draft_rows = torch.cat([draft_probs, draft_probs.new_zeros(1, vocab)])  # [k+1, V]
    residual = (target_probs[num_accepted] - draft_rows[num_accepted]).clamp_min(0.0)  # [V]
    mass = residual.sum()
    # The residual is all zeros only when the two rows agree up to rounding, where a rejection had
    # probability ~0; the target's own row is then the right distribution to fall back on.
    adjusted = torch.where(mass > 0, residual / mass, target_probs[num_accepted])  # [V]
    last_token = int(sample(adjusted, generator))

    tokens = [*draft_tokens[:num_accepted].tolist(), last_token]
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, num_drafted=k)


def sample_and_match(
    draft_tokens: torch.Tensor,  # [k] int64, a deterministic proposal
    target_probs: torch.Tensor,  # [k+1, V]
    generator: torch.Generator | None,
) -> VerifyResult:
    """Sample the target's token at each position in order and keep the draft while it matches: one
    draw per committed token, as plain decoding spends them (module docstring)."""
    drafted = draft_tokens.tolist()
    tokens: list[int] = []
    for i in range(len(drafted) + 1):
        token = int(sample(target_probs[i], generator))
        tokens.append(token)
        if i == len(drafted) or token != drafted[i]:
            break
    return VerifyResult(tokens=tokens, num_accepted=len(tokens) - 1, num_drafted=len(drafted))


def greedy_verify(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k+1, V]
) -> VerifyResult:
    """Temperature 0: keep draft tokens while they equal the target's argmax, then add its argmax."""
    k = _check_shapes(draft_tokens, None, target_logits, "target_logits")
    target_choice = target_logits.argmax(dim=-1).to(draft_tokens.device)  # [k+1], beside the draft
    matches = draft_tokens == target_choice[:k]  # [k] bool
    num_accepted = int(matches.long().cumprod(dim=0).sum())
    tokens = [*draft_tokens[:num_accepted].tolist(), int(target_choice[num_accepted])]
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, num_drafted=k)


def verify_chain(
    draft: Draft,  # a chain (draft.is_chain): k draft tokens, each after the one before
    target_logits: torch.Tensor,  # [k+1, V], the target's logits after the context and each draft token
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Verify one sequence's chain: greedy when ``sampling.greedy``, exact rejection sampling otherwise.

    The target's logits go through the same :func:`logits_to_probs` transform the draft's
    probabilities must have come from; otherwise the output is not the target's distribution.
    """
    if not draft.is_chain:
        raise ValueError("verify_chain takes a chain; a tree goes to verispec.verify.tree.verify_tree")
    _check_shapes(draft.tokens, draft.probs, target_logits, "target_logits")
    if sampling.greedy:
        return greedy_verify(draft.tokens, target_logits)
    target_probs = logits_to_probs(target_logits, sampling)  # [k+1, V]
    return rejection_sample(draft.tokens, draft.probs, target_probs, generator)


def _check_shapes(
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, V] or None
    target: torch.Tensor,  # [k+1, V]
    target_name: str,
) -> int:
    """Raise a ValueError naming the mismatch; return k."""
    if draft_tokens.dim() != 1 or draft_tokens.dtype.is_floating_point or draft_tokens.is_complex():
        raise ValueError(
            f"draft_tokens must be a 1-D integer tensor, got {draft_tokens.dtype} {tuple(draft_tokens.shape)}"
        )
    k = int(draft_tokens.shape[0])
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(
            f"{target_name} must have shape [k+1, vocab] = [{k + 1}, vocab] for {k} draft tokens, "
            f"got {tuple(target.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target.shape[1]):
        raise ValueError(
            f"draft_probs must have shape [k, vocab] = [{k}, {target.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    return k
