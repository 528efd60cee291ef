"""Schemathesis fuzzes every route of the app's own OpenAPI schema against a live server.

Valid and invalid bodies alike must never get a 5xx, and the server must still serve afterwards.
The model's context is 64 tokens, so even a valid request generates for milliseconds only.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.server.harness import LiveServer, live_server, make_engine, tiny_pair

EXAMPLES = 100


@pytest.fixture(scope="module")
def fuzzed_server() -> Iterator[LiveServer]:
    target, draft = tiny_pair(context=64)
    with live_server(make_engine(target, draft, "draft", k=2), name="tiny") as live:
        yield live


@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
def test_no_server_errors(fuzzed_server: LiveServer, mode: GenerationMode) -> None:
    """Schema-conforming (positive) and schema-violating (negative) requests to every route."""
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    statuses: list[int] = []

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: schemathesis.Case) -> None:
        response = case.call(timeout=30)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text}"
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

    check()
    assert len(statuses) >= EXAMPLES // 2  # it did fuzz (hypothesis may stop early on duplicates)
    # Negative cases are refused; some positive ones generate (others name another model, say).
    assert (400 if mode == GenerationMode.NEGATIVE else 200) in statuses


def test_server_is_healthy_after_fuzzing(fuzzed_server: LiveServer) -> None:
    assert httpx.get(f"{fuzzed_server.url}/health").json() == {"status": "ok"}
    fuzzed_server.wait_idle(timeout=5)
    done = fuzzed_server.client().completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert done.usage.completion_tokens == 5
    assert fuzzed_server.metric("verispec_requests_total", endpoint="/v1/completions", status="400") > 0
