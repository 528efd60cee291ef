"""Log-probabilities of committed tokens: the target's raw distribution at each position, the same
whether a token was drafted and accepted (in a chain or a tree) or decoded plainly."""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import PROMPTS, make_engine
from tests.tree_proposer import TopTwoTree
from verispec.config import MAX_LOGPROBS, SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.types import Generation


def reference(target, gen: Generation) -> torch.Tensor:
    """log_softmax of the target's logits before each generated token, from one fresh forward."""
    ids = gen.prompt_token_ids + gen.token_ids
    n = len(gen.token_ids)
    with torch.inference_mode():
        logits = target.forward(torch.tensor([ids[:-1]]), target.new_cache(), logits_to_keep=n).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check(target, gen: Generation, n: int) -> None:
    """Each event's logprob and alternatives against the reference forward."""
    want = reference(target, gen)
    assert len(gen.events) == len(gen.token_ids)
    for i, event in enumerate(gen.events):
        assert event.logprob == pytest.approx(float(want[i, event.token_id]), abs=1e-4)
        assert len(event.top_logprobs) == n
        top = want[i].topk(n)
        assert [t for t, _ in event.top_logprobs] == top.indices.tolist()
        values = [v for _, v in event.top_logprobs]
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), top.values, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_logprobs_are_the_targets_whether_drafted_or_not(tiny_target, tiny_draft, method):
    plain = make_engine(tiny_target, None, None)
    spec = make_engine(tiny_target, tiny_draft, method, k=4)
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=24, logprobs=3)
        got = spec.generate(prompt, max_new_tokens=24, logprobs=3)
        assert got.token_ids == want.token_ids
        check(tiny_target, got, 3)
        for a, b in zip(got.events, want.events, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        accepted += sum(e.from_draft for e in got.events)
        assert all(e.logprob <= e.top_logprobs[0][1] + 1e-6 for e in got.events)
    assert accepted > 0  # some of the checked tokens came from accepted drafts


def test_tree_verified_tokens_get_the_logprobs_of_their_own_path(tiny_target, tiny_draft):
    spec = SpecConfig(method="draft", num_speculative_tokens=2, depth="fixed")
    engine = SpecEngine(tiny_target, TopTwoTree(tiny_draft), spec)
    gens = engine.generate_batch(PROMPTS, max_new_tokens=20, logprobs=2)
    for gen in gens:
        check(tiny_target, gen, 2)
    assert sum(e.from_draft for g in gens for e in g.events) > 0


def test_sampled_tokens_get_their_raw_logprob(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft, "draft", k=3)
    gen = engine.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, top_k=20, seed=3, logprobs=0)
    want = reference(tiny_target, gen)
    for i, event in enumerate(gen.events):
        assert event.top_logprobs == ()
        assert event.logprob == pytest.approx(float(want[i, event.token_id]), abs=1e-4)
    assert sum(e.from_draft for e in gen.events) > 0


def test_no_logprobs_unless_asked_and_bad_counts_refused(tiny_target):
    engine = make_engine(tiny_target, None, None)
    gen = engine.generate(PROMPTS[0], max_new_tokens=4)
    assert all(e.logprob is None and e.top_logprobs == () for e in gen.events)
    for bad in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(VerispecError, match="logprobs must be between 0 and 20"):
            engine.make_request(PROMPTS[0], logprobs=bad)


def test_prompt_logprobs_score_every_prompt_token_across_prefill_chunks(tiny_target, tiny_draft):
    """A 45-token prompt prefilled in chunks of 16 beside a short one: each prompt token after the
    first gets the target's log-probability there, as one fresh forward over the prompt gives it."""
    from tests.test_engine_batch import engine_for

    engine = engine_for(tiny_target, tiny_draft, "draft", prefill_chunk=16)
    long = [(7 * i + 3) % 90 + 1 for i in range(45)]
    gens = engine.generate_batch([long, PROMPTS[2]], max_new_tokens=6, prompt_logprobs=2)
    for prompt, gen in zip([long, PROMPTS[2]], gens, strict=True):
        scores = gen.prompt_logprobs
        assert scores is not None and len(scores) == len(prompt) and scores[0] is None
        with torch.inference_mode():
            logits = tiny_target.forward(
                torch.tensor([prompt]), tiny_target.new_cache(), logits_to_keep=len(prompt)
            )
        want = torch.log_softmax(logits.logits[0].float(), dim=-1)
        for i, (logprob, top) in enumerate(scores[1:]):
            assert logprob == pytest.approx(float(want[i, prompt[i + 1]]), abs=1e-4)
            assert [t for t, _ in top] == want[i].topk(2).indices.tolist()
    assert engine.generate(PROMPTS[0], max_new_tokens=2).prompt_logprobs is None
    with pytest.raises(VerispecError, match="prompt_logprobs must be between 0 and 20"):
        engine.make_request(PROMPTS[0], prompt_logprobs=21)
