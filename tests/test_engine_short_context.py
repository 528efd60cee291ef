"""A model with a short context (64 positions) speculates with every method, the adaptive depth
policy included: the start-up cost measurement must fit the model, and greedy output still equals
plain decoding, up to the end of the context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import verispec.engine.hooks
from tests.conftest import perturbed, tiny_llama
from verispec.config import DraftModelConfig, NgramConfig, SpecConfig
from verispec.costs import load_or_measure
from verispec.engine import SpecEngine
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.heads.vocab import VocabHead
from verispec.models.hf import HFCausalLM
from verispec.proposers import build_proposer
from verispec.proposers.base import Proposer
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.medusa import MedusaProposer

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 64
PROMPTS = [[5, 17, 42, 8, 9, 61, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]
METHODS = ["ngram", "draft", "medusa", "eagle"]


@pytest.fixture(scope="module")
def short_pair() -> tuple[HFCausalLM, HFCausalLM]:
    """The tiny target and draft of the other tests, with a context of CONTEXT positions."""
    target = HFCausalLM(tiny_llama(0, context=CONTEXT), name="tiny-short")
    return target, HFCausalLM(perturbed(target.model, 0.3, seed=1), name="tiny-short-draft")


@pytest.fixture
def measured_here(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine measures its costs as it does for a user, but caches them in a folder of this
    test's own (a file left from another run would skip the measurement under test)."""
    folder: Path = tmp_path_factory.mktemp("costs")
    monkeypatch.setattr(
        verispec.engine.hooks,
        "load_or_measure",
        lambda target, draft, cache_dir: load_or_measure(target, draft, folder, repeats=1),
    )


def proposer_for(method: str, spec: SpecConfig, target: HFCausalLM, draft: HFCausalLM) -> Proposer:
    """Prompt lookup and the draft model as configured; Medusa and EAGLE with random heads."""
    torch.manual_seed(3)
    if method == "medusa":
        heads = MedusaHeads(MedusaConfig(hidden_size=target.hidden_size, num_heads=2))
        for p in heads.parameters():
            p.data.normal_(0, 0.2)
        return MedusaProposer(heads, VocabHead(target, None), nodes=6, width=3)
    if method == "eagle":
        drafter = EagleDrafter(EagleConfig.for_target(target)).eval()
        embeddings = target.model.get_input_embeddings()
        return EagleProposer(drafter, VocabHead(target, None), embeddings, nodes=6, width=3)
    proposer = build_proposer(spec, target, draft)
    assert proposer is not None
    return proposer


@pytest.mark.parametrize("depth", ["adaptive", "fixed"])
@pytest.mark.parametrize("method", METHODS)
def test_a_short_context_model_speculates(short_pair, measured_here, method, depth):
    """Greedy output equals plain decoding, inside the context and up to its very end. Adaptive:
    the policy's costs were measured on this model (which may then find drafting not worth its
    cost on a target this small); fixed: drafts were verified, right up to the end."""
    target, draft = short_pair
    assert target.max_context == CONTEXT
    spec = SpecConfig(
        method=method,  # type: ignore[arg-type]
        num_speculative_tokens=4,
        ngram=NgramConfig(max_ngram=3, min_ngram=1),
        draft=DraftModelConfig(model="tiny" if method == "draft" else None),
        depth=depth,  # type: ignore[arg-type]
    )
    engine = SpecEngine(target, proposer_for(method, spec, target, draft), spec, draft=draft)
    plain = SpecEngine(target, None, SpecConfig())
    drafted = accepted = 0
    for max_new in (30, 100):
        want = [plain.generate(p, max_new_tokens=max_new).token_ids for p in PROMPTS]
        got = engine.generate_batch(PROMPTS, max_new_tokens=max_new)
        assert [g.token_ids for g in got] == want
        assert [len(w) for w in want] == [min(max_new, CONTEXT - len(p)) for p in PROMPTS]
        drafted += sum(g.stats.num_drafted for g in got)
        accepted += sum(g.stats.num_accepted for g in got)
    if depth == "adaptive":  # whether drafting pays is the measurement's call, noise included
        assert engine.costs is not None  # measured on this model, at its first decode step
    elif method in ("ngram", "draft"):  # not vacuous (random heads may miss every time)
        assert drafted > 0 and accepted > 0
