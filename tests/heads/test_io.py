"""Saving and loading heads: round trip, the target check, and the shipped-heads manifest."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_llama
from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.identity import identify
from verispec.heads.io import load_heads, resolve_heads_folder, save_heads, write_manifest
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.models.hf import HFCausalLM


def random_medusa() -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, num_heads=2))
    for p in heads.parameters():
        p.data.normal_(0, 0.1)
    return heads


def test_medusa_round_trip(tmp_path, tiny_target):
    heads = random_medusa()
    vocab = torch.tensor([4, 8, 15, 16, 23, 42])
    save_heads(tmp_path, "medusa", heads, identify(tiny_target), vocab, tree={"nodes": 9, "width": 2})
    loaded = load_heads(tmp_path, tiny_target, kind="medusa")
    assert loaded.kind == "medusa" and loaded.tree == {"nodes": 9, "width": 2}
    assert torch.equal(loaded.draft_vocab, vocab)
    h = torch.randn(3, 64)
    # Weights are stored as float16: equal to the original rounded to float16.
    for p in heads.parameters():
        p.data = p.data.half().float()
    torch.testing.assert_close(loaded.module(h), heads(h))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["format"] == "verispec-heads" and config["target"]["name"] == "tiny-target"
    assert config["draft_vocab_size"] == 6


def test_eagle_round_trip_without_a_draft_vocabulary(tmp_path, tiny_target):
    torch.manual_seed(1)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target, intermediate_size=32)).eval()
    save_heads(tmp_path, "eagle", drafter, identify(tiny_target), None)
    loaded = load_heads(tmp_path, tiny_target)
    assert loaded.kind == "eagle" and loaded.draft_vocab is None
    assert loaded.module.config == drafter.config
    assert set(loaded.module.state_dict()) == set(drafter.state_dict())


def test_eagle_feature_layers_round_trip(tmp_path, tiny_target):
    torch.manual_seed(2)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target, 32, feature_layers=(1,))).eval()
    with torch.no_grad():
        drafter.tap_fc.weight.normal_(0, 0.1)
    save_heads(tmp_path, "eagle", drafter, identify(tiny_target), None)
    assert json.loads((tmp_path / "config.json").read_text())["eagle"]["feature_layers"] == [1]
    loaded = load_heads(tmp_path, tiny_target)
    assert loaded.module.config == drafter.config and loaded.module.config.feature_layers == (1,)
    rows = torch.randn(4, 128)
    torch.testing.assert_close(loaded.module.fuse(rows), drafter.fuse(rows), rtol=1e-2, atol=1e-2)


def test_heads_for_another_target_are_refused(tmp_path, tiny_target):
    save_heads(tmp_path, "medusa", random_medusa(), identify(tiny_target), None)
    same_shape_other_weights = HFCausalLM(tiny_llama(7), name="other")
    with pytest.raises(VerispecError, match=r"trained for tiny-target, not for other.*embedding"):
        load_heads(tmp_path, same_shape_other_weights)
    other_vocab = HFCausalLM(tiny_llama(0, vocab=50), name="small-vocab")
    with pytest.raises(VerispecError, match="vocabulary 96 vs 50"):
        load_heads(tmp_path, other_vocab)
    with pytest.raises(VerispecError, match="holds medusa heads, not eagle"):
        load_heads(tmp_path, tiny_target, kind="eagle")


def test_the_same_model_in_bfloat16_is_still_recognised(tmp_path, tiny_target):
    save_heads(tmp_path, "medusa", random_medusa(), identify(tiny_target), None)
    bf16 = HFCausalLM(tiny_llama(0).to(torch.bfloat16), name="tiny-bf16")
    assert load_heads(tmp_path, bf16).kind == "medusa"


def test_broken_folders_give_clear_errors(tmp_path, tiny_target):
    with pytest.raises(VerispecError, match=r"missing config\.json"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(VerispecError, match="not valid JSON"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(VerispecError, match="not a verispec heads config"):
        load_heads(tmp_path)


def test_resolve_heads_folder(tmp_path, tiny_target):
    save_heads(tmp_path / "medusa", "medusa", random_medusa(), identify(tiny_target), None)
    assert resolve_heads_folder(tmp_path, "medusa", "x") == tmp_path / "medusa"
    assert resolve_heads_folder(tmp_path / "medusa", "medusa", "x") == tmp_path / "medusa"
    with pytest.raises(VerispecError, match="no eagle heads in"):
        resolve_heads_folder(tmp_path, "eagle", "x")
    with pytest.raises(VerispecError, match=r"no medusa heads are shipped for no-such-model.*verispec train"):
        resolve_heads_folder(None, "medusa", "no-such-model")


def test_manifest_lists_files_with_sha256(tmp_path, tiny_target):
    folder = tmp_path / "tiny-target" / "medusa"
    save_heads(folder, "medusa", random_medusa(), identify(tiny_target), None, training={"command": "x"})
    manifest = write_manifest(tmp_path)
    (entry,) = manifest["heads"]
    assert entry["path"] == "tiny-target/medusa" and entry["training"] == {"command": "x"}
    import hashlib

    weights = (folder / "model.safetensors").read_bytes()
    assert entry["files"]["model.safetensors"] == {
        "bytes": len(weights),
        "sha256": hashlib.sha256(weights).hexdigest(),
    }
    assert json.loads((tmp_path / "MANIFEST.json").read_text()) == manifest
