"""llama.cpp runs in a process of its own: its protocol, and a crash that fails one prompt, not the run.

The worker's protocol is tested with a fake ``Llama`` (no llama.cpp needed); the crash tests run a
real worker process whose fake model kills itself with SIGSEGV, as an AMX build of
llama-cpp-python has done. The real llama.cpp path runs in tests/bench/test_harness.py's end-to-end test
where the package is installed.
"""

from __future__ import annotations

import io
import json
import sys
import textwrap
from pathlib import Path

import pytest

from verispec.bench import llamacpp_worker
from verispec.bench.llamacpp_baselines import LlamaCppContender, LlamaCppWorker
from verispec.errors import VerispecError

REPO = Path(__file__).resolve().parents[2]


class FakeLlama:
    """Counts up from the last prompt token; refuses an empty prompt, as llama.cpp does."""

    def __init__(self) -> None:
        self.resets = 0

    def n_ctx(self) -> int:
        return 64

    def token_eos(self) -> int:
        return 7

    def reset(self) -> None:
        self.resets += 1

    def generate(self, prompt_ids: list[int], **sampling: float):
        if not prompt_ids:
            raise ValueError("empty prompt")
        assert sampling["temp"] == 0.0 and sampling["top_k"] == 1  # greedy

        def tokens():
            token = prompt_ids[-1]
            while True:
                token += 1
                yield token

        return tokens()


def test_worker_protocol_loads_answers_and_reports_a_refused_prompt(monkeypatch):
    fake = FakeLlama()
    monkeypatch.setattr(llamacpp_worker, "load", lambda settings: fake)
    requests = io.StringIO(
        "\n".join(
            json.dumps(m)
            for m in (
                {"model_path": "m.gguf"},
                {"prompt_ids": [1, 2], "max_new_tokens": 3, "eos_ids": []},
                {"prompt_ids": [3], "max_new_tokens": 10, "eos_ids": [6]},
                {"prompt_ids": [], "max_new_tokens": 3, "eos_ids": []},
            )
        )
        + "\n"
    )
    out = io.StringIO()
    assert llamacpp_worker.serve(requests, out) == 0
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"ready": {"n_ctx": 64, "eos": 7}}
    assert replies[1]["tokens"] == [3, 4, 5] and replies[1]["seconds"] >= 0
    assert replies[2]["tokens"] == [4, 5, 6]  # stops at an EOS id, which is kept
    assert replies[3] == {"error": "empty prompt"}
    assert fake.resets == 3  # every generation from an empty KV cache


def test_worker_reports_a_model_it_cannot_load(monkeypatch):
    def broken(settings):
        raise ValueError(f"Failed to load model from file: {settings['model_path']}")

    monkeypatch.setattr(llamacpp_worker, "load", broken)
    out = io.StringIO()
    assert llamacpp_worker.serve(io.StringIO(json.dumps({"model_path": "bad.gguf"}) + "\n"), out) == 1
    assert json.loads(out.getvalue()) == {"error": "ValueError: Failed to load model from file: bad.gguf"}


def fake_worker(tmp_path: Path, crash_on: str) -> list[str]:
    """A real worker process over FakeLlama that dies with SIGSEGV when loading ('load') or on a
    prompt starting with token 0 ('prompt'), after a line on standard error."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys
            sys.path.insert(0, {str(REPO)!r})
            from tests.bench.test_llamacpp_baselines import FakeLlama
            from verispec.bench import llamacpp_worker

            class Crashing(FakeLlama):
                def generate(self, prompt_ids, **sampling):
                    if prompt_ids[:1] == [0]:
                        print("ggml: illegal instruction in a kernel", file=sys.stderr, flush=True)
                        os.kill(os.getpid(), signal.SIGSEGV)
                    return super().generate(prompt_ids, **sampling)

            def load(settings):
                if {crash_on!r} == "load":
                    print("loading the AMX backend", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGSEGV)
                return Crashing()

            llamacpp_worker.load = load
            sys.exit(llamacpp_worker.main())
            """
        )
    )
    return [sys.executable, str(script)]


SETTINGS = {"model_path": "fake.gguf", "n_ctx": 64, "n_batch": 64, "n_threads": 1, "num_pred_tokens": None}


def test_a_crash_fails_that_prompt_and_the_next_prompt_gets_a_fresh_process(tmp_path):
    worker = LlamaCppWorker(SETTINGS, command=fake_worker(tmp_path, crash_on="prompt"))
    worker.start()
    contender = LlamaCppContender("llamacpp", worker, frozenset({7}), (), {})
    first = contender.generate([1, 2], 3)
    assert first.token_ids == [3, 4, 5] and first.prompt_tokens == 2
    pid = worker.proc.pid
    crashed = r"died \(signal SIGSEGV\): ggml: illegal instruction in a kernel"
    with pytest.raises(VerispecError, match=crashed):
        contender.generate([0, 1], 3)
    assert worker.proc is None
    again = contender.generate([1, 2], 3)  # a new process, the same answer
    assert again.token_ids == [3, 4, 5] and worker.proc.pid != pid
    worker.stop()


def test_a_crash_while_loading_is_a_clear_error(tmp_path):
    worker = LlamaCppWorker(SETTINGS, command=fake_worker(tmp_path, crash_on="load"))
    with pytest.raises(
        VerispecError, match=r"could not load fake\.gguf: .*signal SIGSEGV\): loading the AMX backend"
    ):
        worker.start()
    assert worker.proc is None


def test_the_contender_refuses_prompts_longer_than_the_context_without_asking_the_worker():
    worker = LlamaCppWorker(SETTINGS, command=["false"])  # never started
    contender = LlamaCppContender("llamacpp", worker, frozenset(), (), {})
    with pytest.raises(VerispecError, match=r"exceed llama\.cpp's context of 64"):
        contender.generate(list(range(60)), 8)
    assert worker.proc is None
