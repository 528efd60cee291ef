"""The draft-model proposer: how it is fed a prompt and a backlog it has not seen."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_engine import make_engine
from verispec.config import SamplingConfig

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
