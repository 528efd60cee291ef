"""Aggregation on synthetic records: Spec-Bench's means and speedups, pooled acceptance, lossless counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verispec.bench.aggregate import OVERALL, summarize
from verispec.bench.harness import check_lossless
from verispec.bench.records import PromptRecord, SpecCounts, Turn
from verispec.bench.report import table_rows, text_table


def record(method, category, pid, tokens_seconds, counts=None, dataset="ds") -> PromptRecord:
    """A record whose turns have (new tokens, seconds) as given; token ids are 0..n-1."""
    turns = [
        Turn(prompt_tokens=10, token_ids=list(range(n)), seconds=s, counts=counts) for n, s in tokens_seconds
    ]
    return PromptRecord(method=method, dataset=dataset, category=category, prompt_id=pid, turns=turns)


def counts(drafted_at, accepted_at, passes, draft_s=0.0, verify_s=0.0) -> SpecCounts:
    return SpecCounts(
        target_forward_passes=passes,
        committed=passes + sum(accepted_at),
        drafted=sum(drafted_at),
        accepted=sum(accepted_at),
        drafted_at=drafted_at,
        accepted_at=accepted_at,
        draft_seconds=draft_s,
        verify_seconds=verify_s,
    )


def by(summaries, method, group):
    (found,) = [s for s in summaries if s.method == method and s.group == group]
    return found


def test_tokens_per_second_is_mean_over_prompts_and_speedup_a_ratio_of_means():
    records = [
        # category a: plain 10 and 30 tok/s; ngram 20 and 40 tok/s
        record("none", "a", "1", [(10, 1.0)]),
        record("none", "a", "2", [(30, 1.0)]),
        record("ngram", "a", "1", [(10, 0.5)]),
        record("ngram", "a", "2", [(40, 1.0)]),
        # category b: one prompt; plain 5 tok/s, ngram 10 tok/s
        record("none", "b", "3", [(5, 1.0)]),
        record("ngram", "b", "3", [(10, 1.0)]),
    ]
    summaries = summarize(records)
    assert [(s.method, s.group) for s in summaries] == [
        ("none", "ds/a"), ("none", "ds/b"), ("none", OVERALL),
        ("ngram", "ds/a"), ("ngram", "ds/b"), ("ngram", OVERALL),
    ]  # fmt: skip
    assert by(summaries, "none", "ds/a").tokens_per_second == pytest.approx(20.0)
    assert by(summaries, "ngram", "ds/a").tokens_per_second == pytest.approx(30.0)
    # Ratio of means (30 / 20), not mean of per-prompt ratios ((2 + 4/3) / 2 = 1.67).
    assert by(summaries, "ngram", "ds/a").speedup == pytest.approx(1.5)
    assert by(summaries, "ngram", "ds/b").speedup == pytest.approx(2.0)
    # Overall: the mean over all three prompts, not the mean of the two category means.
    assert by(summaries, "none", OVERALL).tokens_per_second == pytest.approx(15.0)
    assert by(summaries, "ngram", OVERALL).tokens_per_second == pytest.approx(70 / 3)
    assert by(summaries, "ngram", OVERALL).speedup == pytest.approx((70 / 3) / 15.0)
    assert by(summaries, "none", OVERALL).speedup == pytest.approx(1.0)
    assert by(summaries, "ngram", OVERALL).prompts == 3
    assert by(summaries, "ngram", OVERALL).output_tokens == 60


def test_multi_turn_prompt_speed_sums_tokens_and_time_over_turns():
    rec = record("none", "mt", "1", [(10, 1.0), (30, 3.0)])
    assert rec.output_tokens == 40 and rec.seconds == pytest.approx(4.0)
    assert rec.tokens_per_second == pytest.approx(10.0)
    assert summarize([rec])[0].tokens_per_second == pytest.approx(10.0)


def test_acceptance_and_tau_pool_the_counts_of_every_prompt():
    first = counts(drafted_at=[4, 2], accepted_at=[3, 1], passes=5, draft_s=0.1, verify_s=0.5)
    second = counts(drafted_at=[6], accepted_at=[0], passes=6, draft_s=0.2, verify_s=0.3)
    records = [
        record("none", "a", "1", [(5, 1.0)], counts(drafted_at=[], accepted_at=[], passes=5)),
        record("none", "a", "2", [(6, 1.0)], counts(drafted_at=[], accepted_at=[], passes=6)),
        record("ngram", "a", "1", [(9, 1.0)], first),
        record("ngram", "a", "2", [(6, 1.0)], second),
    ]
    summaries = summarize(records)
    ngram = by(summaries, "ngram", "ds/a")
    assert ngram.acceptance_rate == pytest.approx(4 / 12)  # (3 + 1 + 0) / (4 + 2 + 6)
    assert ngram.mean_accepted_length == pytest.approx((9 + 6) / 11)  # committed / passes
    assert ngram.per_position_acceptance == pytest.approx([3 / 10, 1 / 2])
    assert ngram.time_split == pytest.approx({"draft": 0.3, "verify": 0.8, "other": 0.9})
    plain = by(summaries, "none", "ds/a")
    assert plain.acceptance_rate is None  # nothing drafted: no rate, rather than a misleading 0%
    assert plain.mean_accepted_length == pytest.approx(1.0)


def test_baselines_without_counters_and_speedup_over_their_own_plain():
    records = [
        record("none", "a", "1", [(10, 1.0)], counts([], [], 10)),
        record("hf", "a", "1", [(10, 2.0)]),
        record("hf-pld", "a", "1", [(10, 1.0)]),
    ]
    contenders = [
        SimpleNamespace(name="none", references=()),
        SimpleNamespace(name="hf", references=("none",)),
        SimpleNamespace(name="hf-pld", references=("hf", "none")),
    ]
    check_lossless(records, contenders)
    assert [r.reference for r in records] == [None, "none", "hf"]
    summaries = summarize(records)
    pld = by(summaries, "hf-pld", OVERALL)
    assert pld.acceptance_rate is None and pld.mean_accepted_length is None and pld.time_split is None
    assert pld.speedup == pytest.approx(1.0)
    assert pld.reference == "hf"
    assert pld.speedup_over_reference == pytest.approx(2.0)
    assert by(summaries, "hf", OVERALL).speedup_over_reference is None  # its reference is none itself


def test_lossless_reference_falls_back_when_the_preferred_one_did_not_run():
    records = [record("none", "a", "1", [(3, 1.0)]), record("hf-pld", "a", "1", [(3, 1.0)])]
    check_lossless(records, [SimpleNamespace(name="none", references=()),
                             SimpleNamespace(name="hf-pld", references=("hf", "none"))])  # fmt: skip
    assert records[1].reference == "none" and records[1].matches_reference is True


@pytest.mark.parametrize(
    ("mine", "theirs", "first"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 9, 3], [1, 2, 3], 1),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3, 4], [1, 2, 3], 3),
    ],
)
def test_check_against_reports_the_first_differing_position(mine, theirs, first):
    rec = PromptRecord("ngram", "ds", "a", "1", [Turn(1, mine, 1.0)])
    rec.check_against(PromptRecord("none", "ds", "a", "1", [Turn(1, theirs, 1.0)]))
    assert rec.matches_reference is (first is None)
    assert rec.first_mismatch == first


def test_mismatches_are_counted_and_shown_per_category_and_overall():
    records = [
        record("none", "a", "1", [(3, 1.0)]),
        record("none", "b", "2", [(3, 1.0)]),
        record("ngram", "a", "1", [(3, 1.0)]),
        PromptRecord("ngram", "ds", "b", "2", [Turn(10, [0, 1, 7], 1.0)]),
    ]
    check_lossless(records, [SimpleNamespace(name="none", references=()),
                             SimpleNamespace(name="ngram", references=("none",))])  # fmt: skip
    summaries = summarize(records)
    assert by(summaries, "ngram", "ds/a").lossless_mismatches == 0
    assert by(summaries, "ngram", "ds/b").lossless_mismatches == 1
    overall = by(summaries, "ngram", OVERALL)
    assert (overall.lossless_checked, overall.lossless_mismatches) == (2, 1)
    assert by(summaries, "none", OVERALL).lossless_checked == 0
    table = text_table(table_rows(summaries))
    assert "1/2 DIFFER" in table and "ok 1/1" in table


def test_spec_counts_add_lists_of_different_lengths():
    total = counts([3, 2, 1], [2, 1, 0], 4) + counts([5], [4], 6)
    assert total.drafted_at == [8, 2, 1] and total.accepted_at == [6, 1, 0]
    assert total.target_forward_passes == 10 and total.drafted == 11 and total.accepted == 7


def test_record_round_trips_through_json_dict():
    rec = record("ngram", "a", "1", [(4, 0.5), (2, 0.25)], counts([2], [1], 3))
    rec.check_against(record("none", "a", "1", [(4, 0.5), (2, 0.25)]))
    again = PromptRecord.from_dict(rec.to_dict())
    assert again == rec
    assert rec.to_dict()["tokens_per_second"] == pytest.approx(8.0)
