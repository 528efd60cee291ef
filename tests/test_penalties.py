"""Penalties and logit bias: the per-row adjustment, request validation, and lossless greedy decoding.

The sampled case (the output follows the penalised target's distribution, chains and trees, with a
check that a wrong-context penalty is caught) is in tests/test_engine_distribution.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import PROMPTS, make_engine
from tests.tree_proposer import TopTwoTree
from verispec.config import SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.penalties import Penalties, adjust_logits
from verispec.types import Draft

STRONG = {
    "presence_penalty": 0.4,
    "frequency_penalty": 0.8,
    "repetition_penalty": 1.3,
    "logit_bias": {5: 2.0},
}


def one_row(logits: torch.Tensor, penalties: Penalties, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's rules for a single row whose context is ``prompt`` then ``output``, element by element."""
    out = logits.double().clone()
    for token, bias in penalties.logit_bias:
        out[token] += bias
    for token in range(out.shape[0]):
        count = output.count(token)
        if token in prompt or count:
            value = float(out[token])
            out[token] = value / penalties.repetition if value > 0 else value * penalties.repetition
        out[token] -= penalties.frequency * count + penalties.presence * (count > 0)
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        Penalties(presence=0.7, frequency=0.3, repetition=1.4, logit_bias=((3, 5.0), (9, -100.0))),
        Penalties(presence=-1.0, frequency=-0.5, repetition=0.8),
        Penalties(logit_bias=((0, 1.0),)),
    ],
)
def test_each_row_is_adjusted_for_its_own_context(penalties):
    gen = torch.Generator().manual_seed(0)
    vocab, prompt, output = 16, [1, 2, 2, 3], [3, 4, 4]
    tokens, parents = [4, 5, 4, 6, 1], [-1, 0, 1, -1, 3]  # a tree: 4-5-4 and 6-1
    logits = torch.randn(len(tokens) + 1, vocab, generator=gen) * 3
    got = adjust_logits(logits, penalties, prompt, output, tree(tokens, parents).row_paths())
    paths = [[], [4], [4, 5], [4, 5, 4], [6], [6, 1]]
    for row, path in enumerate(paths):
        torch.testing.assert_close(got[row].double(), one_row(logits[row], penalties, prompt, output + path))


def tree(tokens: list[int], parents: list[int]) -> Draft:
    return Draft(torch.tensor(tokens), torch.tensor(parents))


def test_paths():
    """A chain is the tree whose parents are i - 1: its row j comes after draft tokens 0..j-1."""
    assert Draft.chain(torch.tensor([7, 8])).row_paths() == [[], [7], [7, 8]]
    assert tree([7, 8], [-1, 0]).row_paths() == [[], [7], [7, 8]]
    assert tree([7, 8, 9], [-1, -1, 0]).row_paths() == [[], [7], [8], [7, 9]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be between"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"logit_bias": {3: 101.0}}, "logit_bias values must be between -100 and 100"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be >= 0"),
        ({"logit_bias": {10_000: 1.0}}, "logit_bias names token id 10000, but the vocabulary has 96"),
    ],
)
def test_bad_penalties_are_refused(tiny_target, kwargs, message):
    engine = make_engine(tiny_target, None, None)
    with pytest.raises(VerispecError, match=message):
        engine.make_request(PROMPTS[0], **kwargs)


def test_default_penalties_change_nothing(tiny_target):
    engine = make_engine(tiny_target, None, None)
    request = engine.make_request(PROMPTS[0], repetition_penalty=1.0, presence_penalty=0.0, logit_bias={})
    assert request.penalties is None  # the fast path: no adjustment at all


MILD = {"frequency_penalty": 0.05, "logit_bias": {5: 1.0, 9: -1.0}}
"""Prompt lookup proposes repeats, which STRONG makes the target refuse every time."""


@pytest.mark.parametrize(("method", "penalties"), [("draft", STRONG), ("ngram", MILD), ("tree", STRONG)])
def test_greedy_speculation_with_penalties_equals_plain(tiny_target, tiny_draft, method, penalties):
    plain = make_engine(tiny_target, None, None)
    if method == "tree":
        spec = SpecEngine(tiny_target, TopTwoTree(tiny_draft), SpecConfig(method="draft", depth="fixed"))
    else:
        spec = make_engine(tiny_target, tiny_draft, method, k=4)
    drafted = accepted = changed = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=40, **penalties)
        got = spec.generate(prompt, max_new_tokens=40, **penalties)
        assert got.token_ids == want.token_ids
        changed += want.token_ids != plain.generate(prompt, max_new_tokens=40).token_ids
        drafted += got.stats.num_drafted
        accepted += got.stats.num_accepted
    assert changed > 0  # the penalties matter
    assert drafted > 0 and accepted > 0


def test_the_draft_model_drafts_with_the_penalties(tiny_target):
    """The target as its own draft: every draft is accepted only if the draft is penalised the same
    way, position by position, as the target's rows it is judged against."""
    spec = make_engine(tiny_target, tiny_target, "draft", k=4)
    gen = spec.generate(PROMPTS[0], max_new_tokens=30, **STRONG)
    assert gen.stats.num_drafted > 0 and gen.stats.num_accepted == gen.stats.num_drafted


def test_repetition_penalty_matches_transformers(tiny_target, tiny_draft):
    """An independent reference: transformers' own greedy ``generate`` with its repetition penalty."""
    spec = make_engine(tiny_target, tiny_draft, "draft", k=4)
    for prompt in PROMPTS:
        got = spec.generate(prompt, max_new_tokens=30, repetition_penalty=1.3)
        with torch.inference_mode():
            ids = tiny_target.model.generate(
                torch.tensor([prompt]),
                max_new_tokens=30,
                do_sample=False,
                repetition_penalty=1.3,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        assert got.token_ids == ids[0, len(prompt) :].tolist()
        assert got.stats.num_accepted > 0


def test_logit_bias_bans_and_forces(tiny_target, tiny_draft):
    spec = make_engine(tiny_target, tiny_draft, "draft", k=4)
    plain = spec.generate(PROMPTS[0], max_new_tokens=20).token_ids
    banned = spec.generate(PROMPTS[0], max_new_tokens=20, logit_bias={plain[0]: -100, plain[1]: -100})
    assert plain[0] not in banned.token_ids and plain[1] not in banned.token_ids
    forced = spec.generate(PROMPTS[0], max_new_tokens=20, logit_bias={11: 100}, temperature=1.0, seed=3)
    assert forced.token_ids == [11] * 20
