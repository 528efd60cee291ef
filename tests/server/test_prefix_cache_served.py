"""Both cross-request caches behind API keys, end to end on the bundled SmolLM2 with suffix decoding:
a tenant's later turns reuse its earlier ones (OpenAI's ``cached_tokens``) and draft from its
earlier replies, with unchanged replies; another tenant, or a caller narrowed by ``user``, gets
nothing of either: its conversation runs exactly as the first tenant's first one did."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import verispec
from tests.conftest import needs_smollm2
from tests.server.harness import LiveServer, live_server
from verispec.server.auth import Access, KeyTable

pytestmark = [pytest.mark.slow, needs_smollm2]

KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
FOLLOW_UPS = ("Now add a docstring.", "Now add type hints.")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = verispec.load("smollm2-135m-instruct", method="suffix", depth="fixed")
    with live_server(engine, name="smollm2", access=Access(KeyTable(KEYS))) as live:
        yield live


def conversation(server: LiveServer, key: str, stream: bool, **extra: Any) -> list[tuple[str, int, int, int]]:
    """Three turns, each sending the whole history: every reply, its ``cached_tokens`` and its
    drafted and accepted tokens."""
    client = server.client(api_key=key)
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    out = []
    for follow_up in (*FOLLOW_UPS, None):
        options: dict[str, Any] = {
            "model": "smollm2",
            "messages": messages,
            "max_tokens": 32,
            "temperature": 0,
        }
        if stream:
            chunks = list(
                client.chat.completions.create(
                    **options, stream=True, stream_options={"include_usage": True}, **extra
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
            stats = chunks[-1].model_extra["verispec"]["stats"]
        else:
            reply = client.chat.completions.create(**options, **extra)
            text, cached = reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens
            stats = reply.model_extra["verispec"]["stats"]
        out.append((text, cached, stats["drafted"], stats["accepted"]))
        if follow_up is not None:
            messages = [
                *messages,
                {"role": "assistant", "content": text},
                {"role": "user", "content": follow_up},
            ]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_tenants_later_turns_reuse_its_earlier_ones_and_no_one_elses(server, stream):
    acme = conversation(server, "sk-acme", stream, user=f"first-{stream}")
    globex = conversation(server, "sk-globex", stream, user=f"first-{stream}")
    narrowed = conversation(server, "sk-acme", stream, user=f"other-{stream}")
    again = conversation(server, "sk-acme", stream, user=f"first-{stream}")
    replies = [turn[0] for turn in acme]
    for other in (globex, narrowed, again):
        assert [turn[0] for turn in other] == replies  # neither cache changes a reply
    assert acme[0][1] == 0 and all(turn[1] >= 16 for turn in acme[1:])
    # another tenant, or another user of the tenant, starts from nothing: its turns reuse and draft
    # exactly what the first conversation's did (cached tokens, drafted and accepted, turn by turn)
    assert globex == acme and narrowed == acme
    # the same tenant and user again finds its first prompt, and drafts its earlier replies
    assert again[0][1] > 0
    assert sum(turn[3] for turn in again) > sum(turn[3] for turn in acme)
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer sk-acme"})
    assert metrics.status_code == 200 and "verispec_prefix_cache_hit_rate" in metrics.text
    assert server.metric("verispec_prefix_cache_bytes") > 0
