"""Statistics shared by the exactness tests: chi-square tests of counts against exact probabilities."""

from __future__ import annotations

import math

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square statistic of observed ``counts`` against ``probs``, and its p-value.

    Cells expected fewer than 5 times are pooled into one (the usual validity condition of the
    chi-square approximation); any count in a cell of probability 0 gives an infinite statistic.
    """
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs == 0].sum() > 0:
        return math.inf, 0.0
    expected = counts.sum() * probs
    big = expected >= 5
    small = ~big & (probs > 0)
    observed = torch.cat([counts[big], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[big], expected[small].sum().reshape(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    # The chi-square survival function is the regularised upper incomplete gamma function.
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))
    return statistic, p_value
