"""SpecStats: the statistics of several choices of one request, combined."""

from __future__ import annotations

import pytest

from verispec.metrics import SpecStats


def test_choices_combine_counts_and_keep_the_longest_time():
    a, b = SpecStats(prompt_tokens=7), SpecStats(prompt_tokens=7)
    a.observe(3, 2)  # drafted 3, accepted 2: 3 tokens in one pass
    a.observe(1, 0)
    b.observe(2, 2)
    a.num_output_tokens, b.num_output_tokens = 4, 3
    a.total_seconds, b.total_seconds = 2.0, 1.0
    both = SpecStats.combined([a, b])
    assert (both.num_steps, both.num_drafted, both.num_accepted, both.num_output_tokens) == (3, 6, 4, 7)
    assert both.drafted_at == [3, 2, 1] and both.accepted_at == [2, 2, 0]
    assert both.prompt_tokens == 7 and both.total_seconds == 2.0
    assert both.mean_accepted_length == pytest.approx((3 + 1 + 3) / 3)
    assert both.tokens_per_second == pytest.approx(3.5)
    assert SpecStats.combined([a]).to_dict() == a.to_dict()
