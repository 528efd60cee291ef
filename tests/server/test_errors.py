"""Bad input and faults: OpenAI error bodies, 400 not 422, 404, 413, 429, disconnects, engine errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.harness import LiveServer, live_server, make_engine, tiny_pair
from verispec.engine import SpecEngine

CONTEXT = 128


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    target, draft = tiny_pair(context=CONTEXT)
    engine = make_engine(target, draft, "draft", k=3, max_batch_size=2, max_waiting=1)
    with live_server(engine, name="tiny", max_body_bytes=1_000_000) as live:
        yield live


def post(server: LiveServer, path: str, body: object | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60
    )


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == {429: "rate_limit_error"}.get(
        status, "invalid_request_error"
    )
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ("{not json", None, "json_invalid"),
        ("", None, None),
        ("[1, 2]", None, None),
        ('"a string"', None, None),
        ({}, "prompt", None),
        ({"prompt": 5}, "prompt", None),
        ({"prompt": [1, "a"]}, "prompt", None),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens", None),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens", None),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens", None),
        ({"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "hi", "max_tokens": 10**30}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "hi", "stream": 1}, "stream", None),
        ({"prompt": "hi", "temperature": -1}, "temperature", None),
        ('{"prompt": "hi", "temperature": NaN}', "temperature", None),
        ('{"prompt": "hi", "temperature": Infinity}', "temperature", None),
        ({"prompt": "hi", "top_p": 0}, "top_p", None),
        ({"prompt": "hi", "top_p": 1.5}, "top_p", None),
        ({"prompt": "hi", "top_k": -2}, "top_k", None),
        ({"prompt": "hi", "seed": 2**70}, "seed", None),
        ({"prompt": "hi", "stop": 3}, "stop", None),
        ({"prompt": "hi", "stop": [""]}, "stop", None),
        ({"prompt": "hi", "stop": ["x"] * 17}, "stop", None),
        ({"prompt": "hi", "n": 0}, "n", None),
        ({"prompt": "hi", "n": 129}, "n", None),
        ({"prompt": "hi", "n": 4}, "n", None),  # more than this server's batch of 2 and queue of 1
        ({"prompt": "hi", "best_of": 4}, "best_of", None),  # the same for the choices best_of makes
        ({"prompt": "hi", "best_of": 0}, "best_of", None),
        ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of", "unsupported_parameter"),
        ({"prompt": "hi", "best_of": 2, "stream": True}, "best_of", "unsupported_parameter"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", None),
        ({"prompt": "hi", "logprobs": -1}, "logprobs", None),
        ({"prompt": "hi", "logprobs": True}, "logprobs", None),
        ({"prompt": "hi", "echo": 1}, "echo", None),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", None),
        ({"prompt": "hi", "frequency_penalty": "1"}, "frequency_penalty", None),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", None),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", None),
        ({"prompt": "hi", "logit_bias": {"-3": 1}}, "logit_bias", None),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", None),
        ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", None),
        ({"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias.5", None),
        ({"prompt": "hi", "suffix": "x"}, "suffix", None),  # the tiny model has no FIM tokens
        ({"prompt": [5, 6], "suffix": "x"}, "suffix", "unsupported_parameter"),
        ({"prompt": "hi", "suffix": 5}, "suffix", None),
        ({"prompt": "hi", "stop_token_ids": [320]}, "stop_token_ids", None),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids[0]", None),
        ({"prompt": "hi", "speculation": {"enabled": "yes"}}, "speculation.enabled", None),
        (
            {"prompt": "hi", "speculation": {"num_speculative_tokens": 65}},
            "speculation.num_speculative_tokens",
            None,
        ),
        ({"prompt": "hi", "speculation": []}, "speculation", None),
        ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", None),
        ({"prompt": ""}, "prompt", None),
        ({"prompt": []}, "prompt", None),
        ({"prompt": ["a", "b"]}, "prompt", None),
        ({"prompt": [1, 2, 320]}, "prompt", None),
        ({"prompt": [-1]}, "prompt", None),
        ({"prompt": [1] * CONTEXT}, "prompt", "context_length_exceeded"),
        ({"prompt": "hello " * 400}, "prompt", "context_length_exceeded"),
        ({"prompt": "x" * 500_000}, "prompt", "context_length_exceeded"),
    ],
)
def test_bad_completion_requests_are_400(server, body, param, code):
    assert_error(post(server, "/v1/completions", body), 400, param, code)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            "tools[0].function",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "[0-9"}},
            "structured_outputs",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "structured_outputs": {"regex": "a", "choice": ["b"]},
            },
            "structured_outputs",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "structured_outputs": {"choice": ["b"]},
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "word " * 500}]}, "messages"),
    ],
)
def test_bad_chat_requests_are_400(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


def test_unknown_model_is_404_model_not_found(server):
    response = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    error = assert_error(response, 404, "model", "model_not_found")
    assert "gpt-4" in error["message"]
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)


def test_unknown_routes_and_methods_answer_in_openai_shape(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404, code="not_found")
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405, code="method_not_allowed")


def test_oversized_body_is_413(server):
    response = post(server, "/v1/completions", {"prompt": "x" * 1_100_000})
    assert_error(response, 413, code="request_too_large")


def test_an_engine_fault_fails_only_that_request(server):
    engine = server.async_engine.engine
    real = engine.target.forward_batch
    broken = threading.Event()

    def forward_batch(*args, **kwargs):
        if broken.is_set():
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    engine.target.forward_batch = forward_batch  # type: ignore[method-assign]
    try:
        broken.set()
        response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert response.status_code == 500 and "injected fault" in response.json()["error"]["message"]
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
        ) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert stream.status_code == 200
        assert (
            "injected fault" in json.loads(events[0][6:])["error"]["message"] and events[-1] == "data: [DONE]"
        )
        broken.clear()
        assert server.sequences() == 0
        assert httpx.get(f"{server.url}/health").status_code == 200
        ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert server.metric("verispec_requests_finished_total", reason="error") == 2
    finally:
        del engine.target.forward_batch


@pytest.fixture
def slow_server() -> Iterator[LiveServer]:
    """Plain decoding, 10 ms a step at least: a long request runs for seconds unless it is aborted."""
    target, _ = tiny_pair(context=CONTEXT * 4)
    engine = make_engine(target, max_batch_size=2, max_waiting=1)
    engine.step_observers.append(lambda report: time.sleep(0.01))
    with live_server(engine, name="tiny") as live:
        yield live


def test_client_disconnect_mid_stream_frees_its_sequence(slow_server):
    server = slow_server
    long = {"prompt": "hello world", "max_tokens": 400, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=long) as stream,
    ):
        lines = stream.iter_lines()
        chunks = [next(line for line in lines if line.startswith("data: ")) for _ in range(2)]
        assert all(json.loads(c[6:])["choices"][0]["finish_reason"] is None for c in chunks)
        assert server.sequences() == 1
    # Leaving the block closed the connection, 400 tokens x 10 ms before the request would end.
    assert server.wait_idle(timeout=3.0) < 3.0
    assert server.metric("verispec_requests_finished_total", reason="aborted") == 1
    assert server.metric("verispec_generation_tokens_total") < 300
    other = server.client().completions.create(model="tiny", prompt="hi", max_tokens=5)
    assert other.usage.completion_tokens == 5 and other.choices[0].finish_reason == "length"


def test_client_disconnect_during_a_full_response_frees_its_sequence(slow_server):
    server = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 400}, timeout=0.5)
    assert server.wait_idle(timeout=3.0) < 3.0
    assert server.metric("verispec_requests_finished_total", reason="aborted") == 1
    assert (
        server.client().completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens
        == 3
    )


def test_client_disconnect_frees_every_choice(slow_server):
    server = slow_server
    body = {"prompt": "hello world", "max_tokens": 400, "stream": True, "n": 2}  # greedy: never EOS here
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()  # kept: a dropped line iterator closes the response
        next(line for line in lines if line.startswith("data: "))
        assert server.sequences() == 2
    assert server.wait_idle(timeout=3.0) < 3.0
    assert server.metric("verispec_requests_finished_total", reason="aborted") == 1


def test_disconnects_do_not_disturb_other_streams(slow_server):
    server = slow_server
    results: dict[str, int] = {}

    def complete() -> None:
        chunks = list(
            server.client().completions.create(model="tiny", prompt="hi", max_tokens=60, stream=True)
        )
        results["tokens"] = len(chunks)
        results["finish"] = chunks[-1].choices[0].finish_reason == "length"

    survivor = threading.Thread(target=complete)
    survivor.start()
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 400, "stream": True}
    ) as stream:
        next(line for line in stream.iter_lines() if line.startswith("data: "))
    survivor.join(timeout=30)
    assert results.get("finish") is True and results["tokens"] >= 1
    server.wait_idle(timeout=3.0)
    assert server.metric("verispec_requests_finished_total", reason="aborted") == 1
    assert server.metric("verispec_requests_finished_total", reason="length") == 1


def test_full_queue_is_429_with_retry_after(slow_server):
    """Capacity is 2 running + 1 waiting: fill it without clients, then ask once more."""
    server = slow_server

    def fill(engine: SpecEngine) -> list[str]:
        ids = []
        for _ in range(3):
            request = engine.make_request([5, 6, 7], max_new_tokens=400)
            engine.add(request)
            ids.append(request.request_id)
            if len(ids) < 3:
                engine.step()  # admit it into the batch (its outputs have no reader: they are dropped)
        return ids

    fillers = server.on_engine(fill)
    try:
        response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        error = assert_error(response, 429, code="rate_limit_exceeded")
        assert int(response.headers["retry-after"]) >= 1 and "waiting" in error["message"]
        with pytest.raises(openai.RateLimitError):
            server.client().completions.create(model="tiny", prompt="hi", max_tokens=4)
    finally:
        server.on_engine(lambda e: [e.abort(i) for i in fillers])
    assert (
        server.client().completions.create(model="tiny", prompt="hi", max_tokens=4).usage.completion_tokens
        == 4
    )


def test_a_model_without_tokenizer_takes_token_ids_only(tiny_target):
    with live_server(make_engine(tiny_target), name="ids-only") as server:
        ids = post(server, "/v1/completions", {"prompt": [5, 17, 42], "max_tokens": 4})
        assert ids.status_code == 200 and ids.json()["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        text = assert_error(post(server, "/v1/completions", {"prompt": "hello"}), 400, "prompt")
        assert "token ids" in text["message"]
        stop = post(server, "/v1/completions", {"prompt": [5, 17], "stop": ["x"]})
        assert "tokenizer" in assert_error(stop, 400, "stop")["message"]
        chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert "tokenizer" in assert_error(chat, 400, "messages")["message"]
        echo = post(server, "/v1/completions", {"prompt": [5, 17], "echo": True})
        assert "tokenizer to write the prompt" in assert_error(echo, 400, "echo")["message"]
        named = post(server, "/v1/completions", {"prompt": [5, 17], "logprobs": 1})
        assert "tokenizer to name the tokens" in assert_error(named, 400, "logprobs")["message"]
        assert server.sequences() == 0  # refused before it was queued
