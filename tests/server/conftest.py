"""The servers the server tests share: the tiny speculative one most use (a module may define its own
``server``), and the real Qwen2.5-Coder-0.5B with prompt lookup, started once for every test that
asks for ``qwen_server`` (tools, structured output, fill in the middle)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

import verispec
from tests.server.harness import LiveServer, live_server, tiny_server


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """A tiny target with a real tokenizer and its perturbed draft, k = 3, served as ``tiny``."""
    with tiny_server("tiny", k=3) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    """A client of ``server``: of this folder's, or of the one a module defines for itself."""
    return server.client()


@pytest.fixture(scope="session")
def qwen_server() -> Iterator[LiveServer]:
    """Qwen2.5-Coder-0.5B-Instruct drafting with prompt lookup (k = 4, fixed depth), served as ``qwen``
    (the modules using it skip themselves where the bundled models are not installed)."""
    engine = verispec.load(
        "qwen2.5-coder-0.5b-instruct", method="ngram", num_speculative_tokens=4, depth="fixed"
    )
    with live_server(engine, name="qwen") as live:
        yield live
