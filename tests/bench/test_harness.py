"""The benchmark end to end on SmolLM2-135M, its settings validation and the optional llama.cpp path.

The end-to-end test checks the shape of what a run writes (every field of results.json, report.md,
the PNGs) and its correctness guarantees (lossless greedy outputs, multi-turn conversations), never
timing values: those depend on the machine.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from types import SimpleNamespace

import pytest

from tests.bench.test_report import synthetic_run
from tests.conftest import needs_smollm2
from verispec.bench import llamacpp_baselines
from verispec.bench.aggregate import Summary, summarize
from verispec.bench.contenders import Skipped
from verispec.bench.datasets import BenchPrompt
from verispec.bench.harness import measure, resume_settings
from verispec.bench.records import RECORDS_FILE, RecordLog, Turn
from verispec.bench.report import write_outputs
from verispec.bench.settings import BenchSettings
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.heads.io import SHIPPED_DIR

TOP_LEVEL = {
    "schema", "created", "command", "machine", "versions", "git_commit", "settings", "models",
    "contenders", "skipped", "lossless", "wall_seconds", "resumed_records", "failed", "summary", "turns",
    "records",
}  # fmt: skip
MACHINE = {
    "cpu", "isa", "cores", "ram_gb", "torch_threads", "platform", "gpu", "load_average", "load_average_end",
    "cpu_busy",
}  # fmt: skip
VERSIONS = {"python", "torch", "transformers", "verispec", "llama-cpp-python"}
SETTINGS = {
    "target", "draft", "methods", "baselines", "num_speculative_tokens", "depth", "ngram", "heads",
    "tree_nodes", "tree_width", "prompt_lookup_tokens", "datasets", "categories", "limit_per_category",
    "seed", "data_dir", "max_new_tokens", "warmup", "json_schema", "load", "categories_by_dataset",
    "warmup_prompt", "decoding", "cache_scope",
}  # fmt: skip
RECORD = {
    "method", "dataset", "category", "prompt_id", "turns", "reference", "matches_reference", "first_mismatch",
    "error", "output_tokens", "seconds", "tokens_per_second",
}  # fmt: skip
TURN = {"prompt_tokens", "token_ids", "seconds", "counts", "text", "ttft", "cached_prompt_tokens"}
COUNTS = {
    "target_forward_passes", "committed", "drafted", "accepted", "drafted_at", "accepted_at",
    "draft_seconds", "verify_seconds",
}  # fmt: skip


# One thread: on a shared 2-core machine, two threads contending with other work run several times slower.
@pytest.mark.slow
@needs_smollm2
def test_bench_end_to_end_on_smollm2(tmp_path, capsys, restore_torch_threads):
    out = tmp_path / "results"
    argv = [
        "bench", "--target", "smollm2-135m-instruct", "--methods", "none,ngram", "-k", "4",
        "--baselines", "hf,llamacpp", "--dataset", "humaneval,spec_bench,mt_bench",
        "--categories", "qa,writing", "--limit", "2", "--max-new-tokens", "10", "--warmup", "1",
        "--threads", "1", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "ngram" in printed and "overall" in printed

    results = json.loads((out / "results.json").read_text())
    assert set(results) == TOP_LEVEL
    assert set(results["machine"]) == MACHINE and set(results["versions"]) == VERSIONS
    assert set(results["settings"]) == SETTINGS
    assert results["command"] == "verispec " + " ".join(argv)
    assert results["settings"]["categories_by_dataset"] == {
        "humaneval": None, "spec_bench": ["qa"], "mt_bench": ["writing"],
    }  # fmt: skip
    assert results["git_commit"] is None or len(results["git_commit"]) == 40
    assert set(results["contenders"]) == {"none", "ngram", "hf"} | (
        {"llamacpp"} if importlib.util.find_spec("llama_cpp") else set()
    )

    # Two prompts per dataset; every contender ran every prompt.
    records = results["records"]
    prompts = {(r["dataset"], r["category"], r["prompt_id"]) for r in records}
    assert sorted(p[:2] for p in prompts) == sorted(
        [("humaneval", "code")] * 2 + [("spec_bench", "qa")] * 2 + [("mt_bench", "writing")] * 2
    )
    assert len(records) == len(prompts) * len(results["contenders"])
    for r in records:
        assert set(r) == RECORD
        for turn in r["turns"]:
            assert set(turn) == TURN
            assert 1 <= len(turn["token_ids"]) <= 10
            if r["method"] in ("none", "ngram"):
                assert set(turn["counts"]) == COUNTS
            else:
                assert turn["counts"] is None

    # Multi-turn: turn 2 is asked after the model's own turn-1 answer (so its prompt holds it).
    mt = [r for r in records if r["dataset"] == "mt_bench"]
    assert mt and all(len(r["turns"]) == 2 for r in mt)
    for r in mt:
        first, second = r["turns"]
        assert second["prompt_tokens"] > first["prompt_tokens"] + len(first["token_ids"])

    # Lossless: greedy speculative output equals plain output; the hf baseline was checked too.
    ngram = [r for r in records if r["method"] == "ngram"]
    assert all(r["reference"] == "none" and r["matches_reference"] for r in ngram)
    assert all(r["matches_reference"] is not None for r in records if r["method"] == "hf")
    assert sum(t["counts"]["drafted"] for r in ngram for t in r["turns"]) > 0  # not vacuous

    # A summary per method x category (3 categories + overall), with every field.
    summary = results["summary"]
    assert {(s["method"], s["group"]) for s in summary} >= {
        (m, g) for m in ("none", "ngram", "hf")
        for g in ("humaneval/code", "spec_bench/qa", "mt_bench/writing", "overall")
    }  # fmt: skip
    assert all(set(s) == set(Summary.__dataclass_fields__) for s in summary)
    overall = {s["method"]: s for s in summary if s["group"] == "overall"}
    assert overall["none"]["speedup"] == pytest.approx(1.0)
    assert overall["ngram"]["acceptance_rate"] is not None
    assert len(overall["ngram"]["per_position_acceptance"]) <= 4
    assert set(overall["ngram"]["time_split"]) == {"draft", "verify", "other"}
    assert overall["ngram"]["lossless_mismatches"] == 0

    report = (out / "report.md").read_text()
    assert results["command"] in report
    assert "| method | category |" in report and "Lossless check" in report
    if importlib.util.find_spec("llama_cpp") is None:
        assert llamacpp_baselines.LLAMACPP_MISSING in report
        assert results["skipped"] == [{"name": "llamacpp", "reason": llamacpp_baselines.LLAMACPP_MISSING}]
    for name in ("speedup.png", "tau.png", "acceptance_by_position.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
        assert f"({name})" in report


def test_llamacpp_is_skipped_with_a_clear_note_when_not_installed(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a),
    )
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    settings = BenchSettings(target="smollm2-135m-instruct", baselines=("llamacpp", "llamacpp-pld"))
    for name in ("llamacpp", "llamacpp-pld"):
        got = llamacpp_baselines.llamacpp_contender(name, settings, target=None)  # type: ignore[arg-type]
        assert got == Skipped(name, "llama-cpp-python not installed (pip install verispec[llamacpp])")
    assert "llama_cpp" not in sys.modules  # checked without importing it


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": ("lookahead",)}, "unknown method"),
        ({"methods": ("draft",)}, "draft model"),
        ({"baselines": ("vllm",)}, "unknown baseline"),
        ({"datasets": ("gsm8k",)}, "unknown dataset"),
        ({"categories": ("poetry",)}, "valid categories"),
        ({"datasets": ("humaneval",), "categories": ("qa",)}, "in none of the datasets"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),  # the CLI names its flag
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"limit_per_category": 0}, "--limit"),
        ({"warmup": -1}, "--warmup"),
        ({"depth": "deep"}, "depth"),
        ({"tree_nodes": 0}, "tree_nodes"),
        ({"tree_width": 0}, "tree_width"),
        ({"heads": "/no/such/heads"}, "--heads /no/such/heads: no such folder"),
        ({"json_schema": [1]}, "--json-schema must be a JSON object"),
    ],
)
def test_settings_reject_bad_values_before_loading_anything(kwargs, message):
    with pytest.raises(VerispecError, match=message):
        BenchSettings(target="x", **kwargs)


def test_settings_put_plain_first_and_resolve_categories_per_dataset():
    settings = BenchSettings(
        target="x",
        methods=("ngram", "none", "ngram"),
        datasets=("humaneval", "spec_bench", "mt_bench"),
        categories=("qa", "mt_bench/writing", "mt_bench"),
    )
    assert settings.methods == ("none", "ngram")
    # A plain name goes to every dataset that has it; a dataset none of them names runs whole.
    assert settings.categories_by_dataset() == {
        "humaneval": None, "spec_bench": ["qa", "mt_bench"], "mt_bench": ["writing"],
    }  # fmt: skip


def test_cli_bench_reports_user_errors_in_one_line(capsys):
    assert main(["bench", "--target", "x", "--methods", "none,lookahead"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: unknown method lookahead") and "Traceback" not in err


def test_json_mode_refuses_raw_completion_prompts_and_unreadable_schemas(tmp_path, capsys):
    """Both fail in a second, before a model loads (the target named here does not exist)."""
    assert main(["bench", "--target", "x", "--json-schema", "object", "--dataset", "humaneval"]) == 2
    assert "--json-schema needs chat prompts, and humaneval is raw completion" in capsys.readouterr().err
    bad = tmp_path / "schema.json"
    bad.write_text("{not json")
    assert main(["bench", "--target", "x", "--json-schema", str(bad), "--dataset", "spec_bench"]) == 2
    assert f"--json-schema {bad}: not a readable JSON file" in capsys.readouterr().err


@needs_smollm2
def test_bench_json_mode_constrains_every_answer_and_stays_lossless(tmp_path, restore_torch_threads):
    """--json-schema: each user turn asks for the schema, every method's answer is JSON under it
    (compact, so it starts with the first key), equal to plain's, with drafts accepted; baselines
    are skipped with the reason."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = tmp_path / "results"
    argv = ["bench", "--target", "smollm2-135m-instruct", "--methods", "none,ngram,eagle", "-k", "4",
            "--baselines", "hf", "--json-schema", str(path), "--dataset", "spec_bench", "--categories", "qa",
            "--limit", "1", "--max-new-tokens", "24", "--warmup", "0", "--threads", "1",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["json_schema"] == schema
    assert results["skipped"] == [
        {"name": "hf", "reason": "JSON mode (--json-schema): no grammar-constrained decoding for it here"}
    ]
    records = results["records"]
    assert {r["method"] for r in records} == {"none", "ngram", "eagle"}
    assert all(t["text"].startswith('{"answer":"') for r in records for t in r["turns"])
    assert all(r["matches_reference"] for r in records if r["method"] != "none")
    assert sum(t["counts"]["accepted"] for r in records if r["method"] != "none" for t in r["turns"]) > 0
    assert "JSON mode" in (out / "report.md").read_text()


# ------------------------------------------------------------------ partial results survive a failure


class FakeContender:
    """Answers prompt "n" with n tokens in 0.1 s; raises ``fail[n]`` (an exception) on prompt n instead."""

    def __init__(self, name: str, fail: dict[int, BaseException] | None = None) -> None:
        self.name = name
        self.references = () if name == "none" else ("none",)
        self.description = {}
        self.fail = fail or {}
        self.calls: list[int] = []

    def generate(self, prompt_ids, max_new_tokens):
        n = prompt_ids[0]
        self.calls.append(n)
        if n in self.fail:
            raise self.fail[n]
        return Turn(prompt_tokens=1, token_ids=list(range(n)), seconds=0.1)


FAKE_PROMPTER = SimpleNamespace(
    ids=lambda history, chat: [int(history[-1]["content"])], text=lambda ids: "", user=lambda text: text
)
FAKE_PROMPTS = [BenchPrompt("ds", "c", str(n), [str(n)], chat=False) for n in (1, 2, 3)]
FAKE_SETTINGS = {"target": "fake", "max_new_tokens": 8}


def read_log(path):
    header, *lines = path.read_text().splitlines()
    return json.loads(header), [json.loads(line) for line in lines]


def test_a_failing_prompt_is_recorded_and_the_run_goes_on(tmp_path):
    too_long = VerispecError("the prompt has 9000 tokens but fake has a context of 512; shorten the prompt")
    contenders = [FakeContender("none", {2: too_long}), FakeContender("ngram", {2: too_long})]
    log, previous = RecordLog.start(tmp_path / RECORDS_FILE, FAKE_SETTINGS)
    records = measure(contenders, FAKE_PROMPTS, FAKE_PROMPTER, 8, progress=False, log=log)
    log.close()
    assert previous == [] and [(r.method, r.prompt_id, r.ok) for r in records] == [
        ("none", "1", True), ("ngram", "1", True), ("none", "2", False), ("ngram", "2", False),
        ("none", "3", True), ("ngram", "3", True),
    ]  # fmt: skip
    assert records[2].error == str(too_long) and records[2].turns == []
    header, lines = read_log(tmp_path / RECORDS_FILE)
    assert (
        header["settings"] == FAKE_SETTINGS and [line["error"] for line in lines][2:4] == [str(too_long)] * 2
    )

    # The report lists the failure and leaves it out of every table.
    run = synthetic_run()
    run.records += records
    run.summaries = summarize([r for r in run.records if r.ok])
    results, report = write_outputs(run, tmp_path, [])
    assert "## Failed generations" in report.read_text()
    assert "- **ngram** on ds 2 (c): the prompt has 9000 tokens" in report.read_text()
    failed = json.loads(results.read_text())["failed"]
    assert failed[0] == {
        "method": "none",
        "dataset": "ds",
        "category": "c",
        "prompt_id": "2",
        "error": str(too_long),
    }


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path, capsys):
    path = tmp_path / RECORDS_FILE
    first = [FakeContender("none"), FakeContender("ngram", {3: KeyboardInterrupt()})]
    log, _ = RecordLog.start(path, FAKE_SETTINGS)
    with pytest.raises(KeyboardInterrupt):
        measure(first, FAKE_PROMPTS, FAKE_PROMPTER, 8, progress=False, log=log)
    log.close()
    err = capsys.readouterr().err
    assert "5 generation(s) saved" in err and "with --resume to continue" in err
    _, lines = read_log(path)
    assert [(line["method"], line["prompt_id"]) for line in lines] == [
        ("none", "1"), ("ngram", "1"), ("none", "2"), ("ngram", "2"), ("none", "3"),
    ]  # fmt: skip
    with path.open("a") as f:  # a line cut short by the killed process
        f.write('{"method": "ngr')

    second = [FakeContender("none"), FakeContender("ngram")]
    log, previous = RecordLog.start(path, FAKE_SETTINGS, resume=True)
    new = measure(
        second, FAKE_PROMPTS, FAKE_PROMPTER, 8, progress=False, log=log, done={r.key for r in previous}
    )
    log.close()
    assert second[0].calls == [] and second[1].calls == [3]  # only the missing pair is measured
    assert len(previous) == 5 and [(r.method, r.prompt_id) for r in new] == [("ngram", "3")]
    _, lines = read_log(path)
    assert len(lines) == 6  # the cut line is gone, the new record appended


def test_resume_refuses_records_made_with_other_settings(tmp_path, capsys):
    path = tmp_path / RECORDS_FILE
    RecordLog.start(path, FAKE_SETTINGS)[0].close()
    with pytest.raises(VerispecError, match="max_new_tokens: 8 there, 16 now"):
        RecordLog.start(path, {**FAKE_SETTINGS, "max_new_tokens": 16}, resume=True)
    # Without --resume, an earlier run's records are set aside, not lost.
    RecordLog.start(path, {**FAKE_SETTINGS, "max_new_tokens": 16})[0].close()
    assert read_log(path.with_name(RECORDS_FILE + ".previous"))[0]["settings"] == FAKE_SETTINGS
    assert "records.jsonl.previous" in capsys.readouterr().err
    # Choosing other prompts or methods is not a different setting; measuring differently is.
    settings = BenchSettings(target="x", limit_per_category=2)
    other_selection = BenchSettings(target="x", methods=("none",), baselines=("hf",), datasets=("mt_bench",))
    assert resume_settings(settings) == resume_settings(other_selection)
    assert resume_settings(settings) != resume_settings(BenchSettings(target="x", num_speculative_tokens=3))


@pytest.mark.slow
@needs_smollm2
def test_cli_resume_continues_a_smaller_run(tmp_path, capsys, restore_torch_threads):
    out = tmp_path / "results"
    argv = ["bench", "--target", "smollm2-135m-instruct", "--methods", "none,ngram", "-k", "3",
            "--dataset", "humaneval", "--max-new-tokens", "6", "--warmup", "0", "--threads", "1",
            "--out", str(out)]  # fmt: skip
    assert main([*argv, "--limit", "1"]) == 0
    first = json.loads((out / "results.json").read_text())
    assert main([*argv, "--limit", "2", "--resume"]) == 0
    assert "resumed: 2 generation(s)" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["resumed_records"] == 2 and results["failed"] == []
    assert [(r["method"], r["prompt_id"]) for r in results["records"]] == [
        ("none", "HumanEval/0"), ("ngram", "HumanEval/0"), ("none", "HumanEval/1"), ("ngram", "HumanEval/1"),
    ]  # fmt: skip
    assert results["records"][:2] == first["records"]  # kept as measured, not measured again
    assert {s["group"]: s["prompts"] for s in results["summary"] if s["method"] == "ngram"} == {
        "humaneval/code": 2, "overall": 2,
    }  # fmt: skip
    assert len((out / RECORDS_FILE).read_text().splitlines()) == 1 + 4
    assert main([*argv, "--limit", "2", "--resume", "-k", "2"]) == 2
    assert "can't resume" in capsys.readouterr().err


@pytest.mark.slow
@needs_smollm2
def test_bench_with_the_adaptive_policy_runs_every_learned_method_losslessly(tmp_path, restore_torch_threads):
    """As the benchmark runs it by default: the depth policy picks each step's depth and tree size, for
    prompt lookup and the shipped Medusa and EAGLE heads alike; outputs stay equal to plain."""
    out = tmp_path / "results"
    argv = ["bench", "--target", "smollm2-135m-instruct", "--methods", "none,ngram,medusa,eagle",
            "-k", "4", "--depth-policy", "adaptive", "--dataset", "humaneval", "--limit", "2",
            "--max-new-tokens", "24", "--warmup", "0", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["depth"] == "adaptive"
    for method in ("ngram", "medusa", "eagle"):
        assert results["contenders"][method]["depth_policy"] == "adaptive"
        records = [r for r in results["records"] if r["method"] == method]
        assert len(records) == 2 and all(r["matches_reference"] for r in records), method
        assert sum(t["counts"]["drafted"] for r in records for t in r["turns"]) > 0, method  # it drafted
    assert results["failed"] == [] and results["lossless"] == {"checked": 6, "mismatches": 0}


def test_bench_tree_flags_set_the_eagle_tree_budget(tmp_path, restore_torch_threads):
    """--tree-nodes / --tree-width reach the heads' proposer: no step drafts more than the budget,
    and a larger budget drafts more per target pass."""
    per_pass = {}
    for nodes in (3, 12):
        out = tmp_path / f"results-{nodes}"
        argv = ["bench", "--target", "smollm2-135m-instruct", "--methods", "none,eagle", "-k", "4",
                "--tree-nodes", str(nodes), "--tree-width", "3", "--dataset", "humaneval", "--limit", "1",
                "--max-new-tokens", "16", "--warmup", "0", "--threads", "1", "--out", str(out)]  # fmt: skip
        assert main(argv) == 0
        results = json.loads((out / "results.json").read_text())
        assert (results["settings"]["tree_nodes"], results["settings"]["tree_width"]) == (nodes, 3)
        (record,) = [r for r in results["records"] if r["method"] == "eagle"]
        counts = record["turns"][0]["counts"]
        assert record["matches_reference"] and counts["drafted"] > 0
        assert counts["drafted"] <= nodes * counts["target_forward_passes"]
        per_pass[nodes] = counts["drafted"] / counts["target_forward_passes"]
        assert f"tree nodes {nodes}, tree width 3" in (out / "report.md").read_text()
    assert per_pass[12] > per_pass[3]


@needs_smollm2
def test_bench_heads_flag_benchmarks_heads_other_than_the_shipped_ones(tmp_path, restore_torch_threads):
    """--heads loads the given folder (here a copy of the shipped EAGLE heads, in a folder of its
    own kind), records it in results.json and the report, and stays lossless."""
    heads = tmp_path / "my-eagle"
    shutil.copytree(SHIPPED_DIR / "smollm2-135m-instruct" / "eagle", heads)
    out = tmp_path / "results"
    argv = ["bench", "--target", "smollm2-135m-instruct", "--methods", "none,eagle", "-k", "4",
            "--heads", str(heads), "--dataset", "humaneval", "--limit", "1",
            "--max-new-tokens", "12", "--warmup", "0", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["heads"] == str(heads)
    assert results["contenders"]["eagle"]["heads"]["heads"] == str(heads)
    (record,) = [r for r in results["records"] if r["method"] == "eagle"]
    assert record["matches_reference"] and record["turns"][0]["counts"]["drafted"] > 0
    assert f"heads: `{heads}`" in (out / "report.md").read_text()
