"""The kernels' builds: one per source text, torch and flags, shared by every checkout of the code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from verispec.models import native, registry


def test_two_checkouts_of_the_same_kernel_build_one_source_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    builds: list[dict] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: builds.append(kwargs))
    monkeypatch.setattr(registry, "cache_root", lambda: tmp_path / "cache")
    other = tmp_path / "checkout" / "kernels"
    shutil.copytree(native.SOURCES, other)
    for sources in (native.SOURCES, other):  # the same text under another path: the same build
        monkeypatch.setattr(native, "SOURCES", sources)
        monkeypatch.setattr(native, "_loaded", {})
        assert native.load("layer_ops.cpp") is None
    first, second = (Path(b["sources"][0]) for b in builds)
    assert first == second and first.is_relative_to(tmp_path / "cache")
    assert first.read_bytes() == (other / "layer_ops.cpp").read_bytes()
    assert builds[0]["build_directory"] == builds[1]["build_directory"] == str(first.parent)
    # a changed source is another build, from its own copy
    (other / "layer_ops.cpp").write_bytes(b"// changed\n" + first.read_bytes())
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("layer_ops.cpp") is None
    changed = Path(builds[2]["sources"][0])
    assert changed.parent != first.parent and changed.read_bytes().startswith(b"// changed")
