"""Incremental detokenization: streamed text is always a prefix of the final text; stop strings cut it."""

from __future__ import annotations

from typing import ClassVar

import pytest

from verispec.detok import IncrementalDetokenizer


class PieceTokenizer:
    """Each id decodes to a fixed piece; id 0 is half of a two-token character (like split UTF-8)."""

    PIECES: ClassVar[dict[int, str]] = {
        1: "Hello", 2: " world", 3: "\n", 4: "def", 5: " f", 6: "():", 7: "STOP", 8: "ST", 9: "OP", 10: "!"
    }  # fmt: skip

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        out, halves = "", 0
        for tok in [*ids, None]:
            if tok == 0:
                halves += 1
                continue
            out += "é" * (halves // 2) + "\ufffd" * (halves % 2)
            halves = 0
            out += self.PIECES.get(tok, "") if tok is not None else ""
        return out


def stream(ids, stop=()):
    detok = IncrementalDetokenizer(PieceTokenizer(), prompt_ids=[1], stop=stop)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces, detok


def test_plain_stream_concatenates_to_full_text():
    pieces, detok = stream([1, 2, 3, 4, 5, 6])
    assert "".join(pieces) == "Hello world\ndef f():"
    assert not detok.stopped


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([1, 2, 7, 1], "Hello world"),  # stop string in one token
        ([1, 8, 9, 2], "Hello"),  # stop string split over two tokens
        ([1, 8, 10], "HelloST!"),  # a stop-string prefix that does not complete is released
    ],
)
def test_stop_strings_cut_the_text_and_never_leak(ids, expected):
    pieces, detok = stream(ids, stop=["STOP"])
    text = "".join(pieces)
    assert text == expected
    assert "STOP" not in text
    assert detok.stopped == ("STOP" in "".join(PieceTokenizer.PIECES[i] for i in ids))


def test_a_tail_as_long_as_a_stop_prefix_is_held_back_until_decided():
    detok = IncrementalDetokenizer(PieceTokenizer(), prompt_ids=[1], stop=["STOP"])
    assert detok.add(2) == " wo"  # " world" minus the 3-character tail that could begin "STOP"
    assert detok.add(8) == "rl"  # " worldST": "dST" is held back
    assert detok.add(10) == "d"  # " worldST!": "ST!" is held back, though it can no longer match
    assert detok.flush() == "ST!"
    assert not detok.stopped


def test_incomplete_character_waits_for_its_second_half():
    detok = IncrementalDetokenizer(PieceTokenizer(), prompt_ids=[1])
    assert detok.add(0) == ""
    assert detok.add(0) == "é"
