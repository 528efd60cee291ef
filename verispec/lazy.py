"""Package attributes imported on first use (PEP 562's module ``__getattr__``).

``verispec`` and ``verispec.models`` name classes whose modules import PyTorch; importing them
lazily keeps ``import verispec`` (the CLI's ``--help`` and ``verispec models``) free of PyTorch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, origins: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``origins`` maps each lazy name to the module that
    defines it. The first look-up imports that module and stores the value in the package's
    namespace, so later look-ups find it there and skip this function."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = origins.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
