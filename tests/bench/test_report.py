"""report.md, results.json and the plots from a synthetic run: fast, no model, every section present."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from tests.bench.test_aggregate import counts, record
from verispec.bench.aggregate import summarize
from verispec.bench.contenders import Skipped
from verispec.bench.harness import BenchRun, check_lossless
from verispec.bench.plots import write_plots
from verispec.bench.records import PromptRecord, Turn
from verispec.bench.report import write_outputs
from verispec.bench.settings import BenchSettings


def synthetic_run() -> BenchRun:
    records = [
        record("none", "a", "1", [(3, 1.0)], counts([], [], 3)),
        record("none", "b", "2", [(3, 1.0), (2, 1.0)], counts([], [], 5)),
        record("ngram", "a", "1", [(3, 0.5)], counts([2, 1], [1, 0], 2)),
        PromptRecord(
            "ngram", "ds", "b", "2", [Turn(10, [0, 1, 9], 0.5, counts([3], [2], 1)), Turn(20, [0], 0.2)]
        ),
        record("hf", "a", "1", [(3, 2.0)]),
        record("hf", "b", "2", [(3, 1.0), (2, 1.0)]),
    ]
    check_lossless(
        records,
        [
            SimpleNamespace(name=n, references=r)
            for n, r in (("none", ()), ("ngram", ("none",)), ("hf", ("none",)))
        ],
    )
    return BenchRun(
        settings=BenchSettings(target="tiny", methods=("ngram",), baselines=("hf", "llamacpp")),
        command="verispec bench --target tiny",
        records=records,
        summaries=summarize(records),
        contenders={
            "none": {"backend": "verispec"},
            "ngram": {"backend": "verispec"},
            "hf": {"backend": "hf"},
        },
        skipped=[Skipped("llamacpp", "llama-cpp-python not installed (pip install verispec[llamacpp])")],
        models={"target": {"name": "tiny"}, "draft": None},
        environment={
            "machine": {
                "cpu": "cpu",
                "cores": 2,
                "load_average": [3.5, 2.0, 1.0],
                "load_average_end": [4.0, 3, 2],
            },
            "versions": {"python": "3"},
            "git_commit": None,
        },
        wall_seconds=1.5,
    )


def test_report_shows_tables_mismatches_skips_and_a_busy_machine(tmp_path):
    run = synthetic_run()
    plots = write_plots(run.summaries, tmp_path, title="tiny")
    assert [p.name for p in plots] == ["speedup.png", "tau.png", "acceptance_by_position.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in plots)
    results, report = write_outputs(run, tmp_path, plots)
    text = report.read_text()
    assert "verispec bench --target tiny" in text
    assert "**MISMATCH** ngram vs none on ds 2 (b): first differing token at output position 2" in text
    assert "**llamacpp**: llama-cpp-python not installed" in text
    assert "machine was busy" in text
    assert "![speedup](speedup.png)" in text
    data = json.loads(results.read_text())
    assert data["lossless"] == {"checked": 4, "mismatches": 1}
    assert data["git_commit"] is None
    assert len(data["records"]) == 6 and len(data["summary"]) == 9  # 3 methods x (2 categories + overall)


def test_the_busy_warning_goes_by_the_cpu_use_before_the_run_not_the_lagging_load_average(tmp_path):
    run = synthetic_run()
    quiet = dict(run.environment["machine"], cpu_busy=0.02)  # load average 3.5 from a run just ended
    busy = dict(run.environment["machine"], cpu_busy=0.9, load_average=[0.1, 0.1, 0.1])
    texts = []
    for machine, folder in ((quiet, "quiet"), (busy, "busy")):
        run.environment["machine"] = machine
        _, report = write_outputs(run, tmp_path / folder, [])
        texts.append(report.read_text())
    assert "machine was busy" not in texts[0] and "in the second before the run: 2%" in texts[0]
    assert "machine was busy before the run (other processes used 90% of its CPU time" in texts[1]


def test_cpu_busy_is_a_share_of_the_cpu_time_where_proc_stat_exists():
    from verispec.bench.environment import cpu_busy

    busy = cpu_busy(0.2)
    if not Path("/proc/stat").exists():
        assert busy is None
    else:
        assert busy is not None and 0.0 <= busy <= 1.0


def test_plots_are_written_without_any_speculative_method(tmp_path):
    run = synthetic_run()
    plain_only = [s for s in run.summaries if s.method == "none"]
    assert all(p.is_file() for p in write_plots(plain_only, tmp_path))
