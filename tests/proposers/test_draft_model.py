"""The draft-model proposer: how it is fed a prompt and a backlog it has not seen."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_engine import make_engine
from verispec.config import DraftModelConfig, SamplingConfig, SpecConfig
from verispec.costs import Curve, StepCostModel
from verispec.engine import SpecEngine
from verispec.proposers import build_proposer

PROMPT = [(5 * i + 2) % 90 for i in range(45)]


@pytest.fixture
def draft_calls(tiny_draft: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """(row lengths, logits kept) of every forward the draft model runs."""
    calls: list[tuple[list[int], list[int]]] = []
    forward_batch = tiny_draft.forward_batch

    def spy(caches, tokens, *, logits_to_keep, **kwargs):
        calls.append(([len(t) for t in tokens], list(logits_to_keep)))
        return forward_batch(caches, tokens, logits_to_keep=logits_to_keep, **kwargs)

    monkeypatch.setattr(tiny_draft, "forward_batch", spy)
    return calls


def test_the_engine_prefills_the_draft_with_the_prompt(tiny_target, tiny_draft, draft_calls):
    """The draft is fed the prompt's prefill chunks as the target is (no logits kept), so its first
    proposal catches up on one token only; the output still equals plain decoding, and drafts were
    proposed and accepted."""
    want = make_engine(tiny_target, None, None).generate(PROMPT, max_new_tokens=30)
    got = make_engine(tiny_target, tiny_draft, "draft", k=4).generate(PROMPT, max_new_tokens=30)
    assert got.token_ids == want.token_ids
    assert got.stats.num_drafted > 0 and got.stats.num_accepted > 0
    assert draft_calls[0] == ([len(PROMPT) - 1], [0])
    assert draft_calls[1] == ([1], [1])
    assert all(max(lengths) <= 2 and all(keep) for lengths, keep in draft_calls[1:])


def adaptive_engine(target: Any, draft: Any, prefill_seconds: float) -> SpecEngine:
    """The adaptive policy on fixed costs: verification nearly free, a draft step a fifth of a
    target step, and a draft prefill of 45 tokens costing ``prefill_seconds``."""
    spec = SpecConfig(method="draft", num_speculative_tokens=4, draft=DraftModelConfig(model="tiny"))
    costs = StepCostModel(
        Curve((1, 64), (0.100, 0.110)),
        draft=Curve((1, 16), (0.020, 0.060)),
        draft_prefill=Curve((1, 45), (0.020, prefill_seconds)),
    )
    return SpecEngine(target, build_proposer(spec, target, draft), spec, draft=draft, costs=costs)


def test_the_adaptive_policy_feeds_the_prompt_only_to_a_draft_it_will_use(
    tiny_target, tiny_draft, draft_calls
):
    """Lazy draft prefill: with a dear draft prefill and 3 tokens to generate, the draft is never
    fed (it could not win the prefill back; a long RAG prompt with a short answer); with 60 tokens
    to generate it is fed the prompt's chunks as the target prefills them, then drafts. Both equal
    plain decoding."""
    plain = make_engine(tiny_target, None, None)
    short = adaptive_engine(tiny_target, tiny_draft, prefill_seconds=1.0).generate(PROMPT, max_new_tokens=3)
    assert short.token_ids == plain.generate(PROMPT, max_new_tokens=3).token_ids
    assert draft_calls == [] and short.stats.num_drafted == 0
    long = adaptive_engine(tiny_target, tiny_draft, prefill_seconds=1.0).generate(PROMPT, max_new_tokens=60)
    assert long.token_ids == plain.generate(PROMPT, max_new_tokens=60).token_ids
    assert draft_calls[0] == ([len(PROMPT) - 1], [0])  # the prompt, in the target's prefill step
    assert long.stats.num_drafted > 0 and long.stats.num_accepted > 0
    # A cheap prefill pays even over 3 tokens: fed and drafted.
    draft_calls.clear()
    cheap = adaptive_engine(tiny_target, tiny_draft, prefill_seconds=0.021).generate(PROMPT, max_new_tokens=3)
    assert draft_calls[0] == ([len(PROMPT) - 1], [0]) and cheap.stats.num_drafted > 0


def test_a_request_without_speculation_never_feeds_the_draft(tiny_target, tiny_draft, draft_calls):
    engine = make_engine(tiny_target, tiny_draft, "draft", k=4)
    want = make_engine(tiny_target, None, None).generate(PROMPT, max_new_tokens=12)
    assert engine.generate(PROMPT, max_new_tokens=12, num_speculative_tokens=0).token_ids == want.token_ids
    assert draft_calls == []


def test_a_long_backlog_is_fed_in_one_pass_keeping_no_logits(tiny_target, tiny_draft, draft_calls):
    """Tokens the draft never saw (here the whole prompt, as a proposer outside the engine gets it)
    go in one pass without logits, then drafting continues from the last of them."""
    engine = make_engine(tiny_target, tiny_draft, "draft", k=3)
    proposer = engine.proposer
    state = proposer.new_state(PROMPT, SamplingConfig())
    draft = proposer.propose_batch([state], [PROMPT], [3])[0]
    assert len(draft.tokens) == 3
    assert draft_calls[0] == ([len(PROMPT) - 1], [0])
    assert [c[0] for c in draft_calls[1:]] == [[1], [1], [1]]
    assert state.cache.length == len(PROMPT) + 2  # the last draft token is sampled, not fed


def test_a_step_without_a_proposal_keeps_the_prompt_the_draft_was_fed(tiny_target, tiny_draft):
    """Plain steps (the policy chose k = 0) must not trim the draft's cache: once they did, back to
    the last proposal's start, so a prompt fed at prefill was thrown away whenever the first step
    did not speculate, and the draft then had the whole prompt as a backlog."""
    engine = make_engine(tiny_target, tiny_draft, "draft", k=3)
    proposer = engine.proposer
    state = proposer.new_state(PROMPT, SamplingConfig())
    proposer.prefill_tokens([state], [PROMPT[:-1]])
    committed = [*PROMPT, 11]
    proposer.update(state, committed, 0)  # a plain step: no proposal
    assert state.cache.length == len(PROMPT) - 1
    assert proposer.backlog(state, committed) == 2
    draft = proposer.propose_batch([state], [committed], [3])[0]
    proposer.update(state, [*committed, int(draft.tokens[0])], 1)  # first draft token accepted
    assert state.cache.length == len(committed) + 1
