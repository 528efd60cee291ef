"""End to end on the real bundled SmolLM2-135M: chat through its template, n-gram speculation per request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import verispec
from tests.conftest import needs_smollm2
from tests.server.harness import LiveServer, live_server

pytestmark = [pytest.mark.slow, needs_smollm2]

MESSAGES = [
    {
        "role": "user",
        "content": "Copy this sentence exactly: The quick brown fox jumps over the lazy dog.",
    }
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = verispec.load("smollm2-135m-instruct", method="ngram", num_speculative_tokens=4, depth="fixed")
    with live_server(engine, name="smollm2") as live:
        yield live


def chat(server: LiveServer, speculation: dict[str, Any]) -> tuple[str, dict[str, Any], int]:
    """Stream a greedy reply; returns its text, its stats and how many tokens came from drafts."""
    chunks = list(
        server.client().chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculation": speculation},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    drafted = sum(c.model_extra["verispec"]["from_draft"] for c in chunks[1:-1])
    return text, chunks[-1].model_extra["verispec"]["stats"], drafted


def test_speculation_on_and_off_agree_and_drafts_are_accepted(server):
    on_text, on_stats, on_drafted = chat(server, {"enabled": True})
    off_text, off_stats, off_drafted = chat(server, {"enabled": False})
    # A plain copy of the prompt, which SmolLM2 makes whatever the CPU's kernels (asked to repeat a
    # list twice, it did on AVX-512 machines and apologised instead on an AVX2 one).
    assert on_text == off_text and "lazy dog" in on_text and "<|im_" not in on_text
    assert on_stats["accepted"] > 0 and on_stats["mean_accepted_length"] > 1.0 and on_drafted > 0
    assert off_stats["drafted"] == 0 and off_drafted == 0
    full = server.client().chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=48)
    assert full.choices[0].message.content == on_text
    assert server.metric("verispec_accepted_tokens_total") >= on_stats["accepted"]


def test_logprobs_are_the_same_with_and_without_speculation(server):
    """The real model's log-probabilities: drafted tokens get the ones plain decoding gives them."""

    def ask(enabled: bool) -> Any:
        return server.client().chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=64,  # room to reach the end of turn on every CPU (24 ran out on a Zen 3)
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"speculation": {"enabled": enabled}},
        )

    on, off = ask(True), ask(False)
    assert on.model_extra["verispec"]["stats"]["accepted"] > 0
    assert on.choices[0].message.content == off.choices[0].message.content
    on_entries, off_entries = on.choices[0].logprobs.content, off.choices[0].logprobs.content
    named = b"".join(bytes(e.bytes) for e in on_entries).decode()
    assert named == on.choices[0].message.content + "<|im_end|>"  # the end-of-turn token has its entry
    for a, b in zip(on_entries, off_entries, strict=True):
        assert a.token == b.token == a.top_logprobs[0].token
        assert a.logprob == pytest.approx(b.logprob, abs=1e-6) and a.logprob > -20
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_echo_scores_a_greedy_continuation_as_greedy(server):
    """Evaluation harnesses' loglikelihood request on the real model: the reply SmolLM2 writes
    greedily, scored back with echo, is greedy at every token and keeps its log-probabilities
    (prefill and decode run different kernels, so within rounding)."""
    client = server.client()
    prompt = server.on_engine(lambda e: e.encode("def add(a, b):\n    return"))
    written = client.completions.create(
        model="smollm2", prompt=[prompt], max_tokens=8, logprobs=1, temperature=0
    )
    ids = server.on_engine(lambda e: e.encode("def add(a, b):\n    return" + written.choices[0].text))
    assert ids[: len(prompt)] == prompt
    scored = client.completions.create(
        model="smollm2", prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0
    ).choices[0]
    lp = scored.logprobs
    rest = slice(len(prompt), len(ids))
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert all(
        t == max(top.values()) for t, top in zip(lp.token_logprobs[rest], lp.top_logprobs[rest], strict=True)
    )
    made = written.choices[0].logprobs.token_logprobs[: len(ids) - len(prompt)]
    assert lp.token_logprobs[rest] == pytest.approx(made, abs=0.05)


def test_penalties_and_logit_bias_are_lossless_with_speculation(server):
    """OpenAI's penalties and logit_bias through the real server: speculation on and off agree token
    for token, drafts are still accepted, and a banned token never appears."""
    plain = chat(server, {"enabled": False})[0]
    fox = server.on_engine(lambda engine: engine.tokenizer.encode(" fox", add_special_tokens=False))
    assert len(fox) == 1 and "fox" in plain

    def ask(enabled: bool) -> Any:
        return server.client().chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=48,
            temperature=0,
            frequency_penalty=0.3,
            logit_bias={str(fox[0]): -100},
            extra_body={"speculation": {"enabled": enabled}, "repetition_penalty": 1.1},
        )

    on, off = ask(True), ask(False)
    text = on.choices[0].message.content
    assert text == off.choices[0].message.content and text != plain
    assert " fox" not in text, text
    assert on.model_extra["verispec"]["stats"]["accepted"] > 0
