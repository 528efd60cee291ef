"""The evaluation prompts shipped in the package: upstream's files, licensed, in the wheel, and enough
for ``verispec bench`` with nothing beside the repository."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import verispec
from tests.conftest import needs_smollm2
from verispec.cli import main
from verispec.data import SHIPPED, ShippedName, dataset_dir, packaged_data_dir
from verispec.errors import VerispecError

REPO = Path(__file__).resolve().parents[2]

UPSTREAM_SHA256 = {
    "spec_bench/question.jsonl": "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04",
    "mt_bench/question.jsonl": "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    "humaneval/HumanEval.jsonl.gz": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
}
"""The checksums of the files as their projects publish them (each folder's README names the commit)."""

LICENSES: dict[ShippedName, str] = {
    "spec_bench": "Apache License",
    "mt_bench": "Apache License",
    "humaneval": "MIT License",
}


def test_each_dataset_is_upstreams_file_unchanged_with_its_license_and_source() -> None:
    """Shipping third-party prompts needs their license beside them, and the README's checksum is
    only worth something while the file is the one it describes."""
    assert {p.name for p in packaged_data_dir().iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        SHIPPED
    )
    for name, sha in UPSTREAM_SHA256.items():
        path = packaged_data_dir() / name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha, name
        readme = (path.parent / "README.md").read_text()
        assert sha in readme and "https://github.com/" in readme and "License" in readme, name
    for name, license_name in LICENSES.items():
        assert license_name in (dataset_dir(name) / "LICENSE").read_text(), name


def test_dataset_dir_is_inside_the_installed_package_and_refuses_unknown_names() -> None:
    package = Path(verispec.__file__).resolve().parent
    assert dataset_dir("humaneval").resolve() == package / "data" / "humaneval"
    with pytest.raises(VerispecError, match="spec_bench, mt_bench, humaneval"):
        dataset_dir("gsm8k")  # type: ignore[arg-type]


def test_package_data_globs_put_every_data_file_in_the_wheel() -> None:
    """The wheel holds what ``[tool.setuptools.package-data]`` matches (setuptools expands the
    patterns with glob, as here); a file added without a pattern would be missing from installs."""
    tomllib = pytest.importorskip("tomllib", reason="the standard library reads TOML from Python 3.11")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["verispec.data"]
    root = packaged_data_dir()
    matched = {p for pattern in patterns for p in root.glob(pattern)}
    shipped = {p for p in root.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert matched == shipped


def test_an_explicit_data_dir_still_overrides_the_packaged_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--data-dir is read instead of the package (here a missing folder, refused before a model loads)."""
    missing = tmp_path / "nowhere"
    assert main(["bench", "--target", "x", "--dataset", "humaneval", "--data-dir", str(missing)]) == 2
    assert f"benchmark data folder {missing} does not exist" in capsys.readouterr().err


# A subprocess, so that its audit hook (which cannot be removed) sees every file the CLI opens.
RUNNER = """
import json, os, sys
data_files = ("question.jsonl", "HumanEval.jsonl.gz")
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.endswith(data_files):
            opened.append(path)
sys.addaudithook(hook)
import verispec
from verispec.cli import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"verispec": verispec.__file__, "opened": opened}, f)
sys.exit(code)
"""


@pytest.mark.slow
@needs_smollm2
def test_bench_humaneval_runs_from_the_packaged_prompts_alone(tmp_path: Path) -> None:
    """``verispec bench --dataset humaneval`` as a user runs it: no --data-dir, no variable, from a
    folder of its own. Every prompt file it reads is inside this checkout's package, so a clone (or
    an install) with nothing beside it benchmarks the same prompts."""
    out = tmp_path / "results"
    opened_log = tmp_path / "opened.json"
    argv = ["bench", "--target", "smollm2-135m-instruct", "--methods", "none,ngram", "-k", "3",
            "--dataset", "humaneval", "--limit", "2", "--max-new-tokens", "6", "--warmup", "0",
            "--threads", "1", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VERISPEC_DATA_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(opened_log), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    log = json.loads(opened_log.read_text())
    package = REPO / "verispec"
    assert Path(log["verispec"]).resolve().is_relative_to(package)  # this checkout, not another copy
    assert log["opened"], "the prompts were never read"
    assert all(Path(p).resolve().is_relative_to(package / "data") for p in log["opened"]), log["opened"]

    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["data_dir"] is None
    prompts = {r["prompt_id"] for r in results["records"]}
    assert prompts == {"HumanEval/0", "HumanEval/1"}  # the file's first two problems, as --limit 2 takes
    ngram = [r for r in results["records"] if r["method"] == "ngram"]
    assert len(ngram) == 2 and all(r["matches_reference"] for r in ngram)  # lossless against plain
