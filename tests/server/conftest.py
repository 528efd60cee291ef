"""The tiny speculative server most server tests share (a module may define its own ``server``)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.harness import LiveServer, live_server, make_engine, tiny_pair


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """A tiny target with a real tokenizer and its perturbed draft, k = 3, served as ``tiny``."""
    target, draft = tiny_pair()
    with live_server(make_engine(target, draft, "draft", k=3), name="tiny") as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()
