"""Structured output: per-row grammar masks, lossless greedy decoding, and the sampled distribution.

Tiny random models with a real byte-level BPE tokenizer (tests/server/harness.py), so llguidance
sees a real vocabulary. The sampled test enumerates every token sequence the grammar allows (all
tokenizations of each choice) with its exact probability under constrained plain sampling, and
checks the speculative engine's samples against it with a chi-square test.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from tests.server.harness import make_engine, tiny_pair
from tests.stats import chi_square
from tests.tree_proposer import TopTwoTree
from verispec.config import SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM
from verispec.structured import Structured
from verispec.types import Draft

PROMPT = "The quick"
REGEX = Structured("regex", r"[a-z]{3,8}( [a-z]{3,8}){2}")
CHOICE = Structured("choice", ["yes", "no", "maybe", "fox"])
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "animal": {"enum": ["fox", "dog"]}},
    "required": ["n", "animal"],
    "additionalProperties": False,
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair() -> tuple[HFCausalLM, HFCausalLM]:
    return tiny_pair()


def fits(structured: Structured, text: str) -> bool:
    if structured.kind == "regex":
        return re.fullmatch(structured.spec, text) is not None
    if structured.kind == "choice":
        return text in structured.spec
    value = json.loads(text)
    return set(value) == {"n", "animal"} and isinstance(value["n"], int) and value["animal"] in ("fox", "dog")


@pytest.mark.parametrize(
    "structured", [REGEX, CHOICE, Structured("json", SCHEMA)], ids=["regex", "choice", "json"]
)
def test_greedy_constrained_speculation_equals_plain(pair, structured):
    target, draft = pair
    spec = make_engine(target, draft, "draft", k=3)
    got = spec.generate(PROMPT, max_new_tokens=60, structured=structured)
    want = spec.plain_engine().generate(PROMPT, max_new_tokens=60, structured=structured)
    assert got.token_ids == want.token_ids and got.stats.num_drafted > 0
    assert got.finish_reason == "eos" and fits(structured, got.text), got.text
    assert spec.generate(PROMPT, max_new_tokens=60).text != got.text  # the grammar did something


def test_a_batch_gives_each_prompt_its_own_grammar(pair):
    """``generate_batch(each=...)``: prompts decoding together, one under a grammar and one free, write
    what each writes alone (the distill command's JSON-mode prompts share batches with plain ones)."""
    target, draft = pair
    spec = make_engine(target, draft, "draft", k=3)
    json_mode = Structured("json", SCHEMA)
    got = spec.generate_batch([PROMPT, PROMPT], each=[{"structured": json_mode}, {}], max_new_tokens=40)
    assert got[0].token_ids == spec.generate(PROMPT, max_new_tokens=40, structured=json_mode).token_ids
    assert got[1].token_ids == spec.generate(PROMPT, max_new_tokens=40).token_ids
    assert fits(json_mode, got[0].text) and got[0].text != got[1].text
    with pytest.raises(VerispecError, match="each: 1 settings for 2 prompts"):
        spec.generate_batch([PROMPT, PROMPT], each=[{}])


def test_the_draft_model_drafts_within_the_grammar(pair):
    """The target as its own draft: every draft is accepted only if the draft is masked exactly as
    the target's rows are."""
    target, _ = pair
    engine = make_engine(target, target, "draft", k=4)
    got = engine.generate(PROMPT, max_new_tokens=60, structured=REGEX)
    assert got.stats.num_drafted > 0 and got.stats.num_accepted == got.stats.num_drafted


def test_token_trees_under_a_grammar(pair):
    target, draft = pair
    engine = SpecEngine(
        target, TopTwoTree(draft), SpecConfig(method="draft", depth="fixed"), tokenizer=target.tokenizer
    )
    got = engine.generate(PROMPT, max_new_tokens=60, structured=REGEX)
    want = engine.plain_engine().generate(PROMPT, max_new_tokens=60, structured=REGEX)
    assert got.token_ids == want.token_ids and fits(REGEX, got.text)
    assert got.stats.num_drafted > 0


def test_each_row_is_masked_for_its_own_path(pair):
    target, _ = pair
    engine = make_engine(target, None, None)
    tok = target.tokenizer
    committed = tok.encode("maybe", add_special_tokens=False)[:1]
    constraint = engine.requests.constraint(CHOICE.grammar())
    constraint.advance(committed[0])
    tokens = [*tok.encode("aybe", add_special_tokens=False), 5]
    tree = Draft(torch.tensor(tokens[:2]), torch.tensor([-1, 0]))
    for paths in (Draft.chain(torch.tensor(tokens)).row_paths(), tree.row_paths()):
        masks = constraint.masks(paths)
        for row, path in enumerate(paths):
            fresh = engine.requests.constraint(CHOICE.grammar())
            context = committed + path
            if fresh.matcher.validate_tokens(context) < len(context):
                assert masks[row].all()  # unreachable: left unmasked
                continue
            for token in context:
                fresh.advance(token)
            assert torch.equal(masks[row], fresh.allowed())


def test_masks_are_computed_once_per_path_until_a_token_is_committed(pair, monkeypatch):
    """Drafting and verification ask for the same rows' masks; each path's is computed once, and
    forgotten when a committed token moves the matcher on."""
    target, _ = pair
    engine = make_engine(target, None, None)
    constraint = engine.requests.constraint(CHOICE.grammar())
    computed: list[tuple[int, ...]] = []
    compute = constraint.allowed
    monkeypatch.setattr(constraint, "allowed", lambda: computed.append(()) or compute())
    tok = target.tokenizer
    m = tok.encode("m", add_special_tokens=False)
    first = constraint.masks([[], m])
    again = constraint.masks([m, []])
    assert len(computed) == 2 and torch.equal(again, first.flip(0))
    constraint.advance(m[0])
    after = constraint.masks([[]])
    assert len(computed) == 3 and torch.equal(after[0], first[1])


def test_forced_tokens_are_the_grammars_next_text_for_any_path(pair, monkeypatch):
    """What the grammar forces after the committed tokens plus a path: the schema's opening and
    first key at the start, the rest of it part way in, nothing where the next token is a choice or
    the path leaves the grammar; remembered per path until a token is committed."""
    target, _ = pair
    tok = target.tokenizer
    constraint = make_engine(target, None, None).requests.constraint(Structured("json", SCHEMA).grammar())
    opening = constraint.forced([])
    assert tok.decode(opening) == '{"n":'
    assert constraint.forced(opening[:2]) == opening[2:] and constraint.forced(opening) == []  # a number next
    assert constraint.forced(tok.encode("[", add_special_tokens=False)) == []  # not JSON of this schema
    calls: list[int] = []
    monkeypatch.setattr(constraint, "matcher", _Counting(constraint.matcher, calls))
    assert constraint.forced([]) == opening and not calls  # remembered
    constraint.advance(opening[0])
    assert constraint.forced([]) == opening[1:] and len(calls) == 1


class _Counting:
    """A matcher that counts ``compute_ff_tokens`` calls and passes everything else on."""

    def __init__(self, matcher, calls: list[int]) -> None:
        self._matcher, self._calls = matcher, calls

    def compute_ff_tokens(self):
        self._calls.append(1)
        return self._matcher.compute_ff_tokens()

    def __getattr__(self, name):
        return getattr(self._matcher, name)


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (Structured("regex", "[0-9"), "structured output"),
        (Structured("json", "{not json"), "structured output|JSON|json"),
        (Structured("choice", []), "choice needs a list of strings"),
        (Structured("grammar", 5), "grammar needs a Lark grammar string"),
    ],
)
def test_bad_grammars_are_refused_when_the_request_is_made(pair, structured, message):
    target, draft = pair
    with pytest.raises(VerispecError, match=message):
        make_engine(target, draft, "draft").make_request(PROMPT, structured=structured)


def test_a_model_without_a_tokenizer_is_refused(tiny_target):
    engine = SpecEngine(tiny_target, None, SpecConfig(method=None))
    with pytest.raises(VerispecError, match="structured output needs a tokenizer"):
        engine.make_request([1, 2, 3], structured=CHOICE)


# ------------------------------------------------------------------------- the sampled distribution

SEEDS = range(1000)
ALPHA = 1e-3


def exact_sequences(
    target: HFCausalLM, engine: SpecEngine, structured: Structured
) -> dict[tuple[int, ...], float]:
    """Every token sequence (EOS included) constrained plain sampling at temperature 1 can produce,
    with its probability: the target run without a cache on each prefix, masked by a fresh matcher."""
    prompt = target.tokenizer.encode(PROMPT)
    eos = set(target.eos_token_ids)
    out: dict[tuple[int, ...], float] = {}

    def walk(path: list[int], prob: float) -> None:
        constraint = engine.requests.constraint(structured.grammar())
        for token in path:
            constraint.advance(token)
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([prompt + path])).logits[0, -1].float()
        probs = logits.masked_fill(~constraint.allowed(), float("-inf")).softmax(-1)
        for token in probs.nonzero().flatten().tolist():
            p = prob * float(probs[token])
            if token in eos:
                out[(*path, token)] = p
            else:
                walk([*path, token], p)

    walk([], 1.0)
    return out


def sampled(engine: SpecEngine, structured: Structured, seeds: range) -> tuple[Counter, int, int]:
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in seeds:
        gen = engine.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=seed, structured=structured)
        counts[tuple(gen.token_ids)] += 1
        drafted += gen.stats.num_drafted
        accepted += gen.stats.num_accepted
    return counts, drafted, accepted


def check(counts: Counter, exact: dict[tuple[int, ...], float]) -> tuple[float, float]:
    unknown = set(counts) - set(exact)
    assert not unknown, f"sequences the grammar forbids: {unknown}"
    cells = sorted(exact)
    return chi_square(torch.tensor([counts[c] for c in cells]), torch.tensor([exact[c] for c in cells]))


SHORT = Structured("regex", r"(yes|no|maybe|fox)[!?]?")
"""Twelve texts, a few tokens each: every outcome can be enumerated."""


def assert_samples_follow_the_constrained_target(target: HFCausalLM, engine: SpecEngine) -> None:
    """1000 sampled outputs of ``engine`` under :data:`SHORT` against the exactly enumerated
    constrained target distribution (chi-square), with drafts accepted and rejected."""
    exact = exact_sequences(target, engine, SHORT)
    assert abs(sum(exact.values()) - 1) < 1e-6 and len(exact) >= 12
    counts, drafted, accepted = sampled(engine, SHORT, SEEDS)
    assert 0 < accepted < drafted
    statistic, p = check(counts, exact)
    assert p > ALPHA, (statistic, p, counts.most_common(8))


def test_constrained_speculative_sampling_follows_the_constrained_target(pair):
    target, draft = pair
    assert_samples_follow_the_constrained_target(target, make_engine(target, draft, "draft", k=3))


def test_masks_for_the_wrong_context_fail_the_check(pair, monkeypatch):
    """Power: masking every row as if no draft token came before it lets a token the grammar forbids
    be sampled, which the matcher refuses when it is committed."""
    monkeypatch.setattr(Draft, "row_paths", lambda draft: [[] for _ in range(draft.size + 1)])
    target, draft = pair
    engine = make_engine(target, draft, "draft", k=3)
    with pytest.raises(VerispecError, match="does not fit"):
        sampled(engine, SHORT, SEEDS[:200])
