"""Learned heads and prompt lookup drafting under a request's grammar and penalties.

The tiny random target with a real BPE tokenizer (tests/server/harness.py), heads trained on its own
greedy text (tests/training/tiny.py), EAGLE both over the full vocabulary and over a reduced draft
vocabulary (the rules' rows then go through the target's vocabulary and back). Each test checks
that drafts were proposed and accepted, so none passes vacuously.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.server.harness import tiny_pair
from tests.test_structured import PROMPT, REGEX, SCHEMA, assert_samples_follow_the_constrained_target, fits
from tests.training.tiny import trained
from verispec.config import NgramConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.heads.identity import identify
from verispec.heads.io import LoadedHeads
from verispec.models.hf import HFCausalLM
from verispec.proposers.base import Proposer
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.heads_base import HeadsProposer
from verispec.proposers.hybrid import HybridProposer
from verispec.proposers.medusa import MedusaProposer
from verispec.proposers.ngram import NgramProposer
from verispec.structured import Constraint, Structured
from verispec.types import Draft

pytestmark = pytest.mark.usefixtures("one_thread")

JSON = Structured("json", SCHEMA)
JSON_PROMPT = 'Like {"n": 12, "animal": "dog"}, '
"""A prompt with JSON in it, so that prompt lookup has something to draft from."""
METHODS = ["eagle", "eagle-vocab128", "medusa", "eagle+ngram", "ngram"]


@pytest.fixture(scope="module")
def target() -> HFCausalLM:
    return tiny_pair()[0]


def heads_proposer(target: HFCausalLM, name: str) -> HeadsProposer:
    kind = name.split("-")[0]
    vocab = 128 if name.endswith("vocab128") else 0
    module, draft_vocab, _ = trained(target, kind, draft_vocab=vocab)
    loaded = LoadedHeads(kind, module, identify(target), draft_vocab, {"nodes": 10, "width": 3})
    cls = EagleProposer if kind == "eagle" else MedusaProposer
    return cls.from_loaded(loaded, target)


def proposer(target: HFCausalLM, name: str) -> Proposer:
    lookup = NgramProposer(SpecConfig(ngram=NgramConfig(max_ngram=3, min_ngram=1)))
    if name == "ngram":
        return lookup
    if name == "eagle+ngram":
        return HybridProposer(heads_proposer(target, "eagle"), lookup)
    return heads_proposer(target, name)


def engine(target: HFCausalLM, name: str, k: int = 4) -> SpecEngine:
    method = name.split("-")[0]
    spec = SpecConfig(method=method, num_speculative_tokens=k, depth="fixed")  # type: ignore[arg-type]
    return SpecEngine(target, proposer(target, name), spec, tokenizer=target.tokenizer)


def record_drafts(spec: SpecEngine, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each path drafted for the one running request fitted its grammar when it was drafted
    (the matcher moves on once tokens are committed, so this is checked inside the proposal). Paths
    are cut after an end-of-sequence token: drafting past it is harmless (verification stops there)
    and a finished matcher accepts nothing more."""
    fitted: list[bool] = []
    proposer = spec.proposer
    assert proposer is not None
    original = proposer.propose_batch
    eos = set(spec.target.eos_token_ids)

    def spy(states, token_ids, ks, **kwargs):
        drafts = original(states, token_ids, ks, **kwargs)
        (seq,) = spec.running
        assert seq.rules is not None and seq.rules.constraint is not None
        for draft in drafts:
            paths = [p for p in drafted(draft) if not eos.intersection(p[:-1])]
            fitted.extend(seq.rules.constraint.fits(path) for path in paths)
        return drafts

    monkeypatch.setattr(proposer, "propose_batch", spy)
    return fitted


def drafted(draft: Draft) -> list[list[int]]:
    """Every path of a draft chain or tree, from its first token: the verification rows' paths
    (:meth:`Draft.row_paths`) without the root's empty one."""
    return draft.row_paths()[1:]


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize(
    ("structured", "prompt"), [(REGEX, PROMPT), (JSON, JSON_PROMPT)], ids=["regex", "json"]
)
def test_greedy_constrained_speculation_equals_plain(target, name, structured, prompt):
    spec = engine(target, name)
    got = spec.generate(prompt, max_new_tokens=60, structured=structured)
    want = spec.plain_engine().generate(prompt, max_new_tokens=60, structured=structured)
    assert got.token_ids == want.token_ids and fits(structured, got.text), got.text
    assert got.stats.num_accepted > 0


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize(
    ("structured", "prompt"), [(None, JSON_PROMPT), (JSON, JSON_PROMPT)], ids=["free", "json"]
)
def test_seeded_sampling_with_speculation_equals_seeded_plain_sampling(target, name, structured, prompt):
    """These proposers are deterministic, so verification samples the target's token and matches
    the drafts (verispec/verify/rejection.py): one draw per committed token, as plain decoding
    spends them, so the same seed gives the same sample with speculation as without."""
    spec = engine(target, name)
    kwargs = dict(max_new_tokens=60, temperature=0.4, top_k=50, seed=21, structured=structured)
    got = spec.generate(prompt, **kwargs)
    want = spec.plain_engine().generate(prompt, **kwargs)
    assert got.token_ids == want.token_ids and got.stats.num_accepted > 0
    greedy = spec.plain_engine().generate(prompt, max_new_tokens=60, structured=structured)
    assert got.token_ids != greedy.token_ids  # it sampled: a greedy-only equality would not count


@pytest.mark.parametrize("name", METHODS)
def test_drafts_stay_within_the_grammar(target, name, monkeypatch):
    spec = engine(target, name)
    fitted = record_drafts(spec, monkeypatch)
    got = spec.generate(JSON_PROMPT, max_new_tokens=60, structured=JSON)
    assert fitted and all(fitted) and got.stats.num_accepted > 0


@pytest.mark.parametrize("name", ["eagle", "medusa", "ngram"])
def test_told_nothing_of_the_grammar_drafts_leave_it(target, name, monkeypatch):
    """The power of the check above: the same proposers, not given the request's rules, draft
    paths the grammar forbids."""
    spec = engine(target, name)
    monkeypatch.setattr(spec.proposer, "constrain", lambda state, rules: None)
    fitted = record_drafts(spec, monkeypatch)
    spec.generate(JSON_PROMPT, max_new_tokens=60, structured=JSON)
    assert fitted and not all(fitted)


@pytest.mark.parametrize("name", ["eagle", "eagle-vocab128"])
def test_eagle_drafts_with_the_penalties(target, name, monkeypatch):
    """The token EAGLE drafts most often is banned by ``logit_bias`` (and a repetition penalty is
    on): it is never drafted, drafts are still accepted, and greedy output equals plain decoding's
    under the same penalties."""
    spec = engine(target, name)
    drafts = proposals(spec, monkeypatch)
    spec.generate(PROMPT, max_new_tokens=40)
    (banned, _), *_ = drafted_tokens(drafts).most_common(1)
    drafts.clear()
    rules = {"logit_bias": {banned: -100.0}, "repetition_penalty": 1.3}
    got = spec.generate(PROMPT, max_new_tokens=40, **rules)
    want = spec.plain_engine().generate(PROMPT, max_new_tokens=40, **rules)
    assert got.token_ids == want.token_ids and banned not in got.token_ids
    tokens = drafted_tokens(drafts)
    assert tokens and banned not in tokens and got.stats.num_accepted > 0


def proposals(spec: SpecEngine, monkeypatch: pytest.MonkeyPatch) -> list[Draft]:
    """Every draft the engine's proposer returns from now on, in order (a list the caller may clear)."""
    drafts: list[Draft] = []
    proposer = spec.proposer
    assert proposer is not None
    original = proposer.propose_batch

    def spy(states, token_ids, ks, **kwargs):
        out = original(states, token_ids, ks, **kwargs)
        drafts.extend(out)
        return out

    monkeypatch.setattr(proposer, "propose_batch", spy)
    return drafts


def drafted_tokens(drafts: list[Draft]) -> Counter[int]:
    return Counter(t for draft in drafts for t in draft.tokens.tolist())


def test_verification_reuses_the_masks_drafting_computed(target, monkeypatch):
    """EAGLE masks each expanded node's row for its path; verification needs the same rows' masks
    and takes them from the matcher's memory instead of computing them again."""
    spec = engine(target, "eagle")
    asked, computed = [0], [0]
    masks, mask_after = Constraint.masks, Constraint._mask_after

    def count_masks(self, row_paths):
        asked[0] += len(row_paths)
        return masks(self, row_paths)

    def count_computed(self, path):
        computed[0] += 1
        return mask_after(self, path)

    monkeypatch.setattr(Constraint, "masks", count_masks)
    monkeypatch.setattr(Constraint, "_mask_after", count_computed)
    got = spec.generate(JSON_PROMPT, max_new_tokens=60, structured=JSON)
    assert got.stats.num_drafted > 0
    assert 0 < computed[0] < asked[0] * 0.75, (computed, asked)


def test_eagle_under_a_grammar_samples_the_constrained_target(target, monkeypatch):
    """Sampling at temperature 1 with EAGLE drafting under the grammar: the sequences follow the
    exactly enumerated constrained target distribution (every outcome of a short grammar), forced
    tokens drafted with certainty included."""
    forced_found = count_forced(monkeypatch)
    assert_samples_follow_the_constrained_target(target, engine(target, "eagle", k=3))
    assert forced_found[0] > 0


def count_forced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times :meth:`Constraint.forced` finds forced tokens (to show a test exercised them)."""
    found, forced = [0], Constraint.forced

    def counting(self, path):
        out = forced(self, path)
        found[0] += bool(out)
        return out

    monkeypatch.setattr(Constraint, "forced", counting)
    return found


LONG_KEYS = Structured(
    "json",
    {
        "type": "object",
        "properties": {
            "zebra_quantity": {"type": "integer", "minimum": 0, "maximum": 99},
            "preferred_animal_of_the_week": {"enum": ["fox", "dog"]},
        },
        "required": ["zebra_quantity", "preferred_animal_of_the_week"],
        "additionalProperties": False,
    },
)
"""Key names no drafter here can guess (nor find in the prompt): the grammar forces them."""


@pytest.mark.parametrize("name", METHODS)
def test_forced_tokens_are_drafted_and_accepted(target, name, monkeypatch):
    """Drafting the grammar's forced tokens (a schema's key names) changes no output token and never
    lowers acceptance, against the same proposer not told what the grammar forces. Prompt lookup,
    which has nothing to look up here, drafts only because of them. (The heads gain nothing here:
    llguidance's mask allows only the forced tokens, which the tiny target's heads have in their
    vocabulary; the 1.5B's 8k-token draft vocabulary lacks most key names.)"""
    spec = engine(target, name)
    want = spec.plain_engine().generate(PROMPT, max_new_tokens=80, structured=LONG_KEYS)
    got = spec.generate(PROMPT, max_new_tokens=80, structured=LONG_KEYS)
    monkeypatch.setattr(Constraint, "forced", lambda self, path: [])
    blind = spec.generate(PROMPT, max_new_tokens=80, structured=LONG_KEYS)
    assert got.token_ids == want.token_ids == blind.token_ids
    assert set(json.loads(got.text)) == set(LONG_KEYS.spec["properties"]), got.text
    assert got.stats.num_accepted >= blind.stats.num_accepted, (got.stats, blind.stats)
    if name == "ngram":
        assert blind.stats.num_accepted == 0 and got.stats.num_accepted > 30


@pytest.mark.parametrize(
    "name", ["eagle", "eagle-vocab128", "medusa", "medusa-vocab128", "eagle+ngram", "ngram"]
)
def test_the_first_draft_under_a_schema_is_its_forced_opening(target, name, monkeypatch):
    """Before any output, a schema forces its opening and first key: the first draft holds exactly
    those tokens as its best path (the heads score them as certain), also where they are outside the
    heads' reduced vocabulary (the 128-token one here lacks ``"``)."""
    spec = engine(target, name, k=4)
    drafts = proposals(spec, monkeypatch)
    spec.generate(PROMPT, max_new_tokens=8, structured=LONG_KEYS)
    constraint = spec.plain_engine().requests.constraint(LONG_KEYS.grammar())
    opening = constraint.forced([])[:4]
    assert len(opening) == 4 and target.tokenizer.decode(opening).startswith('{"')
    first = drafts[0]
    assert first.tokens.tolist()[:4] == opening  # a tree lists its best nodes first: here one path
    if first.scores is not None:  # the heads' scored tree (prompt lookup drafts an unscored chain)
        assert first.parents.tolist()[:4] == [-1, 0, 1, 2]
        assert first.scores[:4].tolist() == [0.0] * 4
