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
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens strictly before it already reach top_p; the first always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [..., vocab] -> [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat, num_samples=1, generator=generator).squeeze(-1)
    return tokens.reshape(probs.shape[:-1])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private random generator: seeded runs are reproducible and never disturb global RNG state."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
