"""The OpenAI API through the official openai client, against a real uvicorn server on a tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.harness import LiveServer, live_server, make_engine, tiny_pair, tiny_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """The folder's tiny server, drafting 4 tokens a step and served as ``tiny-spec``."""
    with tiny_server("tiny-spec", k=4) as live:
        yield live


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(
        client.chat.completions.create(
            model="tiny-spec",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-spec"]
    card = client.models.retrieve("tiny-spec")
    assert card.model_extra["max_model_len"] == 512
    assert card.model_extra["verispec"]["method"] == "draft"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completion_text_and_token_prompts(client):
    done = client.completions.create(model="tiny-spec", prompt="hello world", max_tokens=12, temperature=0)
    choice = done.choices[0]
    assert done.object == "text_completion" and choice.finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    stats = done.model_extra["verispec"]["stats"]
    assert stats["output_tokens"] == 12 and stats["drafted"] > 0

    ids = client.completions.create(model="tiny-spec", prompt=[5, 17, 42, 8], max_tokens=6)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 6
    listed = client.completions.create(model="tiny-spec", prompt=["hello world"], max_tokens=12)
    assert listed.choices[0].text == choice.text  # a one-prompt list is that prompt


def test_completion_stream_matches_the_full_response(client):
    full = client.completions.create(model="tiny-spec", prompt="The quick brown", max_tokens=20)
    chunks = list(
        client.completions.create(
            model="tiny-spec",
            prompt="The quick brown",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    tokens, usage = chunks[:-1], chunks[-1]
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in tokens) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in tokens] == [None] * (len(tokens) - 1) + ["length"]
    assert all(set(c.model_extra["verispec"]) == {"from_draft", "token_id"} for c in tokens)
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert usage.model_extra["verispec"]["stats"]["output_tokens"] == 20


def test_chat_stream_format(client):
    full = client.chat.completions.create(model="tiny-spec", messages=MESSAGES, max_tokens=16)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    chunks = stream_chat(client, max_tokens=16)
    role, tokens, usage = chunks[0], chunks[1:-1], chunks[-1]
    assert role.choices[0].delta.role == "assistant" and "verispec" not in (role.model_extra or {})
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    # One chunk per token with text (none for held-back partial characters), the last always there.
    assert 1 <= len(tokens) <= 16
    assert all(c.choices[0].delta.content for c in tokens[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in tokens) == full.choices[0].message.content
    assert tokens[-1].choices[0].finish_reason == "length"
    ids = [c.model_extra["verispec"]["token_id"] for c in tokens]
    assert all(isinstance(i, int) and 0 <= i < 320 for i in ids)
    assert usage.usage.completion_tokens == full.usage.completion_tokens == 16
    assert usage.model_extra["verispec"]["stats"]["output_tokens"] == 16


def test_without_include_usage_no_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(model="tiny-spec", messages=MESSAGES, max_tokens=5, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_speculation_off_gives_the_same_greedy_output_without_drafts(client, server):
    drafted_before = server.metric("verispec_draft_tokens_total")
    on = stream_chat(client, max_tokens=40, temperature=0)
    drafted_on = server.metric("verispec_draft_tokens_total") - drafted_before
    off = stream_chat(client, max_tokens=40, temperature=0, extra_body={"speculation": {"enabled": False}})
    drafted_off = server.metric("verispec_draft_tokens_total") - drafted_before - drafted_on

    def text(chunks: list[Any]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def drafts(chunks: list[Any]) -> int:
        return sum(c.model_extra["verispec"]["from_draft"] for c in chunks[1:-1])

    assert text(on) == text(off) and text(on)
    stats_on, stats_off = (c[-1].model_extra["verispec"]["stats"] for c in (on, off))
    assert stats_on["drafted"] > 0 and stats_on["accepted"] > 0 and stats_on["mean_accepted_length"] > 1
    assert stats_off["drafted"] == 0 and stats_off["mean_accepted_length"] == 1.0
    assert drafts(on) > 0 and drafts(off) == 0
    assert drafted_on == stats_on["drafted"] and drafted_off == 0

    capped = client.completions.create(
        model="tiny-spec",
        prompt="hello world",
        max_tokens=30,
        extra_body={"speculation": {"num_speculative_tokens": 1}},
    )
    stats = capped.model_extra["verispec"]["stats"]
    assert stats["drafted"] > 0 and len(stats["per_position_acceptance"]) == 1


def _chat_logprobs(client: openai.OpenAI, speculation: bool) -> tuple[Any, list[Any]]:
    """A greedy chat reply with logprobs, in full and streamed: (response, streamed content entries)."""
    kwargs: dict[str, Any] = {
        "model": "tiny-spec",
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"speculation": {"enabled": speculation}},
    }
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [entry for c in chunks[1:] if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    return full, streamed


def test_chat_logprobs_name_each_token_and_do_not_depend_on_speculation(client):
    full, streamed = _chat_logprobs(client, speculation=True)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens == 16
    assert full.model_extra["verispec"]["stats"]["accepted"] > 0  # drafted tokens are among them
    # A random model's bytes, some not UTF-8; the text holds back a character cut off at the end.
    text = b"".join(bytes(e.bytes) for e in entries).decode(errors="replace")
    assert text.rstrip("\ufffd") == full.choices[0].message.content.rstrip("\ufffd")
    for e in entries:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and all(t <= 0 for t in top)
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(top[0])  # greedy: the argmax
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain, _ = _chat_logprobs(client, speculation=False)
    assert plain.model_extra["verispec"]["stats"]["drafted"] == 0
    for a, b in zip(plain.choices[0].logprobs.content, entries, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    bare = client.chat.completions.create(model="tiny-spec", messages=MESSAGES, max_tokens=4)
    assert bare.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_format(client):
    kwargs: dict[str, Any] = {
        "model": "tiny-spec",
        "prompt": "The quick brown",
        "max_tokens": 12,
        "logprobs": 2,
    }
    full = client.completions.create(**kwargs).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == full.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the sampled token is always listed
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_echo_with_logprobs_scores_a_text_as_evaluation_harnesses_ask(client, server):
    """lm-evaluation-harness's loglikelihood request (token-id prompt, echo, max_tokens 1, logprobs
    1): one entry per prompt token (the first null) and the generated one; a continuation the model
    would write greedily scores as greedy, with the log-probabilities it had when generated."""
    prompt = server.on_engine(lambda e: e.encode("The quick brown"))
    written = client.completions.create(model="tiny-spec", prompt=[prompt], max_tokens=6, logprobs=1)
    continuation = server.on_engine(lambda e: e.encode("The quick brown" + written.choices[0].text))[
        len(prompt) :
    ]
    assert len(continuation) >= 3  # the text re-encodes to (mostly) the tokens it was made of
    scored = client.completions.create(
        model="tiny-spec", prompt=[prompt + continuation], max_tokens=1, logprobs=1, echo=True, temperature=0
    ).choices[0]
    lp = scored.logprobs
    n = len(prompt) + len(continuation)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert scored.text.startswith("The quick brown")
    assert lp.text_offset[len(prompt)] == len("The quick brown")
    ctx = lp.token_logprobs[len(prompt) : n]
    assert all(t == max(top.values()) for t, top in zip(ctx, lp.top_logprobs[len(prompt) : n], strict=True))
    made = written.choices[0].logprobs.token_logprobs[: len(continuation)]
    assert ctx == pytest.approx(made, abs=1e-4)
    chunks = list(
        client.completions.create(
            model="tiny-spec", prompt=[prompt], max_tokens=3, logprobs=1, echo=True, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text == "The quick brown" and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(prompt)], abs=1e-5)
    bare = client.completions.create(model="tiny-spec", prompt="The quick brown", max_tokens=3, echo=True)
    assert bare.choices[0].text.startswith("The quick brown") and bare.choices[0].logprobs is None


def test_n_choices_are_seeded_samples_of_their_own(client):
    """n = 3 sampled choices: choice i is what a one-choice request with seed + i gives, in full and
    streamed, and the usage and statistics count all three."""
    kwargs: dict[str, Any] = {
        "model": "tiny-spec",
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 1.0,
    }
    full = client.chat.completions.create(n=3, seed=7, **kwargs)
    texts = [c.message.content for c in sorted(full.choices, key=lambda c: c.index)]
    assert [c.index for c in full.choices] == [0, 1, 2] and len(set(texts)) > 1
    singles = [
        client.chat.completions.create(seed=7 + i, **kwargs).choices[0].message.content for i in range(3)
    ]
    assert texts == singles
    assert full.usage.completion_tokens == 30 and full.model_extra["verispec"]["stats"]["output_tokens"] == 30
    chunks = list(
        client.chat.completions.create(
            n=3, seed=7, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    streamed = {i: "" for i in range(3)}
    finishes = {i: [] for i in range(3)}
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert [streamed[i] for i in range(3)] == texts
    assert all(f == ["length"] for f in finishes.values())
    assert (
        chunks[-1].usage.completion_tokens == 30
        and chunks[-1].model_extra["verispec"]["stats"]["drafted"] > 0
    )


def mean_logprob(choice: Any) -> float:
    return sum(choice.logprobs.token_logprobs) / len(choice.logprobs.token_logprobs)


def test_best_of_returns_the_choices_with_the_highest_logprob_per_token(client):
    """best_of = 3 generates what n = 3 does (same seeds) and returns the n best by mean logprob,
    best first, without logprobs unless asked; usage counts all three."""
    kwargs: dict[str, Any] = {
        "model": "tiny-spec",
        "prompt": "hello world",
        "max_tokens": 8,
        "temperature": 1.0,
    }
    # A seed whose best choice is not the first, so returning the first choice would fail (which
    # seed that is depends on the sampler's random stream, so it is searched for, not hard-coded).
    for seed in range(11, 41):
        every = client.completions.create(n=3, seed=seed, logprobs=0, **kwargs).choices
        ranked = sorted(every, key=mean_logprob, reverse=True)
        if ranked[0].index != 0:
            break
    else:
        pytest.fail("every seed in 11-40 ranked its first choice best")
    assert len({c.text for c in every}) == 3 and mean_logprob(ranked[0]) > mean_logprob(ranked[2])
    best = client.completions.create(best_of=3, seed=seed, **kwargs)
    assert [c.text for c in best.choices] == [ranked[0].text] and best.choices[0].index == 0
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 24
    assert best.model_extra["verispec"]["stats"]["output_tokens"] == 24
    two = client.completions.create(n=2, best_of=3, seed=seed, logprobs=0, **kwargs).choices
    assert [c.text for c in two] == [ranked[0].text, ranked[1].text] and [c.index for c in two] == [0, 1]
    assert [c.logprobs.token_logprobs for c in two] == [
        ranked[0].logprobs.token_logprobs,
        ranked[1].logprobs.token_logprobs,
    ]
    chat = client.chat.completions.create(
        model="tiny-spec", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, n=3, logprobs=True
    ).choices
    top = max(chat, key=lambda c: sum(t.logprob for t in c.logprobs.content) / len(c.logprobs.content))
    chosen = client.chat.completions.create(
        model="tiny-spec",
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        extra_body={"best_of": 3},
    )
    assert [c.message.content for c in chosen.choices] == [top.message.content]


def test_stop_strings_cut_the_output(client):
    text = client.completions.create(model="tiny-spec", prompt="hello world", max_tokens=40).choices[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = client.completions.create(model="tiny-spec", prompt="hello world", max_tokens=40, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    def sample(seed: int) -> str:
        out = client.completions.create(
            model="tiny-spec", prompt="hello", max_tokens=24, temperature=1.0, top_p=0.9, seed=seed
        )
        return out.choices[0].text

    assert sample(7) == sample(7)
    top_k = client.completions.create(
        model="tiny-spec", prompt="hello", max_tokens=8, temperature=0.8, extra_body={"top_k": 5}
    )
    assert top_k.usage.completion_tokens == 8


def test_health_and_metrics(server, client):
    client.completions.create(model="tiny-spec", prompt="hello world", max_tokens=10)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "verispec_requests_total",
        "verispec_prompt_tokens_total",
        "verispec_generation_tokens_total",
        "verispec_time_to_first_token_seconds_bucket",
        "verispec_inter_token_latency_seconds_bucket",
        "verispec_request_latency_seconds_bucket",
        "verispec_draft_tokens_total",
        "verispec_accepted_tokens_total",
        "verispec_acceptance_rate",
        "verispec_mean_accepted_length",
        'verispec_position_draft_tokens_total{position="1"}',
        'verispec_position_accepted_tokens_total{position="1"}',
        "verispec_batch_size",
        "verispec_waiting_requests",
        "verispec_step_mean_depth",
        "verispec_step_depth_bucket",
    ):
        assert name in text, name
    assert server.metric("verispec_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert server.metric("verispec_time_to_first_token_seconds_count") >= 1
    drafted = server.metric("verispec_draft_tokens_total")
    accepted = server.metric("verispec_accepted_tokens_total")
    assert 0 < accepted < drafted
    assert server.metric("verispec_acceptance_rate") == pytest.approx(accepted / drafted)
    assert 1.0 < server.metric("verispec_mean_accepted_length") <= 5.0
    # Position 1 is drafted at least as often as position 2, and accepted at least as often too.
    first = server.metric("verispec_position_draft_tokens_total", position="1")
    second = server.metric("verispec_position_draft_tokens_total", position="2")
    assert first >= second > 0
    assert 0 <= server.metric("verispec_step_mean_depth") <= 4  # k=4, less near max_tokens
    assert server.metric("verispec_batch_size") == 0  # idle now: refreshed at scrape time


def test_index_page_is_served_or_404(tmp_path, server):
    page = tmp_path / "index.html"
    page.write_text("<!doctype html><title>verispec</title>")
    target, _ = tiny_pair()
    with live_server(make_engine(target), static_dir=tmp_path) as live:
        response = httpx.get(f"{live.url}/")
        assert response.status_code == 200 and "<title>verispec</title>" in response.text
        assert response.headers["content-type"].startswith("text/html")
    page.unlink()
    with live_server(make_engine(target), static_dir=tmp_path) as live:
        response = httpx.get(f"{live.url}/")
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
