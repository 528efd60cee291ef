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
