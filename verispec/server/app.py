"""The FastAPI app: OpenAI routes over an :class:`~verispec.async_engine.AsyncEngine`.

Handlers never touch the engine directly: tokenizing and validation run on the engine thread
(:func:`verispec.server.translate.build_request` through ``AsyncEngine.call``), generation goes
through ``AsyncEngine.add``. A request whose client goes away is aborted at once, streaming or not,
so it stops taking a batch slot from the others.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from verispec.async_engine import SHUTDOWN_MESSAGE, AsyncEngine, RequestStream
from verispec.engine import SpecEngine, TokenLogprobs
from verispec.errors import VerispecError
from verispec.metrics import SpecStats
from verispec.server.auth import OPEN_PATHS, Access, RequireKey, cache_scope, tenant_of
from verispec.server.errors import APIError, BodyLimit, error_body, from_verispec_error, install_handlers
from verispec.server.metrics import CountRequests, RequestTimer, ServerMetrics
from verispec.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
)
from verispec.server.responses import DONE, ChunkWriter, Echo, Kind, full_response, sse
from verispec.server.translate import Prepared, build_request, check_model, reject_unsupported
from verispec.types import TokenEvent

T = TypeVar("T")

STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 16 * 1024 * 1024
ENGINE_CALL_TIMEOUT = 120.0
"""Seconds to wait for the engine thread to tokenize a request (it does so between steps)."""

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (OpenAI error body)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    429: {"model": ErrorResponse, "description": "Queue full; retry after the Retry-After header's seconds"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}
_UNAUTHORIZED = {
    "description": "Missing or unknown API key (a server started with keys; see WWW-Authenticate)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The response, or with stream=true server-sent events (see the verispec.server docs)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


class _State:
    """What the handlers share."""

    def __init__(self, async_engine: AsyncEngine, model: str, metrics: ServerMetrics) -> None:
        self.async_engine = async_engine
        self.engine: SpecEngine = async_engine.engine
        self.model = model
        self.metrics = metrics
        self.created = int(time.time())

    async def on_engine(self, fn: Callable[[SpecEngine], T], timeout: float = ENGINE_CALL_TIMEOUT) -> T:
        """``fn(engine)`` on the engine thread; 503 if the thread is gone or does not answer."""
        if not self.async_engine.alive:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        future = self.async_engine.call(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine did not answer in time", type="server_error") from None


def create_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    *,
    metrics: ServerMetrics | None = None,
    static_dir: Path = STATIC_DIR,
    max_body_bytes: int = MAX_BODY_BYTES,
    access: Access | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine`` (which the caller starts and shuts down).

    ``access``: the API keys every route but ``/health`` and ``/`` requires, and how requests share
    caches (:mod:`verispec.server.auth`); by default anyone may call and every request is private.
    """
    metrics = metrics or ServerMetrics()
    metrics.watch_prefix_cache(async_engine.engine.prefix_cache)
    state = _State(async_engine, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        observers = async_engine.engine.step_observers
        observers.append(metrics.observe_step)  # list.append is atomic: safe beside the engine thread
        try:
            yield
        finally:
            with suppress(ValueError):
                observers.remove(metrics.observe_step)

    app = FastAPI(
        title="verispec",
        summary="OpenAI-compatible speculative decoding server",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.verispec = state
    install_handlers(app)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, **_STREAM_DOC},
        summary="Text completion (OpenAI); stream=true streams server-sent events",
    )
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await _generate(state, body, raw, "completion", "/v1/completions")

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, **_STREAM_DOC},
        summary="Chat completion (OpenAI) through the model's chat template",
    )
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await _generate(state, body, raw, "chat", "/v1/chat/completions")

    @app.get("/v1/models", response_model=ModelList, summary="The served model (OpenAI)")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(state)])

    @app.get(
        "/v1/models/{model}", response_model=ModelCard, responses={404: _ERRORS[404]}, summary="One model"
    )
    async def model(model: str) -> ModelCard:
        if model != state.model:
            raise APIError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")
        return _model_card(state)

    @app.get("/health", response_model=Health, responses={503: _ERRORS[503]}, summary="Liveness")
    async def health() -> Any:
        if not async_engine.alive:
            return JSONResponse(error_body("the engine is not running", type="server_error"), status_code=503)
        return Health(status="ok")

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
        summary="Prometheus metrics",
    )
    async def prometheus() -> Response:
        with suppress(APIError):  # a stopped engine still has its metrics read
            running, waiting = await state.on_engine(lambda e: (len(e.running), len(e.waiting)), timeout=1.0)
            metrics.queue(running, waiting)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    index = static_dir / "index.html"

    @app.get("/", response_class=FileResponse, responses={404: _ERRORS[404]}, summary="The web page")
    async def page() -> Any:
        if not index.is_file():
            raise APIError(
                404, "no web page is installed (verispec/server/static/index.html)", code="not_found"
            )
        return FileResponse(index)

    if static_dir.is_dir():
        app.mount("/static", StaticFiles(directory=static_dir), name="static")

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    # Outside the body limit (a caller without a key learns nothing, not even the limit) and inside
    # the counter (refusals show up in verispec_requests_total{status="401"}).
    app.add_middleware(RequireKey, access=access or Access())
    app.add_middleware(CountRequests, metrics=metrics, routes=app.router.routes)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _model_card(state: _State) -> ModelCard:
    engine = state.engine
    return ModelCard(
        id=state.model,
        created=state.created,
        max_model_len=engine.target.max_context,
        verispec={
            "target": engine.target.name,
            "draft": engine.draft.name if engine.draft is not None else None,
            "method": engine.spec.method if engine.proposer is not None else None,
            "num_speculative_tokens": engine.spec.num_speculative_tokens
            if engine.proposer is not None
            else 0,
            "depth_policy": engine.spec.depth,
        },
    )


async def _generate(
    state: _State, body: CompletionRequest | ChatCompletionRequest, raw: Request, kind: Kind, endpoint: str
) -> Any:
    check_model(body, state.model)
    reject_unsupported(body)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    timer = RequestTimer(state.metrics, endpoint)
    scope = cache_scope(tenant_of(raw), body.user)
    prepared: Prepared = await state.on_engine(lambda e: build_request(e, body, request_id, scope))
    try:
        stream = await state.async_engine.add_all(prepared.requests)
    except VerispecError as exc:
        raise from_verispec_error(exc) from exc
    except RuntimeError as exc:  # the engine thread stopped since the request was built
        raise APIError(503, str(exc), type="server_error", code="engine_stopped") from exc
    timer.admitted(prepared.prompt_tokens)
    created = int(time.time())
    if body.stream:
        writer = ChunkWriter(
            kind,
            request_id,
            created,
            state.model,
            prepared.token_bytes,
            len(prepared.requests),
            prepared.tools,
        )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(stream, timer, writer, prepared, include_usage)

        async def close() -> None:
            """After the response, however it ended: the generator's `finally` handles cancellation
            inside it; this also covers a disconnect seen while it waited between chunks, or before
            it ever started."""
            await chunks.aclose()
            stream.abort()
            timer.finish("aborted")  # no-op when the generator already recorded how it ended

        return StreamingResponse(
            chunks,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(close),
        )
    collect = asyncio.ensure_future(_collect(stream, timer))
    watch = asyncio.ensure_future(_client_gone(raw))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():  # the client left (or this handler was cancelled): stop generating
            collect.cancel()
            with suppress(asyncio.CancelledError):
                await collect
    if collect.cancelled():
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    choices, scores = collect.result()
    echo = None if prepared.echo is None else Echo(prepared.echo, prepared.requests[0].prompt_ids, scores)
    return full_response(
        kind,
        request_id,
        created,
        state.model,
        choices,
        prepared.prompt_tokens,
        prepared.token_bytes,
        echo,
        prepared.tools,
        prepared.keep,
    )


async def _collect(
    stream: RequestStream, timer: RequestTimer
) -> tuple[list[list[TokenEvent]], list[TokenLogprobs | None] | None]:
    """Each choice's events, in choice order, and the prompt's scores where they were asked for
    (the same for every choice); an error in any choice fails the request."""
    choices: dict[str, list[TokenEvent]] = {rid: [] for rid in stream.request_ids}
    scores = None
    reason = "aborted"
    try:
        async with stream:
            async for output in stream:
                if output.error is not None:
                    reason = "error"
                    raise _engine_failure(output.error)
                timer.tokens(len(output.events))
                choices[output.request_id].extend(output.events)
                scores = output.prompt_logprobs if output.prompt_logprobs is not None else scores
        if not all(choices.values()):
            reason = "error"
            raise _engine_failure("the engine ended the request without any output")
        first = choices[stream.request_id]
        reason = first[-1].finish_reason or "error"
        return list(choices.values()), scores
    finally:
        timer.finish(reason)


async def _stream(
    stream: RequestStream, timer: RequestTimer, writer: ChunkWriter, prepared: Prepared, include_usage: bool
) -> AsyncIterator[str]:
    reason = "aborted"
    try:
        role = writer.role()
        if role is not None:
            yield role
        completion_tokens = 0
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        last: dict[int, TokenEvent] = {}  # each finished choice's last event
        echoed: set[int] = set()
        failed = False
        async for output in stream:
            if output.error is not None:
                reason, failed = "error", True
                yield sse(_engine_failure(output.error).body())
                break
            timer.tokens(len(output.events))
            completion_tokens += len(output.events)
            i = index[output.request_id]
            chunks = []
            if prepared.echo is not None and i not in echoed:  # the prompt first, once per choice
                echoed.add(i)
                ids = prepared.requests[0].prompt_ids
                chunks.append(writer.echo(Echo(prepared.echo, ids, output.prompt_logprobs), i))
            chunks += [c for c in (writer.token(e, i) for e in output.events) if c is not None]
            if output.finished and output.events:
                last[i] = output.events[-1]
            if chunks:
                yield "".join(chunks)  # one write per step; still one SSE event per token
        if not failed and len(last) == len(index):
            reason = last[0].finish_reason or "error"
            # Counted before the last writes: a client that stops reading at [DONE] (the openai
            # client does) must find the request already counted, not after this generator resumes.
            timer.finish(reason)
            if include_usage:
                stats = SpecStats.combined([e.stats or SpecStats() for _, e in sorted(last.items())])
                yield writer.usage(prepared.prompt_tokens, completion_tokens, stats)
        yield DONE
    finally:
        stream.abort()
        timer.finish(reason)


def _engine_failure(message: str) -> APIError:
    """The error for a request the engine ended with an error (a bug, or the server stopping)."""
    if message == SHUTDOWN_MESSAGE:
        return APIError(503, message, type="server_error", code="engine_stopped")
    return APIError(500, f"generation failed: {message}", type="server_error")


async def _client_gone(raw: Request) -> None:
    """Return when the client disconnects (the body is already read, so only that message is left)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 responses (validation errors are 400s here, as in OpenAI's
    API), and with the 401 of a server with keys on every operation that needs one."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for name, path in schema.get("paths", {}).items():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
                if name not in OPEN_PATHS:
                    operation.setdefault("responses", {})["401"] = _UNAUTHORIZED
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
