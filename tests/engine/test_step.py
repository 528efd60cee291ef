"""A prompt's last chunk fed in the first decode forward: the same output, log-probabilities and draws
as a prefill forward of its own, the same hidden rows for a proposer that drafts from them, one
forward fewer, and only where nothing needs that prefill."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tests.conftest import perturbed, tiny_llama
from tests.training.tiny import trained
from tests.tree_proposer import TopTwoTree
from verispec.config import NgramConfig, SchedulerConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.engine.step import Step, VerifyRows
from verispec.heads.vocab import VocabHead
from verispec.models.base import BatchOutput
from verispec.models.hf import HFCausalLM
from verispec.models.kv import KVBuffer
from verispec.models.quant import quantize_model
from verispec.proposers import build_proposer
from verispec.proposers.eagle import EagleProposer
from verispec.types import Draft

PROMPTS = [list(range(5, 45)), [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3] * 7, [9, 8, 7] * 3]


class BlindTree(TopTwoTree):
    """:class:`TopTwoTree` without the target's hidden states: its trees may follow a prompt tail."""

    needs_hidden = False

    def update(
        self, state: list[torch.Tensor], token_ids: Sequence[int], num_accepted: int, hidden=None
    ) -> None:
        return None


class RecordingTree(TopTwoTree):
    """:class:`TopTwoTree` (which drafts with the target's hidden states handed on) keeping every
    sequence's list of hidden rows, to compare after the run."""

    def __init__(self, draft: HFCausalLM) -> None:
        super().__init__(draft)
        self.states: list[list[torch.Tensor]] = []

    def new_state(self, prompt_ids: Sequence[int], sampling: object) -> list[torch.Tensor]:
        self.states.append(super().new_state(prompt_ids, sampling))
        return self.states[-1]


class Forwards:
    """Counts a model's forwards and the rows each had (wraps its ``forward_batch``)."""

    def __init__(self, model: HFCausalLM) -> None:
        self.inner, self.rows = model.forward_batch, []

    def __call__(self, caches: list[KVBuffer], tokens: list[list[int]], **kwargs: object) -> BatchOutput:
        self.rows.append([len(t) for t in tokens])
        return self.inner(caches, tokens, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def int8_target() -> HFCausalLM:
    model = HFCausalLM(quantize_model(tiny_llama(3, context=1024), "int8"), name="tiny-int8")
    model.quantization = "int8"
    return model


def engine(target: HFCausalLM, method: str | None) -> SpecEngine:
    if method in ("tree", "hidden tree"):
        spec = SpecConfig(method="draft", num_speculative_tokens=2, depth="fixed")
        tree = BlindTree if method == "tree" else RecordingTree
        proposer = tree(HFCausalLM(perturbed(tiny_llama(3), 0.02, 5), name="tiny-d"))
    elif method == "eagle":
        spec = SpecConfig(method="eagle", num_speculative_tokens=3, depth="fixed")
        drafter, _, _ = trained(target, "eagle")
        embeddings = target.model.get_input_embeddings()
        proposer = EagleProposer(drafter, VocabHead(target, None), embeddings, nodes=6, width=2)
    else:
        spec = SpecConfig(method=method, num_speculative_tokens=3, ngram=NgramConfig(3, 1), depth="fixed")  # type: ignore[arg-type]
        proposer = build_proposer(spec, target, None)
    return SpecEngine(
        target, proposer, spec, scheduler=SchedulerConfig(prefix_cache_gb=0.0, prefill_chunk=32)
    )


def run(
    target: HFCausalLM, method: str | None, temperature: float, monkeypatch, joins: bool
) -> tuple[list, list, SpecEngine]:
    """Every prompt alone, then all of them batched; the outputs, the forwards' row counts and the engine."""
    forwards = Forwards(target)
    with monkeypatch.context() as patch:
        patch.setattr(target, "forward_batch", forwards)
        if not joins:
            patch.setattr(Step, "_tail_joins_decode", lambda self, seq: False)
        eng = engine(target, method)
        options = {"max_new_tokens": 16, "temperature": temperature, "seed": 5, "logprobs": 2}
        gens = [eng.generate(p, **options) for p in PROMPTS]
        gens += eng.generate_batch(PROMPTS, **options)
    return gens, forwards.rows, eng


@pytest.mark.parametrize("method", [None, "ngram", "tree", "hidden tree", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_last_prompt_chunk_in_the_decode_forward_changes_nothing_but_the_forwards(
    int8_target, method, temperature, monkeypatch
):
    assert int8_target.position_invariant
    if method == "eagle":
        trained(int8_target, "eagle")  # fitted (cached) before the forwards are counted
    joined, joined_rows, joined_engine = run(int8_target, method, temperature, monkeypatch, joins=True)
    apart, apart_rows, apart_engine = run(int8_target, method, temperature, monkeypatch, joins=False)
    for a, b in zip(joined, apart, strict=True):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.events] == [e.logprob for e in b.events]
        assert [e.top_logprobs for e in a.events] == [e.top_logprobs for e in b.events]
    if method is not None:  # drafts were verified (and, but for sampled lookups on random weights, kept)
        assert sum(g.stats.num_drafted for g in joined) > 0
        assert sum(g.stats.num_accepted for g in joined) > 0 or (method, temperature) == ("ngram", 1.0)
    if method == "hidden tree":  # the tail's hidden rows came out of the decode forward, as a prefill's
        got, want = joined_engine.proposer.states, apart_engine.proposer.states  # type: ignore[union-attr]
        assert len(got) == len(want) == 2 * len(PROMPTS)
        for g, w, prompt, gen in zip(got, want, PROMPTS * 2, joined, strict=True):
            fed = len(prompt) + len(gen.token_ids) - 1  # positions whose rows both must hold
            assert torch.equal(torch.cat(g)[:fed], torch.cat(w)[:fed])
    # alone, a prompt of 40 tokens is a 32-token chunk, then the other 7 with the first decode step
    # (the pending token and the draft after them), where a prefill forward of 7 came first
    assert len(joined_rows) < len(apart_rows)
    assert joined_rows[0] == apart_rows[0] == [32]
    assert joined_rows[1][0] >= 8 and apart_rows[1] == [7]


def test_a_tree_after_the_prompt_tail_sees_the_tail_causally_and_its_own_ancestors():
    draft = Draft(tokens=torch.tensor([11, 12, 13]), parents=torch.tensor([-1, -1, 0]))

    class Seq:  # what VerifyRows reads of a sequence
        def __init__(self) -> None:
            self.token_ids = [1, 2, 3, 4, 5]
            self.cache = KVBuffer()
            self.cache.advance(2)
            self.pending_position = 4

    rows = VerifyRows.of([Seq()], [draft])  # type: ignore[list-item]
    assert rows.starts == [4] and rows.cached == [2]
    assert rows.tokens == [[3, 4, 5, 11, 12, 13]]
    assert rows.positions == [[2, 3, 4, 5, 5, 6]]
    t, f = True, False
    want = [
        [t, f, f, f, f, f],
        [t, t, f, f, f, f],
        [t, t, t, f, f, f],  # the pending token
        [t, t, t, t, f, f],  # node 0
        [t, t, t, f, t, f],  # node 1, beside node 0
        [t, t, t, t, f, t],  # node 2, under node 0
    ]
    assert rows.masks is not None and rows.masks[0].tolist() == want


def test_only_a_position_invariant_target_with_nothing_waiting_on_the_prefill_takes_the_tail(
    tiny_target, tiny_draft, int8_target, monkeypatch
):
    def joins(target: HFCausalLM, method: str | None, draft: HFCausalLM | None = None, **options) -> bool:
        """Whether the first step fed the whole prompt in one forward, its decode forward."""
        spec = SpecConfig(
            method=method if method != "tree" else "draft", num_speculative_tokens=3, depth="fixed"
        )  # type: ignore[arg-type]
        proposer = build_proposer(spec, target, draft) if method != "tree" else TopTwoTree(tiny_draft)
        eng = SpecEngine(target, proposer, spec, draft=draft if method == "draft" else None)
        forwards = Forwards(target)
        with monkeypatch.context() as patch:
            patch.setattr(target, "forward_batch", forwards)
            eng.add(eng.make_request(PROMPTS[0], max_new_tokens=4, **options))
            eng.step()  # admitted, prefilled, a token out
        return len(forwards.rows) == 1

    assert not tiny_target.position_invariant
    assert not joins(tiny_target, None)  # float rows depend on their batch: a prefill of their own
    assert joins(int8_target, None) and joins(int8_target, "ngram") and joins(int8_target, "suffix")
    assert not joins(int8_target, None, prompt_logprobs=1)  # the prefill scores the prompt
    assert joins(int8_target, "tree")  # drafts from the hidden states: it sits the first step out
    quantized_draft = HFCausalLM(quantize_model(perturbed(tiny_llama(3), 0.02, 5), "int8"), name="tiny-d8")
    quantized_draft.quantization = "int8"
    assert not joins(int8_target, "draft", quantized_draft)  # the draft is fed the prompt with it


def test_a_tail_rides_in_the_decode_forward_beside_a_sequence_that_decodes(int8_target, monkeypatch):
    """Rows are packed, not padded, so a new prompt's tail costs no forward of its own beside a
    decoding sequence either: the step runs one forward, and both get the tokens they get alone."""
    first, second = PROMPTS[2], PROMPTS[2][:7]
    alone = [engine(int8_target, None).generate(p, max_new_tokens=8).token_ids for p in (first, second)]
    eng = engine(int8_target, None)
    forwards = Forwards(int8_target)
    monkeypatch.setattr(int8_target, "forward_batch", forwards)
    requests = [eng.make_request(p, max_new_tokens=8) for p in (first, second)]
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    eng.add(requests[0])
    outputs = eng.step()
    assert forwards.rows == [[9]]  # alone: its 8 prompt tokens and its pending one in one forward
    eng.add(requests[1])
    outputs += eng.step()
    assert forwards.rows[1:] == [[1, 7]]  # beside it: its pending token, then the 6 + 1 of the new one
    while eng.has_work():
        outputs += eng.step()
    for out in outputs:
        got[out.request_id] += [e.token_id for e in out.events]
    assert [got[r.request_id] for r in requests] == alone
