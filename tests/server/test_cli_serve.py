"""``verispec serve`` as a real subprocess: one-line startup errors, then a working server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.harness import await_cli_server, stop_cli_server, tiny_pair
from verispec.server import cap_malloc_arenas


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verispec.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """The tiny target with its tokenizer and chat template, as ``save_pretrained`` writes them."""
    folder = tmp_path_factory.mktemp("serve") / "tiny-chat"
    target, _ = tiny_pair()
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


def assert_one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and needle in out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr


def test_port_in_use_fails_at_once_on_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_serve("--target", "no-such-model", "--port", str(port))
    assert_one_line_error(out, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        (["--port", "70000"], "--port"),
        (["--host", "no.such.host.invalid"], "--host"),
        (["--target", "no-such-model"], "no-such-model"),
    ],
)
def test_bad_settings_are_one_line_errors(args, needle):
    assert_one_line_error(run_serve("--port", "0", *args), needle)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_malloc_arenas_are_capped_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert cap_malloc_arenas()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert not cap_malloc_arenas()


def test_serves_with_speculation_by_default_until_interrupted(model_folder, tmp_path, flat_costs):
    """No method named: the server speculates (suffix decoding here, no heads being shipped for this
    model) under the adaptive depth policy, and a request may still turn speculation off."""
    env = {**os.environ, "VERISPEC_CACHE": str(tmp_path / "cache")}
    command = [
        sys.executable, "-m", "verispec.cli", "serve", "--target", str(model_folder), "--port", "0",
        "--costs", str(flat_costs), "--quantization", "none", "--threads", "1",
        "--served-model-name", "tiny-chat", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, line = await_cli_server(proc, 60)
        assert "serving tiny-chat at" in line and "method suffix, adaptive depth up to k=5" in line
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        card = httpx.get(f"{url}/v1/models").json()["data"][0]["verispec"]
        assert card["method"] == "suffix" and card["depth_policy"] == "adaptive"
        prompt = "hello world hello world hello world hello world"  # a continuation to draft at once
        spec, plain = (
            client.completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=12, extra_body={"speculation": {"enabled": on}}
            )
            for on in (True, False)
        )
        assert spec.model_extra["verispec"]["stats"]["drafted"] > 0
        assert plain.model_extra["verispec"]["stats"]["drafted"] == 0
        assert spec.choices[0].text == plain.choices[0].text
        reply = client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=6
        )
        assert reply.usage.completion_tokens == 6
        assert reply.model_extra["verispec"]["stats"]["output_tokens"] == 6
    finally:
        rest = stop_cli_server(proc)
    assert "Traceback" not in rest
