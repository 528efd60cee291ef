"""The heads shipped with verispec: the manifest matches the files, and on the real SmolLM2-135M
(int8, as shipped and benchmarked) greedy output equals plain output with drafts accepted."""

from __future__ import annotations

import json

import pytest

from tests.conftest import needs_smollm2
from verispec.config import SpecConfig
from verispec.engine import SpecEngine
from verispec.heads.io import SHIPPED_DIR, file_sha256, read_config
from verispec.models import load_model
from verispec.proposers import build_proposer

SMOLLM2 = "smollm2-135m-instruct"
CHAT_PROMPTS = [
    "Write a Python function is_prime(n) with a docstring.",
    "Explain in two sentences what a hash map is.",
    "List three tips for writing clear emails.",
]


def test_the_manifest_matches_the_shipped_files():
    manifest = json.loads((SHIPPED_DIR / "MANIFEST.json").read_text())
    assert manifest["format"] == "verispec-heads" and manifest["heads"]
    for entry in manifest["heads"]:
        folder = SHIPPED_DIR / entry["path"]
        config = read_config(folder)
        assert config["kind"] == entry["kind"] and config["target"]["name"] == entry["target"]
        for name, info in entry["files"].items():
            assert (folder / name).stat().st_size == info["bytes"]
            assert file_sha256(folder / name) == info["sha256"], f"{entry['path']}/{name} changed"
        training = entry["training"]
        assert training["command"].startswith("verispec train ") and training["heldout_accuracy"]
        assert all(0 <= row["top1"] <= 1 for row in training["heldout_accuracy"])


@pytest.fixture(scope="module")
def smollm2():
    return load_model(SMOLLM2)


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_shipped_heads_on_smollm2_are_lossless_and_accepted(smollm2, method):
    spec = SpecConfig(method=method, num_speculative_tokens=4, depth="fixed")
    engine = SpecEngine(smollm2, build_proposer(spec, smollm2, None), spec, tokenizer=smollm2.tokenizer)
    plain = engine.plain_engine()
    accepted = drafted = 0
    for text in CHAT_PROMPTS:
        ids = engine.apply_chat_template([{"role": "user", "content": text}])
        want = plain.generate(ids, max_new_tokens=48)
        got = engine.generate(ids, max_new_tokens=48)
        assert got.token_ids == want.token_ids, text
        accepted += got.stats.num_accepted
        drafted += got.stats.num_steps
    assert accepted > drafted * 0.3, (accepted, drafted)  # well above nothing: trees pay off here
