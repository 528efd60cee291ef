"""Incremental detokenization: streamed text is always a prefix of the final text; stop strings cut it."""

from __future__ import annotations

from typing import ClassVar

import pytest

from tests.conftest import needs_smollm2
from verispec.detok import IncrementalDetokenizer, token_bytes_table, token_text


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


@needs_smollm2
def test_token_bytes_of_a_byte_level_tokenizer_rebuild_split_characters():
    """SmolLM2 splits CJK characters and emoji into byte tokens: each token's own bytes still join
    to the text, and a token holding part of a character is named by its escaped bytes."""
    from transformers import AutoTokenizer

    from verispec.models.cache import hf_folder_for

    tokenizer = AutoTokenizer.from_pretrained(hf_folder_for("smollm2-135m-instruct"))
    table = token_bytes_table(tokenizer)
    assert len(table) == len(tokenizer)
    text = "héllo → 世界 😀"
    ids = tokenizer.encode(text)
    assert b"".join(table[i] for i in ids) == text.encode()
    names = [token_text(table[i]) for i in ids]
    assert names[:5] == ["h", "é", "llo", " →", " "]
    assert any(n.startswith("bytes:\\x") for n in names)
    assert table[tokenizer.convert_tokens_to_ids("<|im_end|>")] == b"<|im_end|>"


def test_token_bytes_of_another_tokenizer_decode_each_token():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "héllo": 1, "wörld": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert token_bytes_table(tokenizer)[1:] == ["héllo".encode(), "wörld".encode()]


def test_token_text_escapes_part_of_a_character():
    assert token_text("é".encode()) == "é"
    assert token_text("世".encode()[:2]) == "bytes:\\xe4\\xb8"
