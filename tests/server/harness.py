"""Tools for the server tests: a tiny model with a real tokenizer, and a real uvicorn server.

The tiny tokenizer is a byte-level BPE trained in a fraction of a second on a few sentences, with a
chat template: any Unicode text encodes, so text prompts, chat and stop strings are tested without
loading a real model. Its end-of-sequence row of the LM head is zeroed, which keeps greedy decoding
from ever ending early, so lengths in the tests are exact.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import httpx
import openai
import torch
import uvicorn
from fastapi import FastAPI
from transformers import PreTrainedTokenizerFast

from tests.conftest import make_engine, perturbed, tiny_llama
from verispec.async_engine import AsyncEngine
from verispec.engine import SpecEngine
from verispec.models.hf import HFCausalLM
from verispec.server import bind_socket, create_app
from verispec.server.metrics import ServerMetrics

T = TypeVar("T")

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "<system>You are helpful.<|end|><user>hello world<|end|><assistant>Hi there!<|end|>",
    "Speculative decoding drafts tokens and verifies them with the target model.",
]


@lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_pair(context: int = 512) -> tuple[HFCausalLM, HFCausalLM]:
    """A tiny random target with the tiny tokenizer and a perturbed copy of it as its draft."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()  # greedy never picks EOS: exact lengths
    draft = perturbed(model, 0.3, seed=1)
    for m in (model, draft):
        m.config.max_position_embeddings = context
    target = HFCausalLM(model, name="tiny-target", tokenizer=tokenizer)
    return target, HFCausalLM(draft, name="tiny-draft", tokenizer=tokenizer)


@dataclass
class LiveServer:
    """A uvicorn server on a free loopback port, in a thread of this process."""

    url: str
    name: str
    async_engine: AsyncEngine
    metrics: ServerMetrics
    app: FastAPI

    def client(self, api_key: str = "unused", **options: Any) -> openai.OpenAI:
        """An openai client of this server (``api_key``: sent as ``Authorization: Bearer``)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **options)

    def on_engine(self, fn: Callable[[SpecEngine], T], timeout: float = 30) -> T:
        """``fn(engine)`` on the engine thread, between steps."""
        return self.async_engine.call(fn).result(timeout=timeout)

    def sequences(self) -> int:
        """Requests the engine holds, running or waiting."""
        return self.on_engine(lambda e: len(e.running) + len(e.waiting))

    def wait_idle(self, timeout: float = 10.0) -> float:
        """Seconds until the engine holds no request; fails after ``timeout``."""
        start = time.monotonic()
        while self.sequences():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"the engine still holds {self.sequences()} requests after {timeout} s")
            time.sleep(0.02)
        return time.monotonic() - start

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value in the app's registry (0 when it was never set)."""
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@contextmanager
def live_server(engine: SpecEngine, name: str = "tiny", **app_options: Any) -> Iterator[LiveServer]:
    """Serve ``engine`` with :func:`create_app` and uvicorn until the block ends.

    PyTorch runs on one thread meanwhile: the tiny models gain nothing from two, and on a busy
    2-core machine two threads spinning at OpenMP barriers made a step 50x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    metrics = ServerMetrics()
    app = create_app(async_engine, name, metrics=metrics, **app_options)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = sock.getsockname()[1]
        yield LiveServer(f"http://127.0.0.1:{port}", name, async_engine, metrics, app)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        async_engine.shutdown()
        sock.close()
        torch.set_num_threads(threads)


@contextmanager
def tiny_server(name: str, k: int, **app_options: Any) -> Iterator[LiveServer]:
    """The tiny target drafted for by its perturbed copy (``k`` tokens a step), served as ``name``
    (``app_options``: for :func:`create_app`)."""
    target, draft = tiny_pair()
    with live_server(make_engine(target, draft, "draft", k=k), name=name, **app_options) as live:
        yield live


def await_cli_server(proc: subprocess.Popen[str], seconds: float) -> tuple[str, str]:
    """The URL a ``verispec serve`` subprocess serves at and the line that said so, once /health
    answers: the lines before it (a model's first-use preparation) are skipped."""
    assert proc.stderr is not None
    skipped: list[str] = []
    while not (match := re.search(r"serving \S+ at (http://\S+) ", line := proc.stderr.readline())):
        skipped.append(line)
        assert line and len(skipped) < 50, "".join(skipped)
    url = match.group(1)
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return url, line
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
        time.sleep(0.1)


def stop_cli_server(proc: subprocess.Popen[str]) -> str:
    """Stop a ``verispec serve`` subprocess as Ctrl-C does; its stderr after start-up. It must end
    cleanly (0, or 130 for the interrupt)."""
    proc.send_signal(signal.SIGINT)
    try:
        _, rest = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode in (0, 130), rest
    return rest
