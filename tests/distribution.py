"""The exact reference the engine's chi-square tests compare against (tests/test_engine_distribution.py
and the proposers' sampling tests): what the target alone samples after a fixed prompt.

The target is a tiny random Llama with a VOCAB-token vocabulary (the ``small_vocab_target`` fixture).
Each seed's sequence is one independent sample; the reference is exact: the target's joint
distribution of all LENGTH generated tokens after PROMPT, enumerated over every prefix with the
target run without any cache and through the same ``logits_to_probs`` transform. A chi-square test
compares each position's marginal, each pair of neighbouring tokens and the first three tokens'
joint with it.
"""

from __future__ import annotations

import itertools

import torch

from tests.stats import chi_square
from verispec.config import SamplingConfig
from verispec.engine import SpecEngine
from verispec.models.hf import HFCausalLM
from verispec.penalties import Penalties
from verispec.sampling import logits_to_probs

VOCAB = 12  # small enough to enumerate every continuation; lm_head x 8 gives ~1.9 nats per token
PROMPT = [3, 1, 4, 1, 5]
LENGTH = 5  # max_new_tokens; every generated token is checked (12^4 prefixes to enumerate)
SEEDS = range(1000)  # one sequence per seed (~5-12 ms each); the draft's seeds (seed + 0x5EED) are apart
ALPHA = 1e-3
# Significance level of each chi-square check. The seeds are fixed, so each check either always
# passes or always fails; ALPHA is the chance that an exact engine fails one check through bad
# luck of the seeds. Each correct-engine case makes 10 checks; the engine's own four make 40: a 4%
# chance in all that one would have needed reseeding (measured: every p-value above 0.04). A biased engine's
# statistic grows linearly with the number of sequences while the critical value stays put (31 for
# 11 degrees of freedom): with only 300 sequences the wrong verifier that keeps every draft scores
# chi-square ~200 (p ~ 1e-39) on the first token. The subtle one (a rejection recovers from the target
# instead of the residual) scores ~96 (p ~ 1e-16) on all 1000 sequences but 17.5, 44 and 43 on
# three slices of 300 of them (measured): at 300 it misses the critical value often enough to
# matter, so it gets all 1000.
# The reference runs the target without a cache, the engine with one: their logits differ by ~1e-6,
# which could move a token across a top-k/top-p boundary only in a row whose margin is that small
# (none of the few such rows is ever sampled here); a flip would show as a chi-square of inf.


def prefix_logits(target: HFCausalLM) -> list[torch.Tensor]:
    """logits[n]: [VOCAB**n, VOCAB], the target's logits after PROMPT + each n-token prefix.

    Prefixes are in lexicographic order, so row ``sum(t_i * VOCAB**(n-1-i))`` belongs to (t_1..t_n).
    Computed once, without a KV cache (a path independent of the engine's), for every sampling case.
    """
    logits = []
    with torch.inference_mode():
        for n in range(LENGTH):
            prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=n)), dtype=torch.long)
            prefixes = prefixes.reshape(VOCAB**n, n)  # [VOCAB**n, n]
            ids = torch.cat([torch.tensor(PROMPT).expand(VOCAB**n, -1), prefixes], dim=1)
            rows = [target.model(input_ids=part, logits_to_keep=1).logits[:, -1] for part in ids.split(4096)]
            logits.append(torch.cat(rows).float())
    return logits


def exact_joint(
    prefix_logits: list[torch.Tensor], sampling: SamplingConfig, penalties: Penalties | None = None
) -> torch.Tensor:
    """[VOCAB] * LENGTH: the probability that the target alone samples each sequence of LENGTH tokens,
    with ``penalties`` applied to each prefix's row as plain decoding would."""
    joint = torch.ones((), dtype=torch.float64)
    for n, logits in enumerate(prefix_logits):
        if penalties is not None:
            logits = penalized(logits, penalties, n)
        probs = logits_to_probs(logits, sampling).double()  # [VOCAB**n, VOCAB]
        joint = joint.unsqueeze(-1) * probs.reshape([VOCAB] * (n + 1))
    return joint


def penalized(logits: torch.Tensor, penalties: Penalties, n: int) -> torch.Tensor:
    """vLLM's rules written out for [VOCAB**n, VOCAB] rows after PROMPT and every n-token prefix:
    the reference, independent of :func:`verispec.penalties.adjust_logits` and its per-row paths."""
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=n)), dtype=torch.long)
    counts = torch.nn.functional.one_hot(prefixes.reshape(VOCAB**n, n), VOCAB).sum(dim=1).double()
    out = logits.double().clone()
    for token, bias in penalties.logit_bias:
        out[:, token] += bias
    seen = (counts > 0) | torch.isin(torch.arange(VOCAB), torch.tensor(PROMPT))
    rep = penalties.repetition
    out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    return out - penalties.frequency * counts - penalties.presence * (counts > 0).double()


def generate_all(
    engine: SpecEngine, sampling: SamplingConfig, seeds: range, penalties: Penalties | None = None
) -> tuple[torch.Tensor, dict]:
    """[len(seeds), LENGTH] generated tokens, one sequence per seed, and the summed acceptance stats."""
    extra = {}
    if penalties is not None:
        extra = {
            "presence_penalty": penalties.presence,
            "frequency_penalty": penalties.frequency,
            "repetition_penalty": penalties.repetition,
            "logit_bias": dict(penalties.logit_bias),
        }
    sequences = []
    totals = {"drafted": 0, "accepted": 0, "drafted_at": [0] * 8, "accepted_at": [0] * 8}
    for seed in seeds:
        gen = engine.generate(
            PROMPT,
            max_new_tokens=LENGTH,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
            **extra,
        )
        assert len(gen.token_ids) == LENGTH
        sequences.append(gen.token_ids)
        totals["drafted"] += gen.stats.num_drafted
        totals["accepted"] += gen.stats.num_accepted
        for i, (d, a) in enumerate(zip(gen.stats.drafted_at, gen.stats.accepted_at, strict=True)):
            totals["drafted_at"][i] += d
            totals["accepted_at"][i] += a
    return torch.tensor(sequences), totals


def distribution_checks(tokens: torch.Tensor, joint: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Chi-square (statistic, p-value) of each position's marginal, each pair of neighbouring tokens'
    joint and the first three tokens' joint, for [N, LENGTH] sampled ``tokens``."""
    checks = {}
    for group in [*((p,) for p in range(LENGTH)), *((p, p + 1) for p in range(LENGTH - 1)), (0, 1, 2)]:
        others = tuple(d for d in range(LENGTH) if d not in group)
        probs = joint.sum(dim=others) if others else joint  # [VOCAB] * len(group)
        cells = torch.zeros(len(tokens), dtype=torch.long)
        for position in group:
            cells = cells * VOCAB + tokens[:, position]
        counts = torch.bincount(cells, minlength=VOCAB ** len(group))
        checks["tokens " + ",".join(map(str, group))] = chi_square(counts, probs)
    return checks


def describe(checks: dict[str, tuple[float, float]]) -> str:
    return "; ".join(f"{name}: chi2 {stat:.1f} p {p:.2g}" for name, (stat, p) in checks.items())


def assert_follows_target(
    tokens: torch.Tensor,
    prefix_logits: list[torch.Tensor],
    sampling: SamplingConfig,
    penalties: Penalties | None = None,
) -> None:
    """Every chi-square check passes at ALPHA: the sampled ``tokens`` follow the target's own joint."""
    checks = distribution_checks(tokens, exact_joint(prefix_logits, sampling, penalties))
    failed = {name: result for name, result in checks.items() if result[1] <= ALPHA}
    assert not failed, describe(checks)
