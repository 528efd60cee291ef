"""The engine with token trees: greedy output equals plain, and proposers get the right hidden states."""

from __future__ import annotations

import torch

from tests.tree_proposer import TopTwoTree
from verispec.config import SpecConfig
from verispec.engine import SpecEngine

PROMPTS = [[5, 17, 42, 8, 9, 61, 3], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [77] * 3]


def tree_engine(target, draft, k: int = 2) -> tuple[SpecEngine, TopTwoTree]:
    spec = SpecConfig(method="draft", num_speculative_tokens=k, depth="fixed")
    proposer = TopTwoTree(draft)
    return SpecEngine(target, proposer, spec), proposer


def test_greedy_tree_speculation_equals_plain_alone_and_batched(tiny_target, tiny_draft):
    plain = SpecEngine(tiny_target, None, SpecConfig())
    want = [plain.generate(p, max_new_tokens=30).token_ids for p in PROMPTS]
    engine, _ = tree_engine(tiny_target, tiny_draft)
    got = engine.generate_batch(PROMPTS, max_new_tokens=30)
    assert [g.token_ids for g in got] == want
    accepted = sum(g.stats.num_accepted for g in got)
    steps = sum(g.stats.num_steps for g in got)
    assert accepted > 0 and steps < 3 * 30  # trees were accepted, at depth up to 2


def test_the_proposer_receives_the_target_hidden_state_of_every_committed_position(tiny_target, tiny_draft):
    engine, _ = tree_engine(tiny_target, tiny_draft)
    request = engine.make_request(PROMPTS[1], max_new_tokens=20)
    engine.add(request)
    engine.step()  # admits and prefills, then decodes
    state = engine.running[0].proposer_state
    for _ in range(5):
        engine.step()
    seq = engine.running[0]
    received = torch.cat(state)  # prefill (prompt but last) + each step's pending and accepted rows
    ids = seq.token_ids[:-1]  # the last committed token has not been through the target yet
    assert received.shape[0] == len(ids)
    fresh = tiny_target.forward(
        torch.tensor([ids]), tiny_target.new_cache(), logits_to_keep=0, return_hidden=True
    )
    torch.testing.assert_close(received, fresh.hidden[0], rtol=1e-4, atol=1e-4)
