"""Structured output (a JSON schema, any JSON object, a regex, a choice, a Lark grammar), lossless
under speculation.

The grammar engine is llguidance (the Rust library vLLM and SGLang also use): a matcher that follows
the tokens generated so far and gives the set of tokens allowed next. The target's disallowed logits
become -inf before any sampling transform. As with penalties (:mod:`verispec.penalties`), every row
of a verification forward is masked for its own context: row j of a chain after the committed tokens
plus draft tokens ``0..j-1``, a tree node's row after its path. The matcher walks each path and
rolls back, so the verifier sees exactly the rows plain constrained decoding would have seen, and
the output follows the constrained target distribution. A draft token the grammar forbids has
target probability 0 and is always rejected; rows after it are never used, so they are left
unmasked.

A row's mask depends only on its path, so masks are remembered until the next committed token: a
proposer that drafts under the grammar (the draft model, EAGLE) computes the masks of the same
contexts that the verification then needs, and each is computed once (~1.4 ms for Qwen's vocabulary).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from verispec.errors import VerispecError

StructuredKind = Literal["json", "regex", "choice", "grammar"]
T = TypeVar("T")


@dataclass(frozen=True)
class Structured:
    """What the output must match: ``json`` (a JSON schema, as a dict or its text; ``{"type":
    "object"}`` for any object), ``regex``, ``choice`` (one of several strings) or ``grammar``
    (Lark syntax, as llguidance reads it)."""

    kind: StructuredKind
    spec: Any

    def grammar(self) -> str:
        """llguidance's grammar text; raises VerispecError for a spec it cannot read."""
        try:
            return self._grammar()
        except VerispecError:
            raise
        except (ValueError, TypeError) as exc:  # llguidance's own parse errors
            raise VerispecError(f"structured output {self.kind}: {exc}") from exc

    def _grammar(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json":
            schema = self.spec if isinstance(self.spec, str) else json.dumps(self.spec)
            # Compact, on one line, no space after ':' or ',' (unless the schema's "x-guidance" says
            # otherwise): with free whitespace a model can pad forever instead of writing values.
            return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        if self.kind == "regex" and isinstance(self.spec, str):
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice" and isinstance(self.spec, list | tuple) and self.spec:
            if not all(isinstance(c, str) and c for c in self.spec):
                raise VerispecError("structured output: choice needs non-empty strings")
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.spec))
        if self.kind == "grammar" and isinstance(self.spec, str):
            return LLMatcher.grammar_from_lark(self.spec)
        raise VerispecError(f"structured output: {self.kind} needs {_WANTS.get(self.kind, 'a known kind')}")


_WANTS = {
    "json": "a JSON schema",
    "regex": "a regex string",
    "choice": "a list of strings",
    "grammar": "a Lark grammar string",
}


class Constraint:
    """One sequence's matcher: the masks of a verification's rows, and the tokens committed."""

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self.vocab_size = vocab_size
        self._known: dict[tuple[int, ...], torch.Tensor] = {}
        """Masks by path, for the committed tokens so far (cleared by :meth:`advance`)."""
        self._forced: dict[tuple[int, ...], list[int]] = {}
        """Forced continuations by path, remembered as the masks are."""
        if self.matcher.is_error():
            raise VerispecError(f"structured output: {self.matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens allowed after what the matcher has consumed."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.size)
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        return out

    def masks(self, row_paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[R, V] bool: row r's allowed tokens after the committed tokens plus ``row_paths[r]``; a row
        whose path holds a forbidden token is unreachable and left all True."""
        out = torch.ones(len(row_paths), self.vocab_size, dtype=torch.bool)
        for row, path in enumerate(row_paths):
            key = tuple(path)
            known = self._known.get(key)
            if known is None:
                known = self._known[key] = self._mask_after(list(path))
            out[row] = known
        return out

    def valid_prefix(self, path: Sequence[int]) -> int:
        """How many tokens of ``path`` the grammar allows in a row after the committed tokens
        (checked without consuming; microseconds, against ~1 ms for a mask)."""
        return int(self.matcher.validate_tokens(list(path)))

    def fits(self, path: Sequence[int]) -> bool:
        """Whether the grammar allows every token of ``path`` after the committed tokens."""
        return self.valid_prefix(path) == len(path)

    def forced(self, path: Sequence[int]) -> list[int]:
        """The tokens the grammar forces after the committed tokens plus ``path`` (llguidance's
        fast-forward tokens: the forced text's canonical tokenization, e.g. a JSON schema's next key
        and its quotes and colon), empty where the next token is a choice or ``path`` does not fit.

        For drafting: the verifier's rows (:meth:`masks`) are unchanged, and a forced token is a
        proposal like any other, checked by verification. It is a very good one: the target writes
        the canonical tokens (31 of 31 forced positions in the 0.5B's JSON-mode replies),
        and no drafter can guess a schema's key names better than the schema."""
        key = tuple(path)
        known = self._forced.get(key)
        if known is None:
            known = self._forced[key] = self._after(key, lambda: list(self.matcher.compute_ff_tokens())) or []
        return list(known)

    def _mask_after(self, path: list[int]) -> torch.Tensor:
        allowed = self._after(path, self.allowed)
        return torch.ones(self.vocab_size, dtype=torch.bool) if allowed is None else allowed

    def _after(self, path: Sequence[int], compute: Callable[[], T]) -> T | None:
        """``compute()`` with the matcher moved on by ``path`` and rolled back after; None where
        ``path`` leaves the grammar (a row no verification can reach)."""
        if path and not self.fits(path):
            return None
        if path and not self.matcher.consume_tokens(list(path)):
            raise VerispecError(f"structured output: {self.matcher.get_error()}")
        out = compute()
        self._rollback(len(path))
        return out

    def advance(self, token: int) -> None:
        """Consume a committed token (one the masks allowed)."""
        self._known.clear()
        self._forced.clear()
        if not self.matcher.consume_token(token):
            raise VerispecError(f"structured output: token {token} does not fit: {self.matcher.get_error()}")

    def _rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            raise VerispecError(f"structured output: rollback failed: {self.matcher.get_error()}")


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of the tokenizer (~1.5 s for Qwen's vocabulary: build once per engine)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
    except ValueError as exc:
        raise VerispecError(f"structured output needs a fast (Rust) tokenizer: {exc}") from exc
