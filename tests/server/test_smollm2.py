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
