"""``verispec bench suffix-cost`` at small sizes: the synthetic outputs fill the cache to its
budget, the sequence's steps find matches in it, memory follows the budget, and the command prints
its table and writes its JSON."""

from __future__ import annotations

import json

import numpy as np

from verispec.bench.suffix_cost import PhraseBank, accepted_along, measure
from verispec.cli import main


def test_the_phrase_bank_repeats_phrases_with_perturbations() -> None:
    bank = PhraseBank(seed=1)
    outputs = bank.outputs(5000)
    assert 5000 - 800 <= sum(len(o) for o in outputs) <= 5000
    assert all(50 <= len(o) <= 800 for o in outputs[:-1])
    stream = np.concatenate(outputs)
    top = bank.phrases[0]  # the most frequent phrase recurs (Zipf)
    windows = np.lib.stride_tricks.sliding_window_view(stream, len(top))
    assert (windows == top).all(axis=1).sum() >= 3


def test_accepted_along_follows_the_tree_on_the_true_continuation() -> None:
    tokens, parents = [5, 6, 7, 8], [-1, -1, 1, 2]  # 5 | 6 -> 7 -> 8
    assert accepted_along(tokens, parents, [6, 7, 9]) == 2
    assert accepted_along(tokens, parents, [5, 7]) == 1
    assert accepted_along(tokens, parents, [4]) == 0


def test_measure_fills_the_cache_and_drafts_from_it() -> None:
    small, larger = measure(2_000, steps=40), measure(20_000, steps=40)
    for row, size in ((small, 2_000), (larger, 20_000)):
        assert size - 801 <= row.cache_tokens <= size  # the budget, filled with whole outputs
        assert row.index_bytes <= size * 80  # bounded by the budget, not by what was added
        assert row.drafted_per_step > 0 and row.propose_us > 0 and row.update_us > 0
    assert larger.index_bytes > 5 * small.index_bytes
    assert larger.outputs > small.outputs


def test_the_command_prints_a_table_and_writes_json(tmp_path, capsys) -> None:
    assert main(["bench", "suffix-cost", "--sizes", "2000,4e3", "--steps", "20", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if "propose us" in line)
    assert len(lines[header + 1 :]) == 2  # one row per size
    result = json.loads((tmp_path / "suffix_cost.json").read_text())
    assert result["schema"] == "verispec-bench-suffix-cost/1"
    assert [r["cache_tokens"] <= s for r, s in zip(result["rows"], (2000, 4000), strict=True)] == [True, True]
    assert result["machine"]["cpu"]
