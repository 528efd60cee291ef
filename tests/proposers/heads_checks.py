"""Checks the Medusa, EAGLE and hybrid proposer tests share: all are learned tree drafters on the
target's hidden states, so all must be lossless against plain decoding, on the fp32 and the int8
path, must sample exactly the target's distribution, and must actually get trees accepted beyond
the first level."""

from __future__ import annotations

import copy
from collections.abc import Callable
from unittest.mock import patch

import pytest
import torch

from tests.conftest import tiny_llama
from tests.distribution import SEEDS, assert_follows_target, generate_all
from tests.training.tiny import trained
from verispec.config import SamplingConfig, SpecConfig
from verispec.engine import SeqState, SpecEngine
from verispec.heads.identity import identify
from verispec.heads.io import LoadedHeads
from verispec.models.hf import HFCausalLM
from verispec.models.int4 import cpu_supports_int4
from verispec.models.quant import quantize_int8_dynamic
from verispec.proposers.heads_base import HeadsProposer

PROMPTS = [[5, 17, 42, 8, 9, 61, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [77] * 3, [4]]
"""A varied prompt, a repetitive one, a constant one and a one-token one (nothing to draft from)."""

SAMPLINGS = [
    pytest.param(SamplingConfig(temperature=1.0), id="temperature-1"),
    pytest.param(SamplingConfig(temperature=1.0, top_k=4), id="top-k-4"),
]
"""The sampling settings the chi-square tests of EAGLE and eagle+ngram trees run under."""


def plain_outputs(model: HFCausalLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    plain = SpecEngine(model, None, SpecConfig())
    return [plain.generate(p, max_new_tokens=n).token_ids for p in prompts]


def mid_generation(engine: SpecEngine, prompt: list[int], steps: int) -> SeqState:
    """``engine``'s one sequence after ``steps`` steps on ``prompt``, still running (it asks for 30
    tokens): what the proposer holds mid-generation, to compare with the target's fresh view."""
    engine.add(engine.make_request(prompt, max_new_tokens=30))
    for _ in range(steps):
        engine.step()
    return engine.running[0]


def assert_greedy_equals_plain_with_deep_trees(engine: SpecEngine, n: int = 40) -> None:
    """Greedy output equals plain decoding one request at a time and batched, and the trees were
    accepted beyond depth 1 (so the check is not vacuous) and saved steps."""
    want = plain_outputs(engine.target, PROMPTS, n)
    alone = [engine.generate(p, max_new_tokens=n) for p in PROMPTS]
    batched = engine.generate_batch(PROMPTS, max_new_tokens=n)
    assert [g.token_ids for g in alone] == want
    assert [g.token_ids for g in batched] == want
    accepted_at = [
        sum(g.stats.accepted_at[i] for g in alone if len(g.stats.accepted_at) > i) for i in range(2)
    ]
    assert accepted_at[0] > 0 and accepted_at[1] > 0, accepted_at
    assert sum(g.stats.num_steps for g in alone) < sum(len(w) for w in want)


def assert_lossless_on_the_int8_path(
    proposer_cls: type[HeadsProposer],
    drafting_linear: Callable[[HeadsProposer], torch.nn.Module],
    k: int,
    nodes: int,
) -> None:
    """Heads trained on an int8 tiny target and loaded for it are quantized too (``drafting_linear``
    picks one of their Linears): int4 where the int4 kernel runs, else int8, their vocabulary head
    alike; either way greedy output equals plain decoding on that path, with drafts accepted."""
    int8_target = HFCausalLM(quantize_int8_dynamic(copy.deepcopy(tiny_llama(0))), name="tiny-int8")
    int8_target.quantization = "int8"
    module, _, _ = trained(int8_target, proposer_cls.kind)
    want = plain_outputs(int8_target, PROMPTS, 30)
    tree = {"nodes": nodes, "width": 3}
    for int4_here in (True, False) if cpu_supports_int4() else (False,):
        loaded = LoadedHeads(proposer_cls.kind, copy.deepcopy(module), identify(int8_target), None, tree)
        with patch("verispec.models.int4.cpu_supports_int4", return_value=int4_here):
            proposer = proposer_cls.from_loaded(loaded, int8_target)
        linear = "Int4Linear" if int4_here else "RowwiseInt8Linear"
        assert type(drafting_linear(proposer)).__name__ == linear
        assert type(proposer.vocab_head.linear).__name__ == linear
        spec = SpecConfig(method=proposer_cls.kind, num_speculative_tokens=k, depth="fixed")
        got = SpecEngine(int8_target, proposer, spec).generate_batch(PROMPTS, max_new_tokens=30)
        assert [g.token_ids for g in got] == want
        assert sum(g.stats.num_accepted for g in got) > 0


def assert_trees_sample_the_target(
    engine: SpecEngine, prefix_logits: list[torch.Tensor], sampling: SamplingConfig
) -> None:
    """One sequence per seed on the small-vocabulary target follows the target's joint distribution
    (:mod:`tests.distribution`), and not vacuously: the first two levels of the trees were each
    accepted sometimes and rejected sometimes."""
    tokens, totals = generate_all(engine, sampling, SEEDS)
    assert 0 < totals["accepted_at"][0] < totals["drafted_at"][0], totals
    assert 0 < totals["accepted_at"][1] < totals["drafted_at"][1], totals
    assert_follows_target(tokens, prefix_logits, sampling)
