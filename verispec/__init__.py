"""verispec: exact speculative decoding for large language models.

>>> import verispec
>>> engine = verispec.load("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
...                        method="draft", num_speculative_tokens=5)
>>> gen = engine.generate("def quicksort(xs):", max_new_tokens=64)

The names below the errors are imported on first use: ``import verispec`` (and so every
``verispec.*`` module, the CLI's included) costs no PyTorch import until a model is needed, which
keeps ``verispec models`` and ``--help`` instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verispec.errors import ConfigError, VerispecError
from verispec.lazy import lazy_attributes

if TYPE_CHECKING:
    from verispec.api import load
    from verispec.engine import SpecEngine
    from verispec.structured import Structured
    from verispec.types import Draft, Generation, TokenEvent, VerifyResult

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "Draft",
    "Generation",
    "SpecEngine",
    "Structured",
    "TokenEvent",
    "VerifyResult",
    "VerispecError",
    "load",
]

_LAZY = {
    "load": "verispec.api",
    "SpecEngine": "verispec.engine",
    "Structured": "verispec.structured",
    "Draft": "verispec.types",
    "Generation": "verispec.types",
    "TokenEvent": "verispec.types",
    "VerifyResult": "verispec.types",
}
"""Public name -> the module that defines it (each imports PyTorch)."""


__getattr__ = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
