"""Logits to probabilities: one transform for the draft, the target and the bonus token.

Exactness of speculative sampling rests on the draft's and the target's probabilities being
produced by the same transform (temperature, then top-k, then top-p, the order transformers
uses). Temperature 0 is greedy and becomes a one-hot distribution on the argmax, so the general
rejection sampler reduces to greedy verification as well.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingConfig


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Turn logits into the sampling distribution.

    logits: [..., vocab] any float dtype. Returns float32 probabilities of the same shape whose last
    dimension sums to 1.
    """
    logits = logits.float()
    if cfg.greedy:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, top, 1.0)
    logits = logits / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        logits = logits.masked_fill(~_nucleus(logits, cfg.top_p, cfg.top_k), float("-inf"))
    return logits.softmax(dim=-1)


NUCLEUS_CANDIDATES = 256  # most likely tokens sorted first when looking for the top-p cut


def _nucleus(logits: torch.Tensor, top_p: float, top_k: int = 0) -> torch.Tensor:
    """[..., V] bool: the tokens top-p keeps, the most likely ones up to and including the first at
    which the mass reaches top_p (a token is dropped when the tokens strictly before it reach top_p;
    the first always stays).

    Why not sort the whole row: a 152k-token sort is ~10-40 ms a row on one core, paid for every
    verified row when sampling. The cut almost always falls among the few hundred most likely
    tokens, and a token past the sorted candidates is dropped exactly when the candidates' mass
    already reaches top_p; when it does not (a flat row), the search widens, up to the whole row.
    After top-k (``top_k`` > 0) the first top_k candidates hold all the mass unless the k-th
    logit is tied.
    """
    log_total = logits.logsumexp(dim=-1, keepdim=True)  # the whole row's softmax normaliser
    candidates = min(top_k or NUCLEUS_CANDIDATES, logits.shape[-1])
    while True:
        top, order = torch.topk(logits, candidates, dim=-1)  # sorted, most likely first
        probs = (top - log_total).double().exp()  # float64: a cut after thousands of tokens stays put
        mass = probs.cumsum(dim=-1)
        if candidates == logits.shape[-1] or bool((mass[..., -1] >= top_p).all()):
            break
        candidates = min(8 * candidates, logits.shape[-1])
    keep_sorted = (mass - probs) < top_p
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, keep_sorted)


SAMPLE_BLOCK = 1024  # tokens per block of the two-level search below


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of (possibly unnormalised) weights. probs: [..., vocab] -> [...] int64.

    Why not ``torch.multinomial``: one draw without replacement costs an exponential variate per
    token (3.6 ms on a 152k-token row on one core, paid up to k+1 times per step when verification
    samples the target at each position), and with replacement it takes a float64 cumulative sum of
    the whole row. This is inverse-CDF sampling in two levels, in float64 and with one uniform per
    draw: sums of blocks of SAMPLE_BLOCK tokens locate the block, a cumulative sum of that block alone
    the token (~0.3 ms). A zero-weight token is never drawn: the search takes the first cumulative
    sum strictly above the uniform, and a draw that rounding pushes past the last positive weight is
    moved back onto it.
    """
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    rows = flat.shape[0]
    pad = -vocab % SAMPLE_BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.reshape(rows, -1, SAMPLE_BLOCK)  # [R, nb, B]
    sums = blocks.sum(dim=-1, dtype=torch.float64)  # [R, nb]
    cum = sums.cumsum(dim=-1)
    total = cum[:, -1:]
    if not bool(((total > 0) & total.isfinite()).all()) or bool((flat < 0).any()):
        raise ValueError("cannot sample: a row's weights are all zero, negative or not finite")
    u = torch.rand(rows, 1, generator=generator, dtype=torch.float64, device=flat.device)
    point = u * total  # [R, 1], in [0, total)
    block = torch.searchsorted(cum, point, right=True).squeeze(-1).minimum(_last_positive(sums))
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    chosen = blocks[torch.arange(rows, device=flat.device), block]  # [R, B]
    inner = chosen.double().cumsum(dim=-1)
    offset = torch.searchsorted(inner, (point.squeeze(-1) - before).unsqueeze(-1), right=True).squeeze(-1)
    tokens = block * SAMPLE_BLOCK + offset.minimum(_last_positive(chosen))
    return tokens.reshape(probs.shape[:-1])


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """[R, n] -> [R]: index of each row's last positive entry (argmax returns the first maximum)."""
    return (weights > 0).cumsum(dim=-1).argmax(dim=-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private random generator: seeded runs are reproducible and never disturb global RNG state."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
