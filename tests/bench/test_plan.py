"""``verispec plan``: the cost/acceptance model on synthetic curves, its CLI, and one real end to end run.

The synthetic cases pin the model's arithmetic (tau, the interpolated verify cost, the choice); the
end-to-end test runs ``bench forward`` and ``bench`` on SmolLM2 and plans from their files, checking
what is printed, never timing values.
"""

from __future__ import annotations

import json

import pytest

from tests.bench.test_aggregate import counts, record
from tests.conftest import needs_smollm2
from verispec.bench import plan as p
from verispec.cli import main
from verispec.errors import VerispecError


def curve(*points: tuple[int, float]) -> p.CostCurve:
    return p.CostCurve.from_points(points, model="tiny")


def free(alpha: float, name: str = "ngram") -> p.Method:
    return p.Method(name, p.Acceptance.constant(alpha))


def test_tau_and_step_time_match_a_hand_computed_case():
    acceptance = p.Acceptance((0.8, 0.5, 0.25), (1.0, 1.0, 1.0))
    # 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.25
    assert [p.expected_tau(acceptance, k) for k in range(4)] == pytest.approx([1.0, 1.8, 2.2, 2.3])
    # The same conditionals from raw counts: 10 steps, all drafting 3; 8, 4 and 1 accepted at positions 1..3.
    measured = p.Acceptance.from_counts([10, 10, 10], [8, 4, 1], passes=10)
    assert measured.conditional == pytest.approx((0.8, 0.5, 0.25)) and measured.reach == (1.0, 1.0, 1.0)
    assert p.expected_tau(measured, 3) == pytest.approx((10 + 8 + 4 + 1) / 10)  # committed / passes
    # Step: 3 draft tokens at 10 ms, then one target pass of k+1 = 4 tokens (130 ms).
    row = p.predict(
        p.Method("draft", measured, draft_ms_per_token=10.0), 3, curve((1, 100), (2, 110), (4, 130))
    )
    assert (row.draft_ms, row.verify_ms, row.step_ms) == pytest.approx((30.0, 130.0, 160.0))
    assert row.tokens_per_second == pytest.approx(1000 * 2.3 / 160)
    assert row.speedup == pytest.approx(row.tokens_per_second / 10.0)  # plain: 1000 / 100 ms


def test_steps_that_draft_nothing_or_less_are_cheaper_and_commit_less():
    # n-gram lookup: of 10 steps, 6 drafted position 1 (3 accepted), 3 drafted position 2 (1 accepted).
    acceptance = p.Acceptance.from_counts([6, 3], [3, 1], passes=10)
    assert acceptance.conditional == pytest.approx((0.5, 2 / 3)) and acceptance.reach == (0.6, 0.3)
    assert p.expected_tau(acceptance, 2) == pytest.approx(1.4)  # (10 + 3 + 1) / 10: the measured tau
    row = p.predict(p.Method("ngram", acceptance), 2, curve((1, 100), (2, 150), (3, 180)))
    # 4 steps verify 1 token, 3 verify 2, 3 verify 3.
    assert row.verify_ms == pytest.approx(0.4 * 100 + 0.3 * 150 + 0.3 * 180)
    # Past the measured positions: the last measured values, flagged.
    assert acceptance.at(5) == acceptance.at(2) and row.extrapolated_acceptance is False
    assert p.predict(p.Method("ngram", acceptance), 3, curve((1, 100), (4, 130))).extrapolated_acceptance


def test_memory_bound_curve_makes_deeper_k_pay():
    target = curve((1, 100), (2, 102), (4, 104), (8, 108), (16, 116))  # checking 16 tokens costs 1.16x
    plan = p.make_plan([free(0.8)], target, range(1, 17))
    assert plan.best is not None and plan.best.method == "ngram" and plan.best.k >= 8
    assert plan.best.speedup > 3
    text = p.explain(plan, target, [free(0.8)])
    assert "memory-bound" in text and f"use ngram with k={plan.best.k}" in text
    assert p.choice(plan) == f"ngram with k={plan.best.k}"
    assert "<- best" in p.plan_table(plan).splitlines()[2 + plan.best.k]  # header, rule, plain, k=1..


def test_compute_bound_curve_with_low_acceptance_means_no_speculation():
    target = curve((1, 100), (2, 200), (4, 400), (8, 800), (16, 1600))
    methods = [free(0.3), p.Method("draft", p.Acceptance.constant(0.3), draft_ms_per_token=20.0)]
    plan = p.make_plan(methods, target, range(1, 17))
    assert plan.best is None and p.choice(plan) == "no speculation"
    assert all(row.speedup < 1 for row in plan.rows)
    table = p.plan_table(plan)
    assert "<- best (no speculation)" in table.splitlines()[2]  # the plain row
    text = p.explain(plan, target, methods)
    assert "compute-bound" in text and "Use no speculation" in text and "20% of a target decode step" in text


def test_non_monotone_curve_is_interpolated_piecewise_and_extended_flat_not_down():
    target = curve((1, 100), (2, 160), (4, 150), (8, 180), (16, 170))
    assert [target.ms(n) for n in (1, 2, 3, 4, 6, 12, 16)] == pytest.approx(
        [100, 160, 155, 150, 165, 175, 170]
    )
    assert target.ms(17) == target.ms(30) == pytest.approx(170)  # the last segment falls: held flat
    plan = p.make_plan([free(1.0)], target, range(1, 17))
    assert [r.verify_ms for r in plan.rows[:3]] == pytest.approx([160, 155, 150])  # cost(k + 1)
    assert [r.extrapolated_cost for r in plan.rows] == [False] * 15 + [True]
    assert plan.best is not None and plan.best.k == 16  # everything accepted, flat cost: deepest wins
    rising = curve((1, 100), (2, 120))
    assert rising.ms(4) == pytest.approx(160)  # extended along the last slope


@pytest.mark.parametrize(
    "points", [[(2, 10.0), (4, 20.0)], [(1, 10.0)], [(1, 10.0), (1, 12.0)], [(1, 0), (2, 1)]]
)
def test_cost_curve_needs_k1_and_another_point(points):
    with pytest.raises(VerispecError, match="k=1"):
        p.CostCurve.from_points(points)


def test_assumed_acceptance_plans_ngram_and_draft_only_with_a_draft_cost():
    methods, notes = p.methods_from_results(None, alpha=0.7)
    assert [m.name for m in methods] == ["ngram"] and "no draft curve" in notes[0]
    methods, notes = p.methods_from_results(None, draft_ms_per_token=5.0, alpha=0.7)
    assert [(m.name, m.draft_ms_per_token) for m in methods] == [("ngram", 0.0), ("draft", 5.0)] and not notes
    with pytest.raises(VerispecError, match="--acceptance"):
        p.methods_from_results(None)
    with pytest.raises(VerispecError, match="between 0 and 1"):
        p.Acceptance.constant(1.5)


# ----------------------------------------------------------------- files: forward.json, results.json


def forward_json(points=((1, 80.0), (2, 90.0), (4, 110.0)), draft=None, model="tiny", threads=1) -> dict:
    def one(role, pts, name):
        return {"role": role, "model": name, "context": 8,
                "points": [{"k": k, "median_ms": ms, "ms": [ms]} for k, ms in pts]}  # fmt: skip

    curves = [one("target", points, model)] + ([one("draft", draft, "tiny-draft")] if draft else [])
    return {"schema": p.FORWARD_SCHEMA, "settings": {"context": 8, "threads": threads}, "curves": curves}


def results_json() -> dict:
    """Plain at 10 tok/s (100 ms per pass); ngram with k=2 at 20 tok/s, drafting in 4 of 5 steps."""
    ngram_counts = counts([4, 4], [3, 2], passes=5, draft_s=0.005)
    records = [
        record("none", "a", "1", [(10, 1.0)], counts([], [], 10)),
        record("ngram", "a", "1", [(10, 0.5)], ngram_counts),
        record("none", "b", "2", [(10, 1.0)], counts([], [], 10)),
        record("ngram", "b", "2", [(10, 0.5)], ngram_counts),
        record("hf", "b", "2", [(10, 0.9)]),  # a baseline: no counts, not planned
    ]
    failed = record("ngram", "b", "3", [])
    failed.error = "the prompt has 9000 tokens but tiny has a context of 512; shorten the prompt"
    return {
        "schema": p.RESULTS_SCHEMA,
        "settings": {"num_speculative_tokens": 2, "load": {"device": "cpu", "threads": 1}},
        "models": {"target": {"name": "tiny"}},
        "contenders": {"none": {"method": None}, "ngram": {"method": "ngram"}, "hf": {"backend": "hf"}},
        "records": [r.to_dict() for r in [*records, failed]],
    }


def test_prediction_is_checked_against_the_measured_run():
    target, _ = p.curves_from_forward(forward_json())
    results = results_json()
    methods, notes = p.methods_from_results(results)
    assert [m.name for m in methods] == ["ngram"] and not notes
    (ngram,) = methods
    assert ngram.acceptance.conditional == pytest.approx((0.75, 2 / 3)) and ngram.acceptance.reach == (
        0.8,
        0.8,
    )
    assert ngram.propose_ms_per_step == pytest.approx(1.0)  # 10 ms of lookups over 10 passes
    pairs = p.check(methods, target, p.measured_from_results(results))
    (plain, plain_run), (spec, spec_run) = pairs
    assert (plain.method, plain_run.tokens_per_second, plain_run.ms_per_step) == ("none", 10.0, 100.0)
    assert plain.tokens_per_second == pytest.approx(12.5)  # 1000 / 80 ms
    assert (spec.k, spec_run.tau) == (2, 2.0) and spec.tau == pytest.approx(2.0)
    # 1 ms lookup + 80 ms + 0.8 * (90 - 80) + 0.8 * (100 - 90) for the drafted positions.
    assert spec.step_ms == pytest.approx(97.0)
    assert spec_run.tokens_per_second == pytest.approx(20.0)
    table = p.check_table(pairs)
    assert "meas/pred" in table and f"{20.0 / spec.tokens_per_second:.2f}" in table and "0.80" in table
    # One category only; a group that is not there is named with the ones that are.
    (one,) = [m for m in p.measured_from_results(results, "ds/a") if m.method == "ngram"]
    assert one.tokens_per_second == pytest.approx(20.0)
    with pytest.raises(VerispecError, match="ds/a, ds/b, overall"):
        p.methods_from_results(results, "ds/c")


def test_warnings_when_cost_curve_and_run_differ():
    assert p.provenance_warnings(forward_json(), results_json()) == []
    warnings = p.provenance_warnings(forward_json(model="other", threads=2), results_json())
    assert warnings == [
        "the cost curve is of other but results.json's target is tiny",
        "threads: 2 for the cost curve, 1 for results.json",
    ]


def test_cli_plan_prints_table_choice_explanation_and_check(tmp_path, capsys):
    (tmp_path / "forward.json").write_text(json.dumps(forward_json(draft=[(1, 20.0), (2, 25.0)])))
    (tmp_path / "results.json").write_text(json.dumps(results_json()))
    argv = ["bench", "plan", "--forward", str(tmp_path / "forward.json"),
            "--results", str(tmp_path / "results.json"), "--max-k", "4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out[: out.index("best:")]
    assert "method  k" in table and "<- best" in table and table.count("\nngram ") == 4
    words = " ".join(out.split())  # the paragraph is wrapped
    assert "best: ngram with k=" in words and "forward pass is memory-bound (80.0 ms for 1 token" in words
    assert "prediction vs the measured run" in out and "meas/pred" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["choice"].startswith("ngram with k=") and len(data["rows"]) == 4
    assert [c["measured"]["method"] for c in data["check"]] == ["none", "ngram"]
    assert data["check"][0]["measured_over_predicted"] == pytest.approx(0.8)
    # Assumed acceptance with a draft curve: both methods planned, no measured run to check.
    assert main(["bench", "plan", "--forward", str(tmp_path / "forward.json"), "--acceptance", "0.6"]) == 0
    out = capsys.readouterr().out
    assert "\ndraft " in out and "20.0 ms per drafted token" in out and "measured run" not in out


def test_cli_plan_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "plan", "--forward", str(tmp_path / "missing.json"), "--acceptance", "0.5"]) == 2
    assert "write it with `verispec bench forward" in capsys.readouterr().err
    (tmp_path / "forward.json").write_text(json.dumps({"schema": "something else"}))
    assert main(["bench", "plan", "--forward", str(tmp_path / "forward.json"), "--acceptance", "0.5"]) == 2
    assert "not a forward.json" in capsys.readouterr().err


@pytest.mark.slow
@needs_smollm2
def test_plan_end_to_end_from_bench_forward_and_bench_on_smollm2(tmp_path, capsys, restore_torch_threads):
    out = str(tmp_path)
    model = ["--target", "smollm2-135m-instruct", "--threads", "1", "--out", out]
    assert main(["bench", "forward", *model, "--ks", "1,2,4", "--context", "16", "--repeats", "1"]) == 0
    assert main(["bench", *model, "--methods", "none,ngram", "-k", "3", "--dataset", "humaneval",
                 "--limit", "1", "--max-new-tokens", "12", "--warmup", "0"]) == 0  # fmt: skip
    capsys.readouterr()
    plan = ["bench", "plan", "--forward", f"{out}/forward.json", "--results", f"{out}/results.json"]
    assert main([*plan, "--max-k", "6"]) == 0
    printed = capsys.readouterr().out
    assert "cost curve: smollm2-135m-instruct" in printed and "best: " in printed
    assert printed[: printed.index("best:")].count("\nngram ") == 6
    assert "The target's forward pass is" in printed
    check = printed[printed.index("prediction vs the measured run") :]
    assert [line.split()[:2] for line in check.splitlines()[3:5]] == [["none", "-"], ["ngram", "3"]]
    assert main([*plan, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == 16 and not data["warnings"]
    assert [c["measured"]["k"] for c in data["check"]] == [0, 3]
    assert all(c["measured_over_predicted"] > 0 for c in data["check"])
