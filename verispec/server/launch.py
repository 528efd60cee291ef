"""Running the server: bind first, load the models, then serve with uvicorn until interrupted.

The listening socket is bound before the (slow) model load and handed to uvicorn, so a port in use
or a bad host is a one-line :class:`VerispecError` at once, not a uvicorn traceback after a minute.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys

from verispec.async_engine import AsyncEngine
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.server.auth import Access


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0 picks a free one); VerispecError if impossible."""
    if not 0 <= port <= 65535:
        raise VerispecError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise VerispecError(f"cannot resolve --host {host!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise VerispecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def cap_malloc_arenas(limit: int = 2) -> bool:
    """Cap glibc malloc at ``limit`` arenas unless ``MALLOC_ARENA_MAX`` is set; True if capped.

    glibc gives threads that contend for malloc arenas of their own (up to 8 per core) and rarely
    returns their memory. The server's threads (the event loop, the engine's step loop, PyTorch's)
    allocate tensors of a new shape at every batch size and length, so its idle RSS kept rising for
    ~300 requests before it levelled off (+145 MB on SmolLM2 with prompt lookup);
    with two arenas it ended lower (940-976 MB after 400 requests, against 1006-1055 MB) at the same
    request rate. Called before the model load, so the threads made then are capped too.
    """
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_ARENA_MAX, limit))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt arenas)
        return False


def ready(engine: SpecEngine) -> SpecEngine:
    """``engine`` with its step costs measured (or loaded) now, not on the first request."""
    if engine.proposer is not None:
        _ = engine.policy
    return engine


def serve(
    engine: SpecEngine,
    sock: socket.socket,
    served_model_name: str,
    *,
    log_level: str = "info",
    access: Access | None = None,
) -> None:
    """Serve ``engine`` on ``sock`` (from :func:`bind_socket`) until interrupted; ``access``: the
    API keys it requires and how requests share caches (:func:`verispec.server.auth.load_access`)."""
    import uvicorn

    from verispec.server.app import create_app

    async_engine = AsyncEngine(ready(engine))
    app = create_app(async_engine, served_model_name, access=access)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"verispec: serving {served_model_name} at http://{shown}:{port} ({engine.spec.describe()}; "
        f"OpenAI API under /v1, metrics at /metrics)",
        file=sys.stderr,
    )
    described = (access or Access()).describe()
    if described is not None:
        print(f"verispec: {described}", file=sys.stderr)
    async_engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        async_engine.shutdown()
        sock.close()
