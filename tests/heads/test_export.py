"""``verispec export``: EAGLE-3 drafters to the speculators and SGLang formats and back, Medusa heads
to vLLM's names (its forward recomputed from the written tensors gives verispec's logits), and
verispec's own EAGLE heads refused with the way forward."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY_VOCAB
from tests.proposers.test_eagle3 import counting_drafter, counting_target  # noqa: F401 - the fixture
from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.export import export_eagle3, export_vllm_medusa, serve_commands
from verispec.heads.identity import identify
from verispec.heads.io import save_heads
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.heads.speculators_io import load_eagle3
from verispec.heads.speculators_save import save_speculators
from verispec.heads.vocab import VocabHead


def test_eagle3_exports_to_both_engines_and_reads_back_unchanged(tmp_path, counting_target):  # noqa: F811
    drafter = counting_drafter(counting_target)
    save_speculators(drafter, tmp_path / "src", "tiny-counting")
    want = drafter.state_dict()
    for fmt in ("speculators", "sglang"):
        verifier = export_eagle3(tmp_path / "src", tmp_path / fmt, fmt, None, None)
        assert verifier == "tiny-counting"
        back, meta = load_eagle3(tmp_path / fmt)
        assert meta.format == ("speculators" if fmt == "speculators" else "research")
        assert back.config.aux_layer_ids == drafter.config.aux_layer_ids  # SGLang's ids converted back
        got = back.state_dict()
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
    assert any("vllm serve" in line for line in serve_commands("speculators", tmp_path / "x", "Org/Model"))
    assert any("--speculative-algorithm EAGLE3" in line for line in serve_commands("sglang", tmp_path, None))


def test_verispec_eagle_heads_are_refused_with_the_way_to_eagle3(tmp_path, counting_target):  # noqa: F811
    drafter = EagleDrafter(EagleConfig.for_target(counting_target))
    save_heads(tmp_path / "eagle", "eagle", drafter, identify(counting_target), None)
    with pytest.raises(VerispecError, match="verispec train eagle3"):
        export_eagle3(tmp_path / "eagle", tmp_path / "out", "speculators", None, None)


def test_medusa_heads_export_in_vllm_names_and_compute_verispec_s_logits(tmp_path, counting_target):  # noqa: F811
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, num_heads=3, num_layers=2))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    vocab = torch.tensor([t for t in range(TINY_VOCAB) if t % 4])
    save_heads(tmp_path / "medusa", "medusa", heads, identify(counting_target), vocab)
    steps = export_vllm_medusa(tmp_path / "medusa", counting_target, tmp_path / "vllm")
    assert steps == 3
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, 2)
    assert (config["vocab_size"], config["truncated_vocab_size"]) == (TINY_VOCAB, len(vocab))
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert torch.equal(tensors["token_map"], vocab)

    hidden = torch.randn(5, 64)
    saved = MedusaHeads(heads.config)
    saved.load_state_dict(
        {
            k: v.float()
            for k, v in load_file(str(tmp_path / "medusa" / "model.safetensors")).items()
            if k != "draft_vocab"
        }
    )
    want = VocabHead(counting_target, vocab)(saved(hidden))  # [5, 3, len(vocab)]: verispec's drafting
    for i in range(3):  # vLLM's Medusa forward, from the exported tensors alone
        x = hidden
        for j in range(2):
            linear = tensors[f"blocks.{i}.layers.{j}.weight"], tensors[f"blocks.{i}.layers.{j}.bias"]
            x = x + torch.nn.functional.silu(torch.nn.functional.linear(x, *linear))
        logits = x @ tensors[f"lm_heads.{i}.weight"].T
        torch.testing.assert_close(logits, want[:, i], rtol=1e-5, atol=1e-5)


def test_the_command_line_writes_a_folder_and_prints_how_to_serve_it(tmp_path, counting_target):  # noqa: F811
    save_speculators(counting_drafter(counting_target), tmp_path / "src", "Org/tiny-counting")
    out = subprocess.run(
        [sys.executable, "-m", "verispec.cli", "export", "--heads", str(tmp_path / "src"), "--format",
         "sglang", "--out", str(tmp_path / "sg")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--model-path Org/tiny-counting --speculative-algorithm EAGLE3" in out.stdout
    assert (tmp_path / "sg" / "config.json").is_file()
    again = subprocess.run(
        [sys.executable, "-m", "verispec.cli", "export", "--heads", str(tmp_path / "src"), "--format",
         "speculators", "--out", str(tmp_path / "sg")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 2 and "is not empty" in again.stderr


def test_sglang_export_refuses_options_sglang_does_not_compute(tmp_path, counting_target):  # noqa: F811
    save_speculators(counting_drafter(counting_target, norm_before_residual=True), tmp_path / "src", None)
    with pytest.raises(VerispecError, match="computes none of norm_before_residual"):
        export_eagle3(tmp_path / "src", tmp_path / "sg", "sglang", None, None)
    export_eagle3(tmp_path / "src", tmp_path / "spec", "speculators", None, None)  # vLLM computes them
