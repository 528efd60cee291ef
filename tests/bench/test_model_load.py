"""``verispec bench load``: each side in its own process, its failures reported, never raised."""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import pytest

from verispec.bench import model_load as m
from verispec.bench.synthetic_gguf import LLAMA_SMALL, write_llama_gguf
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.models.registry import cache_root

NATIVE_LOADER = Path(m.__file__).parents[1] / "models" / "gguf_native.py"
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", shape=LLAMA_SMALL, seed=0)


@pytest.mark.skipif(not NATIVE_LOADER.exists(), reason="verispec's native GGUF loader is not in the tree yet")
def test_cli_measures_both_sides_of_the_small_file(small_gguf, tmp_path, monkeypatch, capsys):
    # Whatever the load caches stays in tmp_path, except the compiled kernels: those are shared with
    # the user's cache, as a fresh build of them would take a minute.
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["bench", "load", "--target", str(small_gguf), "--ks", "1,2", "--context", "16",
            "--repeats", "2", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "verispec" in printed and "k=2" in printed
    result = json.loads((out / "load.json").read_text())
    assert result["schema"] == m.SCHEMA and result["settings"]["quantization"] == "gguf"
    assert result["settings"]["target_bytes"] == small_gguf.stat().st_size
    sides = {side["side"]: side for side in result["sides"]}
    ours = sides["verispec"]
    assert ours["status"] == "ok", ours["reason"]
    assert ours["load_seconds"] > 0 and ours["first_forward_seconds"] > 0
    assert ours["peak_rss_mb"] >= ours["peak_rss_after_load_mb"] > 0 and ours["rss_after_load_mb"] > 0
    assert ours["logits_finite"] is True and ours["details"]["threads"] == 1
    assert ours["details"]["gguf_layers"] > 0  # the native path ran, not a de-quantized copy
    assert [p["k"] for p in ours["curve"]["points"]] == [1, 2]
    assert all(p["median_ms"] > 0 and len(p["ms"]) == 2 for p in ours["curve"]["points"])
    theirs = sides["llama.cpp"]
    if HAS_LLAMA_CPP:
        assert theirs["status"] == "ok", theirs["reason"]
        assert theirs["load_seconds"] > 0 and theirs["peak_rss_mb"] > 0 and theirs["logits_finite"] is True
        assert [p["k"] for p in theirs["curve"]["points"]] == [1, 2]
    else:
        assert theirs["status"] == "skipped" and "llama-cpp-python is not installed" in theirs["reason"]
        assert "llama.cpp skipped" in printed


def test_a_side_that_fails_is_reported_with_its_reason(tmp_path):
    not_gguf = tmp_path / "broken.gguf"
    not_gguf.write_bytes(b"this is not a gguf file")
    settings = m.LoadBenchSettings(target=not_gguf, threads=1, ks=(1,), repeats=1, sides=("verispec",))
    result = m.run_side("verispec", settings, tmp_path / "logs")
    assert result.status == "failed" and result.reason and result.peak_rss_mb > 0
    assert (tmp_path / "logs" / "load-verispec.log").exists()


def test_a_side_past_its_timeout_is_killed_and_reported(tmp_path, small_gguf):
    settings = m.LoadBenchSettings(target=small_gguf, threads=1, sides=("verispec",), timeout=0.5)
    result = m.run_side("verispec", settings, tmp_path)
    assert result.status == "failed" and "longer than" in result.reason
    assert result.wall_seconds < 30


def test_llama_cpp_side_is_skipped_with_the_reason_when_missing(tmp_path, small_gguf, monkeypatch):
    monkeypatch.setattr(m, "llamacpp_missing", lambda: "llama-cpp-python is not installed (...)")
    settings = m.LoadBenchSettings(target=small_gguf, threads=1)
    result = m.run_side("llama.cpp", settings, tmp_path)
    assert result.status == "skipped" and "not installed" in result.reason
    assert "llama.cpp skipped: llama-cpp-python is not installed" in m.load_table([result])


def test_tables_show_each_side_and_its_curve():
    points = [{"k": 1, "median_ms": 10.0, "ms": [10.0]}, {"k": 2, "median_ms": 12.0, "ms": [12.0]}]
    curve = {"role": "verispec", "model": "/x/m.gguf", "context": 128, "points": points}
    ok = m.SideResult("verispec", "ok", load_seconds=1.5, first_forward_seconds=2.0, peak_rss_mb=4096.0,
                      peak_rss_after_load_mb=4000.0, logits_finite=True, curve=curve,
                      details={"quantization": "gguf", "gguf_layers": 0})  # fmt: skip
    failed = m.SideResult("llama.cpp", "failed", reason="killed by signal 9 SIGKILL (out of memory?)")
    table = m.load_table([ok, failed])
    assert "4096" in table and "llama.cpp failed: killed by signal 9" in table
    assert "ran no GGUF layers" in table  # the load did not take the native path: said, not hidden
    costs = m.cost_table([ok, failed])
    assert costs is not None and "verispec: m.gguf" in costs and "1.20" in costs
    assert m.cost_table([failed]) is None


def test_exit_reasons():
    assert m._exit_reason(-signal.SIGKILL) == "killed by signal 9 SIGKILL (out of memory?)"
    assert m._exit_reason(3) == "exited with code 3"


def test_settings_and_flags_are_checked(tmp_path, capsys):
    with pytest.raises(VerispecError, match="--sides"):
        m.LoadBenchSettings(target=tmp_path, threads=1, sides=("vllm",))
    with pytest.raises(VerispecError, match=">= 1"):
        m.LoadBenchSettings(target=tmp_path, threads=1, ks=(0,))
    assert main(["bench", "load", "--out", str(tmp_path)]) == 2
    assert "--target FILE.gguf or --build-llama-8b" in capsys.readouterr().err
    other = ["--build-llama-8b", str(tmp_path / "b.gguf")]
    assert main(["bench", "load", "--target", str(tmp_path / "a.gguf"), *other]) == 2
    assert "same path" in capsys.readouterr().err
    assert not (tmp_path / "b.gguf").exists()
