"""Every error the server answers, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Clients (the openai package included) read the status code and this body, so every path that can
refuse a request ends here: invalid JSON and schema violations (FastAPI's 422 becomes a 400, which is
what OpenAI returns), :class:`~verispec.errors.VerispecError` from the engine's validation (400;
a :class:`~verispec.errors.ConfigError` names its setting, which becomes the request field in ``param``),
a full queue (429 with ``Retry-After``), unknown routes (404) and bodies over the size limit (413).
A 5xx means a bug or a stopped engine, never bad input.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from verispec.errors import ConfigError, QueueFullError, VerispecError
from verispec.server.protocol import request_param

log = logging.getLogger(__name__)

INVALID = "invalid_request_error"

_FRIENDLY = {
    "prompt": "prompt must be a non-empty string, a list of token ids, or a list holding one of those",
    "stop": "stop must be a string or a list of strings",
    "tool_choice": 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
    '{"name": ...}}',
}
"""Messages for union-typed fields, whose raw pydantic errors list one complaint per alternative."""

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """A refusal with an HTTP status and an OpenAI error body (raise it anywhere in a handler)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = INVALID,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, *, type: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_verispec_error(exc: VerispecError, param: str | None = None) -> APIError:
    """The HTTP refusal for an engine error: 429 for a full queue, else a 400 whose ``param`` is
    ``param`` or, for a :class:`ConfigError`, the request field of its setting (and its message
    names that field)."""
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, ConfigError) and param is None:
        param = request_param(exc.field)
        if param is not None:
            return APIError(400, exc.named(param), param=param)
    return APIError(400, str(exc), param=param)


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 from FastAPI's validation errors: the first complaint per field, at most three."""
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(
            400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="json_invalid"
        )
    parts: dict[str, str] = {}
    for err in errors:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        param = _param(loc)
        if param is None:
            parts.setdefault("", _body_message(err))
            continue
        friendly = _FRIENDLY.get(str(loc[0])) if err.get("type") != "missing" else None
        parts.setdefault(param, friendly or f"{param}: {err.get('msg', 'invalid')}")
    messages = list(parts.values())
    params = [p for p in parts if p]
    return APIError(
        400,
        "; ".join(messages[:3]) or "invalid request body",
        param=params[0] if len(params) == 1 else None,
        code="invalid_value",
    )


def _body_message(err: Any) -> str:
    if err.get("type") == "missing":
        return "the request needs a JSON object body"
    return f"the request body must be a JSON object: {err.get('msg', 'invalid')}"


def _param(loc: Sequence[Any]) -> str | None:
    """``messages[0].content`` from a pydantic location, without union member tags like ``list[int]``."""
    if not loc:
        return None
    out = str(loc[0])
    if out in _FRIENDLY:
        return out
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in part and part not in _TYPE_TAGS and not part.startswith(("function-", "literal")):
            out += f".{part}"
    return out


async def _on_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _on_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


async def _on_verispec(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, VerispecError)
    return from_verispec_error(exc).response()


async def _on_http(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = exc.detail if isinstance(exc.detail, str) else "request refused"
    return APIError(
        exc.status_code, message, code=codes.get(exc.status_code), headers=dict(exc.headers or {})
    ).response()


async def _on_bug(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return APIError(500, f"internal server error: {exc!r}", type="server_error").response()


def install_handlers(app: FastAPI) -> None:
    """Answer every refusal, and every bug, with an OpenAI error body."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(VerispecError, _on_verispec)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_bug)


class BodyLimit:
    """ASGI middleware: a 413 for a ``Content-Length`` over ``max_bytes``, before anything reads it.

    A prompt can only be as long as the model's context, so megabytes of body are a mistake or an
    attack; refusing on the header saves parsing them. (A chunked body without the header is read.)
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                error = APIError(
                    413, f"the request body is over {self.max_bytes} bytes", code="request_too_large"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
