"""API keys, tenants and cache scopes for ``verispec serve``.

The engine's cross-request caches (prompt KV, earlier outputs as drafts) are a timing side channel:
how fast a token comes out can tell a caller whether someone else's prompt or output held it. So a
request shares caches only within its *cache scope*, and the scope comes from who is calling (the
API key's tenant), never from what the caller claims; the OpenAI ``user`` field may only narrow it.

- Keys come from ``--api-key`` (repeatable; else ``$VERISPEC_API_KEY``), tenant :data:`DEFAULT_TENANT`,
  and from ``--api-keys-file``: a JSON object ``{"KEY": "TENANT", ...}`` (:func:`read_keys_file`).
- With keys, :class:`RequireKey` answers every path but :data:`OPEN_PATHS` with a 401 unless the
  request carries a known key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``). It is ASGI
  middleware in front of the router, so a route added later cannot be left open by mistake.
- The scope (:func:`cache_scope`) is the tenant, narrowed by ``user``; without keys a request is
  private (scope None) unless the server runs with ``--shared-cache``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from verispec.errors import VerispecError
from verispec.server.errors import APIError

DEFAULT_TENANT = "default"
"""The tenant of keys given with ``--api-key`` (or ``$VERISPEC_API_KEY``) that the keys file does
not name."""
ANONYMOUS_TENANT = ""
"""The one tenant of every request on a server without keys started with ``--shared-cache``; no
keys file can name it (tenants are not empty), so it never meets a real tenant's scope."""
ENV_KEY = "VERISPEC_API_KEY"
"""The environment variable read for a key when no ``--api-key`` is given (as vLLM reads
``VLLM_API_KEY``): a key in the environment stays out of ``ps``."""
OPEN_PATHS = frozenset({"/", "/health"})
"""Paths answered without a key: liveness, and the web page, which holds no data (it asks for the
key itself and sends it with every call)."""
MAX_TENANT_CHARS = 256
TENANT_SCOPE_KEY = "verispec.tenant"
"""Where :class:`RequireKey` leaves the caller's tenant in the ASGI scope for the handlers."""


def cache_scope(tenant: str | None, user: str | None) -> str | None:
    """The cache scope of a request from ``tenant`` whose body names ``user`` (None: private).

    Each part is length-prefixed (``7:default``, ``4:acme/5:alice``), so no tenant and user can
    spell another pair's scope: tenant ``a/b`` with user ``c`` is ``3:a/b/1:c``, tenant ``a`` with
    user ``b/c`` is ``1:a/3:b/c``. An empty ``user`` narrows nothing (clients send ``""`` for none).
    """
    if tenant is None:
        return None
    parts = [tenant, user] if user else [tenant]
    return "/".join(f"{len(part)}:{part}" for part in parts)


class KeyTable:
    """Known keys and their tenants, looked up in time that does not depend on the key presented.

    Keys are kept as SHA-256 digests and every lookup compares against all of them with
    :func:`hmac.compare_digest`: the time tells neither which key matched nor how much of a guess
    was right, and the equal-length digests hide the keys' lengths as well.
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            raise VerispecError("no API keys given")
        self._entries = tuple((_digest(key.encode("ascii")), tenant) for key, tenant in keys.items())
        self.tenants = frozenset(keys.values())

    def __len__(self) -> int:
        return len(self._entries)

    def tenant(self, presented: bytes) -> str | None:
        """The tenant of key ``presented``, or None for an unknown key."""
        digest = _digest(presented)
        found = None
        for stored, tenant in self._entries:  # no early exit: every key costs the same
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class Access:
    """Who may call the server and which requests share caches.

    ``keys`` None: anyone may call, and there are no tenants; each request is then private unless
    ``shared_cache``, where they all share one scope (for a server with a single trusted user).
    """

    keys: KeyTable | None = None
    shared_cache: bool = False

    def describe(self) -> str | None:
        """A line for the start-up message, where callers need keys or share caches."""
        if self.keys is not None:
            tenants = len(self.keys.tenants)
            ignored = " (--shared-cache changes nothing with keys)" if self.shared_cache else ""
            return (
                f"requests need an API key ({len(self.keys)} key{'s' * (len(self.keys) != 1)}, "
                f"{tenants} tenant{'s' * (tenants != 1)}; caches are shared within a tenant){ignored}"
            )
        if self.shared_cache:
            return "no API keys; --shared-cache: all requests share cached prompts and outputs"
        return None

    def check(self, scope: Scope) -> str | None:
        """The tenant of the request ``scope`` (None without keys or on an open path); raises the
        401 :class:`APIError` for a missing or unknown key."""
        if self.keys is None:
            return ANONYMOUS_TENANT if self.shared_cache else None
        if scope.get("path") in OPEN_PATHS:
            return None
        presented = list(presented_keys(scope.get("headers") or ()))
        if not presented:
            raise _unauthorized(
                "this server needs an API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`",
                "missing_api_key",
                "Bearer",
            )
        tenants = {self.keys.tenant(key) for key in presented}
        tenants.discard(None)
        if len(tenants) != 1:  # none known, or keys of two tenants (which one would it be?)
            raise _unauthorized("invalid API key", "invalid_api_key", 'Bearer error="invalid_token"')
        return tenants.pop()


def _unauthorized(message: str, code: str, challenge: str) -> APIError:
    return APIError(401, message, code=code, headers={"WWW-Authenticate": challenge})


def presented_keys(headers: Iterable[tuple[bytes, bytes]]) -> Iterable[bytes]:
    """The keys a request carries: ``Authorization: Bearer KEY`` (OpenAI's clients) and
    ``x-api-key: KEY`` (others); empty values are not keys."""
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                yield token.strip()
        elif name == b"x-api-key" and value.strip():
            yield value.strip()


def tenant_of(request: Request) -> str | None:
    """The caller's tenant, as :class:`RequireKey` found it (None: no tenant)."""
    try:
        return request.scope[TENANT_SCOPE_KEY]  # type: ignore[no-any-return]
    except KeyError:  # fail closed: a handler must never guess who is calling
        raise RuntimeError("the app has no RequireKey middleware: the caller is unknown") from None


class RequireKey:
    """ASGI middleware: the key check for every request, before routing (so for every route, those
    added later included, and for unknown paths too, which then do not reveal what exists).

    It leaves the caller's tenant in the scope (:func:`tenant_of`); a refused request gets its 401
    before anything reads its body or starts a stream.
    """

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        try:
            scope[TENANT_SCOPE_KEY] = self.access.check(scope)
        except APIError as refused:
            if scope["type"] == "http":
                await refused.response()(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------------- configuration


def load_access(
    api_keys: Sequence[str] | None,
    keys_file: str | Path | None,
    env: Mapping[str, str],
    *,
    shared_cache: bool = False,
) -> Access:
    """The :class:`Access` that ``serve``'s flags ask for; :class:`VerispecError` naming the flag
    (or the file's entry) for a bad key or tenant, an unreadable or malformed file.

    ``api_keys``: the ``--api-key`` values; where none are given, ``env[ENV_KEY]`` (if set and not
    empty) is the one. They map to :data:`DEFAULT_TENANT` unless the keys file names them.
    """
    keys: dict[str, str] = {}
    if api_keys:
        for key in api_keys:
            check_key(key, "--api-key")
            keys[key] = DEFAULT_TENANT
    elif env.get(ENV_KEY):
        check_key(env[ENV_KEY], ENV_KEY)
        keys[env[ENV_KEY]] = DEFAULT_TENANT
    if keys_file is not None:
        keys.update(read_keys_file(keys_file))
    return Access(KeyTable(keys) if keys else None, shared_cache)


def read_keys_file(path: str | Path) -> dict[str, str]:
    """Keys and their tenants from a JSON object ``{"KEY": "TENANT", ...}``.

    JSON because its errors have a line and column and its strings any character a tenant may
    hold. Refused: an unreadable file, bad JSON, anything but an object of strings, an empty key or
    tenant, a key that cannot travel in an HTTP header, a key given twice, no keys at all. Errors
    name the entry by position, never the key itself (the message may end up in a log).
    """
    where = f"--api-keys-file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a BOM from an editor is no error
    except OSError as exc:
        raise VerispecError(f"cannot read {where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise VerispecError(f"{where} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        pairs = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as exc:
        raise VerispecError(
            f"{where} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            'it must be an object {"KEY": "TENANT", ...}'
        ) from None
    if not isinstance(pairs, _Pairs):
        raise VerispecError(f'{where} must hold a JSON object {{"KEY": "TENANT", ...}}')
    keys: dict[str, str] = {}
    first: dict[str, int] = {}
    for number, (key, tenant) in enumerate(pairs, start=1):
        entry = f"{where}: entry {number}"
        check_key(key, entry)
        if key in first:
            raise VerispecError(f"{entry} repeats the key of entry {first[key]}; each key has one tenant")
        first[key] = number
        keys[key] = check_tenant(tenant, entry)
    if not keys:
        raise VerispecError(f"{where} holds no keys")
    return keys


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as its (key, value) pairs in order, repeats kept (``dict`` would drop them)."""


def check_key(key: str, where: str) -> None:
    """An API key must be visible ASCII without spaces: it travels in an HTTP header, which can
    carry nothing else reliably (and trims spaces at its ends)."""
    if not key:
        raise VerispecError(f"{where}: the API key is empty")
    if not all("!" <= c <= "~" for c in key):
        raise VerispecError(
            f"{where}: an API key must be printable ASCII without spaces (it travels in an HTTP header)"
        )


def check_tenant(tenant: object, where: str) -> str:
    """A tenant is a non-empty string of at most :data:`MAX_TENANT_CHARS` printable characters."""
    if not isinstance(tenant, str) or not tenant:
        raise VerispecError(f"{where}: the tenant must be a non-empty string, got {json.dumps(tenant)}")
    if len(tenant) > MAX_TENANT_CHARS:
        raise VerispecError(f"{where}: the tenant is over {MAX_TENANT_CHARS} characters")
    if any(unicodedata.category(c).startswith("C") for c in tenant):
        raise VerispecError(f"{where}: the tenant holds a control, format or unassigned character")
    return tenant
