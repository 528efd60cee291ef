"""Typical acceptance (Medusa, Cai et al. 2024): a LOSSY alternative to exact verification.

**Lossy.** With temperature > 0 the output of typical acceptance does *not* follow the target's
distribution: a draft token is kept whenever the target finds it plausible enough, not with the
probability rejection sampling would give it. It trades fidelity for longer accepted runs (the
Medusa paper reports quality close to the target's on MT-bench). verispec's default is ``exact``;
``typical`` must be asked for (``--acceptance typical``). At temperature 0 it is not used: greedy
verification is already the most permissive exact rule, so greedy output still equals plain.

The rule, at a node whose target distribution (after temperature, top-k, top-p: the same
:func:`~verispec.sampling.logits_to_probs` transform as everywhere) is p, with entropy H(p):

    accept a candidate x  iff  p(x) > min(epsilon, delta * exp(-H(p)))

``epsilon`` is a hard threshold (a token with p(x) > epsilon is always plausible) and the entropy
term lowers the bar where the target itself is unsure. Defaults are those of Medusa's
``medusa_generate`` (``posterior_threshold`` = 0.09 as epsilon, ``posterior_alpha`` = 0.3 =
sqrt(epsilon) as delta). Over a tree, the accepted path is the longest path of accepted nodes (ties:
the larger sum of log p), as in Medusa; the step then adds one token sampled from the target's p
after that path.

Chains and trees take the same rule (a chain is a tree whose parents are i - 1). The engine picks
this verifier once, from :attr:`SpecConfig.acceptance <verispec.config.SpecConfig.acceptance>`
(:func:`verispec.verify.verifier.make_verifier`).
"""

from __future__ import annotations

import math

import torch

from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft, VerifyResult
from verispec.verify.tree import verify_tree

EPSILON = 0.09
"""Hard threshold: a candidate the target gives more than this is accepted (Medusa's
``posterior_threshold``)."""
DELTA = 0.3
"""Scale of the entropy-adaptive threshold ``delta * exp(-H(p))`` (Medusa's ``posterior_alpha``)."""


def threshold(p: torch.Tensor, epsilon: float = EPSILON, delta: float = DELTA) -> float:
    """``min(epsilon, delta * exp(-H(p)))`` for one distribution ``p [V]``."""
    p = p.double()
    nz = p[p > 0]
    entropy = float(-(nz * nz.log()).sum())
    return min(epsilon, delta * math.exp(-entropy))


def verify_typical(
    draft: Draft,
    target_logits: torch.Tensor,  # [N + 1, V]: row 0 after the root, row i + 1 after node i
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    *,
    epsilon: float = EPSILON,
    delta: float = DELTA,
) -> VerifyResult:
    """LOSSY at temperature > 0 (module docstring); exact greedy verification at temperature 0 (the
    greedy tree walk, which on a chain is :func:`~verispec.verify.rejection.greedy_verify`)."""
    if sampling.greedy:
        return verify_tree(draft, target_logits, sampling, generator)
    if target_logits.shape[0] != draft.size + 1:
        raise ValueError(f"need {draft.size + 1} rows of target logits for {draft.size} nodes")
    probs = logits_to_probs(target_logits, sampling).double()  # [N + 1, V]
    limits = [threshold(row, epsilon, delta) for row in probs]
    children = draft.children()
    tokens = draft.tokens.tolist()
    best: tuple[int, float, list[int]] = (0, 0.0, [])  # (length, log-likelihood, path)
    stack: list[tuple[int, float, list[int]]] = [(0, 0.0, [])]  # (row, log-likelihood, path)
    while stack:
        row, loglik, path = stack.pop()
        if (len(path), loglik) > best[:2]:
            best = (len(path), loglik, path)
        for c in children[row]:
            q = float(probs[row, tokens[c]])
            if q > limits[row]:
                stack.append((c + 1, loglik + math.log(q), [*path, c]))
    path = best[2]
    last_row = path[-1] + 1 if path else 0
    last = int(sample(probs[last_row].float(), generator))
    return VerifyResult([*(tokens[i] for i in path), last], len(path), draft.size, tuple(path))
