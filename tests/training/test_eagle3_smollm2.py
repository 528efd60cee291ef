"""``verispec train eagle3`` then ``verispec export`` on the bundled SmolLM2-135M, end to end and small:
the trained folder drafts in ``verispec generate`` (greedy output equals plain) and exports to both
engines' formats, each of which reads back to the same drafter."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.conftest import needs_smollm2
from verispec.heads.speculators_io import load_eagle3

pytestmark = [needs_smollm2]

TARGET = "smollm2-135m-instruct"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True, timeout=900
    )


def test_train_eagle3_then_export_for_both_engines(tmp_path):
    trained = tmp_path / "smollm2-eagle3"
    out = cli(
        "train", "eagle3", "--target", TARGET, "--sources", "stdlib", "--max-tokens", "4000",
        "--epochs", "1", "--draft-vocab", "2048", "--intermediate-size", "256", "--batch-tokens", "512",
        "--unroll", "2", "--threads", "2", "--cache-dir", str(tmp_path / "cache"), "--out", str(trained),
        "--verifier-name", "HuggingFaceTB/SmolLM2-135M-Instruct",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    drafter, meta = load_eagle3(trained)
    assert meta.format == "speculators" and meta.verifier == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert drafter.config.draft_vocab_size == 2048 and not drafter.config.norm_before_residual
    assert json.loads((trained / "training.json").read_text())["heldout_accuracy"]

    gen = cli(
        "generate", "--target", TARGET, "--method", "eagle3", "--heads", str(trained), "-k", "3",
        "--depth-policy", "fixed", "--prompt", "def binary_search(items, x):", "--max-new-tokens", "32",
        "--json", "--compare-plain", "--threads", "2",
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    result = json.loads(gen.stdout)
    assert result["matches_plain"] is True and result["stats"]["drafted"] > 0

    for fmt in ("speculators", "sglang"):
        exported = cli("export", "--heads", str(trained), "--format", fmt, "--out", str(tmp_path / fmt))
        assert exported.returncode == 0, exported.stderr
        assert ("vllm serve" if fmt == "speculators" else "sglang.launch_server") in exported.stdout
        back, _ = load_eagle3(tmp_path / fmt)
        assert back.config == drafter.config
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(back.state_dict()[name], tensor), (fmt, name)
