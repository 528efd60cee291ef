"""Pretend one C++ kernel source failed to build (the others load as usual), for fallback tests."""

from __future__ import annotations

import pytest

from verispec.models import native


def fail_build(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """From now on ``native.load(source)`` says "no g++", and nobody has warned about it yet."""
    real_load = native.load
    monkeypatch.setattr(
        native, "load", lambda name: f"building {name} failed: no g++" if name == source else real_load(name)
    )
    monkeypatch.setattr(native, "_warned", set())
