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

The engine calls ``verify_tree``/``verify`` from :mod:`verispec.verify.tree` / :mod:`~verispec.verify`;
:func:`verify_tree` and :func:`verify` here take the same arguments plus ``acceptance`` and dispatch,
so the engine switches with its :attr:`SpecConfig.acceptance <verispec.config.SpecConfig.acceptance>`.
"""

from __future__ import annotations

import math

import torch

from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft, VerifyResult
from verispec.verify import rejection
from verispec.verify import tree as exact_tree
from verispec.verify.tree import DraftTree, TreeResult

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


def typical_verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,  # [N + 1, V]
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    *,
    epsilon: float = EPSILON,
    delta: float = DELTA,
) -> TreeResult:
    """LOSSY at temperature > 0 (module docstring); exact greedy verification at temperature 0."""
    if sampling.greedy:
        return exact_tree.verify_tree(tree, target_logits, sampling, generator)
    if target_logits.shape[0] != tree.size + 1:
        raise ValueError(f"need {tree.size + 1} rows of target logits for {tree.size} nodes")
    probs = logits_to_probs(target_logits, sampling).double()  # [N + 1, V]
    limits = [threshold(row, epsilon, delta) for row in probs]
    children = tree.children()
    tokens = tree.tokens.tolist()
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
    return TreeResult(tokens=[tokens[i] for i in path] + [last], path=path, num_drafted=tree.size)


def typical_verify(
    draft: Draft,
    target_logits: torch.Tensor,  # [k + 1, V]
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    *,
    epsilon: float = EPSILON,
    delta: float = DELTA,
) -> VerifyResult:
    """A chain draft under the typical rule: LOSSY at temperature > 0, greedy-exact at 0."""
    if sampling.greedy:
        return rejection.verify(draft, target_logits, sampling, generator)
    k = draft.k
    chain = DraftTree(draft.tokens, torch.arange(k, dtype=torch.long) - 1)
    result = typical_verify_tree(chain, target_logits, sampling, generator, epsilon=epsilon, delta=delta)
    return VerifyResult(tokens=result.tokens, num_accepted=result.num_accepted, num_drafted=k)


def _is_typical(acceptance: str) -> bool:
    if acceptance not in ("exact", "typical"):
        raise ValueError(f"acceptance must be exact or typical, got {acceptance!r}")
    return acceptance == "typical"


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    acceptance: str = "exact",
) -> TreeResult:
    """:func:`verispec.verify.tree.verify_tree` (``exact``) or :func:`typical_verify_tree`
    (``typical``, LOSSY)."""
    rule = typical_verify_tree if _is_typical(acceptance) else exact_tree.verify_tree
    return rule(tree, target_logits, sampling, generator)


def verify(
    draft: Draft,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    acceptance: str = "exact",
) -> VerifyResult:
    """:func:`verispec.verify.rejection.verify` (``exact``) or :func:`typical_verify` (``typical``, LOSSY)."""
    rule = typical_verify if _is_typical(acceptance) else rejection.verify
    return rule(draft, target_logits, sampling, generator)
