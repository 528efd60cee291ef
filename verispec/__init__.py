"""verispec: exact speculative decoding for large language models.

>>> import verispec
>>> engine = verispec.load("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
...                        method="draft", num_speculative_tokens=5)
>>> gen = engine.generate("def quicksort(xs):", max_new_tokens=64)
"""

from __future__ import annotations

from verispec.api import load
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.structured import Structured
from verispec.types import Draft, Generation, TokenEvent, VerifyResult

__version__ = "0.1.0"
__all__ = [
    "Draft",
    "Generation",
    "SpecEngine",
    "Structured",
    "TokenEvent",
    "VerifyResult",
    "VerispecError",
    "load",
]
