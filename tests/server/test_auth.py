"""API keys, tenants and cache scopes (:mod:`verispec.server.auth`), against real servers.

A server started with keys refuses every route but ``/health`` and ``/`` without one of them, before
any work (no stream starts, the engine receives nothing); a known key's tenant becomes the cache
scope of the requests the engine receives, which ``user`` may only narrow. Without keys requests are
private unless ``--shared-cache``. Bad keys make ``verispec serve`` fail at start, on one line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from tests.server.harness import LiveServer, await_cli_server, stop_cli_server, tiny_pair, tiny_server
from tests.server.test_cli_serve import assert_one_line_error, run_serve
from verispec.engine import Request
from verispec.errors import VerispecError
from verispec.server import create_app
from verispec.server.auth import (
    ANONYMOUS_TENANT,
    DEFAULT_TENANT,
    ENV_KEY,
    OPEN_PATHS,
    Access,
    KeyTable,
    cache_scope,
    load_access,
    presented_keys,
    read_keys_file,
)

KEYS = {
    "sk-acme-1": "acme",
    "sk-acme-2": "acme",
    "sk-globex": "globex",
    "sk-slash": "a/b",  # with the next: the scopes of ("a/b", "c") and ("a", "b/c") must differ
    "sk-a": "a",
}
ACME = "sk-acme-1"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
COMPLETION = {"prompt": "hello world", "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    """The tiny server with :data:`KEYS`."""
    with tiny_server("tiny", k=3, access=Access(KeyTable(KEYS))) as live:
        yield live


@pytest.fixture(scope="module")
def shared() -> Iterator[LiveServer]:
    """The tiny server without keys, started as with ``--shared-cache``."""
    with tiny_server("tiny", k=3, access=Access(shared_cache=True)) as live:
        yield live


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> list[Request]:
    """The requests the engine of the test's server (``keyed``, ``shared`` or the plain ``server``)
    is handed while the test runs, as it receives them (its ``add_all``, on the engine thread)."""
    name = next(n for n in ("keyed", "shared", "server") if n in request.fixturenames)
    engine = request.getfixturevalue(name).async_engine.engine
    seen: list[Request] = []
    add_all = engine.add_all

    def recording(requests: list[Request], *args: Any, **kwargs: Any) -> Any:
        seen.extend(requests)
        return add_all(requests, *args, **kwargs)

    monkeypatch.setattr(engine, "add_all", recording)
    return seen


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_refused(response: httpx.Response, code: str) -> None:
    """A 401 with OpenAI's error body and a Bearer challenge."""
    assert response.status_code == 401, (response.request.url, response.text)
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert response.headers["content-type"] == "application/json"
    if response.request.method == "HEAD":
        return  # no body
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] is None
    assert "sk-" not in error["message"]  # never echoes a key


# ------------------------------------------------------------------------------- every route refuses


def route_requests(live: LiveServer) -> list[tuple[str, str]]:
    """(method, path) for every route of the app, path parameters filled in."""
    out = []
    for route in live.app.routes:
        if isinstance(route, Mount):  # the static files
            out.append(("GET", f"{route.path}/index.html"))
            continue
        assert isinstance(route, APIRoute | Route), f"a route of unknown kind: {route!r}"
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        out += [(method, path) for method in sorted(route.methods or ())]
    return out


def test_every_route_but_health_and_the_page_needs_a_key(keyed: LiveServer, received: list[Request]):
    """Walks the app's routes, so a route added later is checked too."""
    walked = route_requests(keyed)
    paths = {path for _, path in walked}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/x", "/metrics"} <= paths
    assert {"/docs", "/openapi.json", "/static/index.html", *OPEN_PATHS} <= paths
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        for method, path in [*walked, ("GET", "/no/such/route"), ("POST", "/v1/responses")]:
            if path in OPEN_PATHS:
                assert http.request(method, path).status_code != 401, (method, path)
                continue
            assert_refused(http.request(method, path), "missing_api_key")
            assert_refused(http.request(method, path, headers=bearer("sk-wrong")), "invalid_api_key")
            assert_refused(http.request(method, path, headers={"x-api-key": "sk-acme"}), "invalid_api_key")
            assert http.request(method, path, headers=bearer(ACME)).status_code != 401, (method, path)
    assert received == []  # nothing refused got as far as the engine
    assert keyed.metric("verispec_requests_total", endpoint="/metrics", status="401") >= 3


def test_a_route_added_later_needs_a_key_too(keyed: LiveServer):
    """The check sits in front of the router: a route nobody thought of is not left open."""
    app = create_app(keyed.async_engine, "tiny", access=Access(KeyTable(KEYS)))

    @app.get("/v1/added-later")
    async def added() -> dict[str, str]:
        return {"secret": "data"}

    http = TestClient(app)  # no `with`: the app's lifespan (the shared engine's observers) stays off
    assert_refused(http.get("/v1/added-later"), "missing_api_key")
    assert http.get("/v1/added-later", headers=bearer(ACME)).json() == {"secret": "data"}


def test_health_and_the_page_answer_without_a_key(keyed: LiveServer):
    assert httpx.get(f"{keyed.url}/health").json() == {"status": "ok"}
    page = httpx.get(f"{keyed.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("stream", [False, True])
def test_generation_is_refused_before_anything_starts(keyed: LiveServer, received: list[Request], stream):
    """Streamed or not, a request without a valid key gets its 401 before a stream opens."""
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            for headers, code in (({}, "missing_api_key"), (bearer("sk-nope"), "invalid_api_key")):
                with http.stream("POST", path, json={**body, "stream": stream}, headers=headers) as response:
                    response.read()
                    assert_refused(response, code)
    assert received == []


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_with_a_wrong_key_gets_an_authentication_error(keyed: LiveServer, stream):
    client = keyed.client(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(model="tiny", stream=stream, **CHAT)  # type: ignore[call-overload]
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="tiny", stream=stream, **COMPLETION)  # type: ignore[call-overload]
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_openai_client_with_a_key_is_served(keyed: LiveServer):
    client = keyed.client(api_key=ACME)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    reply = client.chat.completions.create(model="tiny", **CHAT)  # type: ignore[call-overload]
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    chunks = list(client.completions.create(model="tiny", stream=True, **COMPLETION))  # type: ignore[call-overload]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {ACME}"},
        {"authorization": f"bearer   {ACME}"},  # the scheme in any case, more spaces
        {"x-api-key": ACME},
        {"X-API-Key": ACME, "Authorization": "Bearer sk-wrong"},  # one known key is enough
    ],
    ids=["bearer", "bearer-lowercase", "x-api-key", "x-api-key-beside-a-wrong-bearer"],
)
def test_each_kind_of_header_is_accepted(keyed: LiveServer, headers: dict[str, str]):
    with httpx.Client(base_url=keyed.url, headers=headers, timeout=30) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.get("/metrics").status_code == 200
        reply = http.post("/v1/completions", json=COMPLETION)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["content-type"].startswith("text/event-stream")
            assert streamed.read().decode().rstrip().endswith("data: [DONE]")


def test_keys_of_two_tenants_at_once_are_refused(keyed: LiveServer):
    """Which tenant would the request be? Neither."""
    headers = {**bearer(ACME), "x-api-key": "sk-globex"}
    assert_refused(httpx.get(f"{keyed.url}/v1/models", headers=headers), "invalid_api_key")
    assert httpx.get(f"{keyed.url}/v1/models", headers={**bearer(ACME), "x-api-key": "sk-acme-2"}).is_success


# ----------------------------------------------------------------------------------- tenants, scopes


def scopes_of(live: LiveServer, received: list[Request], key: str | None, **body: Any) -> list[str | None]:
    """The cache scopes the engine received for one completion sent with ``key``."""
    received.clear()
    headers = bearer(key) if key else {}
    reply = httpx.post(f"{live.url}/v1/completions", json={**COMPLETION, **body}, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    return [r.cache_scope for r in received]


def test_the_keys_tenant_is_the_cache_scope(keyed: LiveServer, received: list[Request]):
    assert scopes_of(keyed, received, "sk-acme-1") == [cache_scope("acme", None)] == ["4:acme"]
    assert scopes_of(keyed, received, "sk-acme-2") == ["4:acme"]  # a tenant's keys share its scope
    assert scopes_of(keyed, received, "sk-globex") == ["6:globex"]
    assert scopes_of(keyed, received, ACME, n=2) == ["4:acme", "4:acme"]  # every choice


def test_user_narrows_the_scope_within_the_tenant(keyed: LiveServer, received: list[Request]):
    alice = scopes_of(keyed, received, ACME, user="alice")
    assert alice == ["4:acme/5:alice"]
    assert scopes_of(keyed, received, "sk-globex", user="alice") != alice  # never across tenants
    assert scopes_of(keyed, received, ACME, user="") == ["4:acme"]  # empty: no narrowing
    # The body cannot spell another tenant's scope.
    slash = scopes_of(keyed, received, "sk-slash", user="c")
    assert slash != scopes_of(keyed, received, "sk-a", user="b/c")
    assert scopes_of(keyed, received, ACME, user="4:acme") != ["4:acme"]
    # Chat, streamed, through the openai client's own `user` parameter.
    received.clear()
    stream = keyed.client(api_key=ACME).chat.completions.create(
        model="tiny",
        stream=True,
        user="bob",
        **CHAT,  # type: ignore[call-overload]
    )
    assert list(stream)[-1].choices[0].finish_reason == "length"
    assert [r.cache_scope for r in received] == ["4:acme/3:bob"]


def test_a_bad_user_is_a_400_and_the_server_goes_on(keyed: LiveServer, received: list[Request]):
    with httpx.Client(base_url=keyed.url, headers=bearer(ACME), timeout=30) as http:
        for user in (7, "u" * 1025):
            reply = http.post("/v1/completions", json={**COMPLETION, "user": user})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "user", reply.text
        assert received == []
        assert http.post("/v1/completions", json={**COMPLETION, "user": "ok"}).status_code == 200


def test_without_keys_every_request_is_private(server: LiveServer, received: list[Request]):
    """The folder's plain server: no tenant, so nothing is shared, whatever ``user`` says."""
    assert scopes_of(server, received, None) == [None]
    assert scopes_of(server, received, None, user="alice") == [None]
    assert scopes_of(server, received, "sk-anything") == [None]  # a key means nothing here
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_shared_cache_without_keys_shares_one_scope(shared: LiveServer, received: list[Request]):
    assert scopes_of(shared, received, None) == [cache_scope(ANONYMOUS_TENANT, None)] == ["0:"]
    assert scopes_of(shared, received, None, user="alice") == ["0:/5:alice"]


# ------------------------------------------------------------------------------------- the pieces


def test_scopes_are_unambiguous():
    """No two (tenant, user) pairs share a scope, however they mix separators and digits."""
    parts = ["a", "b", "a/b", "b/c", "c", "1:a", "a/1:b", "0:", "/", ":", "3:a/b", "a:b", "é"]
    pairs = [(t, u) for t in [*parts, ""] for u in [None, *parts]]
    scopes = [cache_scope(t, u) for t, u in pairs]
    assert len(set(scopes)) == len(pairs)
    assert cache_scope(None, "alice") is None


def test_key_lookup():
    table = KeyTable(KEYS)
    assert table.tenant(b"sk-globex") == "globex" and table.tenant(b"sk-acme-2") == "acme"
    assert table.tenant(b"sk-globe") is None and table.tenant(b"") is None
    assert len(table) == 5 and table.tenants == {"acme", "globex", "a/b", "a"}
    headers = [(b"Authorization", b"Basic abc"), (b"authorization", b"Bearer "), (b"x-api-key", b" k ")]
    assert list(presented_keys(headers)) == [b"k"]  # Basic and empty values are not keys


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "keys.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_keys_file_and_flags(tmp_path: Path):
    path = write(tmp_path, '\ufeff{"sk-1": "acme", "sk-2": "acme", "sk-3": "a/b c"}\n')
    assert read_keys_file(path) == {"sk-1": "acme", "sk-2": "acme", "sk-3": "a/b c"}
    access = load_access(["sk-flag", "sk-1"], path, {ENV_KEY: "sk-env"})
    assert access.keys is not None and len(access.keys) == 4
    assert access.keys.tenant(b"sk-flag") == DEFAULT_TENANT
    assert access.keys.tenant(b"sk-1") == "acme"  # the file names the flag's key: its tenant wins
    assert access.keys.tenant(b"sk-env") is None  # --api-key given: the environment is not read
    from_env = load_access(None, None, {ENV_KEY: "sk-env"})
    assert from_env.keys is not None and from_env.keys.tenant(b"sk-env") == DEFAULT_TENANT
    assert load_access(None, None, {ENV_KEY: ""}) == Access()  # set but empty: no keys
    assert load_access(None, None, {}, shared_cache=True) == Access(shared_cache=True)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"sk-1": "acme", "sk-2": "x", "sk-1": "globex"}', "entry 3 repeats the key of entry 1"),
        ('{"": "acme"}', "entry 1: the API key is empty"),
        ('{"sk-1": "acme", "sk 2": "acme"}', "entry 2: an API key must be printable ASCII"),
        ('{"sk-ключ": "acme"}', "printable ASCII"),
        ('{"sk-1": ""}', 'the tenant must be a non-empty string, got ""'),
        ('{"sk-1": 5}', "the tenant must be a non-empty string, got 5"),
        ('{"sk-1": "a\\u0000b"}', "control"),
        ('{"sk-1": "' + "t" * 257 + '"}', "over 256 characters"),
        ("{}", "holds no keys"),
        ('["sk-1", "acme"]', 'must hold a JSON object {"KEY": "TENANT", ...}'),
        ("sk-1 acme\n", "is not JSON (Expecting value at line 1, column 1)"),
        ('{"sk-1": "acme",}', "is not JSON"),
        ("", "is not JSON"),
        (b'{"sk-1": "\xff"}', "is not UTF-8 text"),
    ],
)
def test_bad_keys_files_are_clear_errors(tmp_path: Path, text: str | bytes, needle: str):
    path = write(tmp_path, text)
    with pytest.raises(VerispecError) as refused:
        load_access(None, path, {})
    message = str(refused.value)
    assert message.startswith(f"--api-keys-file {path}") and needle in message, message
    assert "sk-1" not in message and "sk-2" not in message  # keys stay out of logs


def test_bad_flag_keys_are_clear_errors(tmp_path: Path):
    with pytest.raises(VerispecError, match="--api-key: the API key is empty"):
        load_access([""], None, {})
    with pytest.raises(VerispecError, match=f"{ENV_KEY}: an API key must be printable ASCII"):
        load_access(None, None, {ENV_KEY: "two words"})
    with pytest.raises(VerispecError, match=r"cannot read --api-keys-file .*: No such file or directory"):
        load_access(None, tmp_path / "missing.json", {})
    with pytest.raises(VerispecError, match=r"cannot read --api-keys-file .*: Is a directory"):
        load_access(None, tmp_path, {})


def test_the_schema_documents_the_401(keyed: LiveServer):
    paths = httpx.get(f"{keyed.url}/openapi.json", headers=bearer(ACME)).json()["paths"]
    assert "401" in paths["/v1/chat/completions"]["post"]["responses"]
    assert "401" in paths["/metrics"]["get"]["responses"]
    assert "401" not in paths["/health"]["get"]["responses"]


# ------------------------------------------------------------------------------ verispec serve itself


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: d / "missing.json", "cannot read --api-keys-file"),
        (lambda d: write(d, '{"sk-1": "a", "sk-1": "b"}'), "entry 2 repeats the key of entry 1"),
        (lambda d: write(d, "sk-1 acme"), "is not JSON"),
    ],
    ids=["missing", "duplicate", "not-json"],
)
def test_serve_fails_at_start_on_a_bad_keys_file(tmp_path: Path, make, needle: str):
    """Before the model load: the target named does not exist, and the error is the keys file's."""
    out = run_serve("--target", "no-such-model", "--port", "0", "--api-keys-file", str(make(tmp_path)))
    assert_one_line_error(out, needle)


def test_serve_fails_at_start_on_an_empty_api_key():
    assert_one_line_error(run_serve("--target", "no-such-model", "--api-key", ""), "--api-key")


def test_serve_requires_the_keys_of_its_flags_file_and_environment(tmp_path: Path, flat_costs: Path):
    folder = tmp_path / "tiny-chat"
    target, _ = tiny_pair()
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    keys = write(tmp_path, json.dumps({"sk-file": "acme"}))
    env = {**os.environ, "VERISPEC_CACHE": str(tmp_path / "cache"), ENV_KEY: "sk-env"}
    command = [
        sys.executable, "-m", "verispec.cli", "serve", "--target", str(folder), "--port", "0",
        "--costs", str(flat_costs), "--quantization", "none", "--threads", "1", "--method", "ngram",
        "--served-model-name", "tiny-chat", "--log-level", "warning", "--api-keys-file", str(keys),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, _ = await_cli_server(proc, 60)
        assert_refused(httpx.get(f"{url}/v1/models"), "missing_api_key")
        assert_refused(httpx.get(f"{url}/v1/models", headers=bearer("sk-wrong")), "invalid_api_key")
        for key in ("sk-file", "sk-env"):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
            reply = client.completions.create(model="tiny-chat", prompt="hello", max_tokens=3)
            assert reply.usage is not None and reply.usage.completion_tokens == 3
    finally:
        rest = stop_cli_server(proc)
    assert "Traceback" not in rest, rest
