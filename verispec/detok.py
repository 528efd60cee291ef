"""Incremental detokenization with stop strings.

Decoding the whole output again for every token is quadratic, and decoding tokens one at a time is
wrong for byte-level BPE (a character can span tokens, and spaces depend on neighbours). The usual
fix (vLLM, TGI) decodes a short window of recent tokens twice and emits the difference. Text that
could still become the start of a stop string is held back until it can't, so the streamed text is
always a prefix of the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        # Start the window in the prompt so the first generated token decodes with its left context.
        self.ids: list[int] = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that can be released now (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release()

    def _release(self) -> str:
        safe = len(self.text)
        for s in self.stop:
            start = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if start != -1:
                self.text = self.text[:start]
                self.stopped = True
                safe = start
                break
        if not self.stopped and self.stop:
            # Hold back a tail that could be the beginning of a stop string.
            hold = max(len(s) for s in self.stop) - 1
            safe = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return out

    def flush(self) -> str:
        """At the end of generation: release whatever was held back."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def token_bytes_table(tokenizer: Any) -> list[bytes]:
    """Each token id's own bytes, for log-probability responses (OpenAI's ``bytes``).

    Decoding a token alone is lossy where it holds part of a multi-byte character (SmolLM2 splits
    most CJK characters and emoji so), so byte-level BPE pieces are mapped back through GPT-2's
    byte-to-character table; other tokenizers' tokens are decoded one by one. Built once per
    engine, on first use (a fraction of a second for a 150k vocabulary)."""
    import tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ids = list(range(len(tokenizer)))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
        to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        pieces = tokenizer.convert_ids_to_tokens(ids)
        return [
            bytes(to_byte[c] for c in piece) if all(c in to_byte for c in piece) else piece.encode()
            for piece in pieces
        ]
    return [tokenizer.decode([i], clean_up_tokenization_spaces=False).encode() for i in ids]


def token_text(raw: bytes) -> str:
    """A token's text for log-probability responses: its bytes as UTF-8, or, for part of a
    character, ``bytes:`` and the bytes escaped (``bytes:\\xe4\\xb8``), as OpenAI writes them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
