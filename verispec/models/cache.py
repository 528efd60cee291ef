"""Converted-model cache: any model source becomes a Hugging Face folder that loads in seconds.

transformers de-quantizes a GGUF file on every load, which takes minutes for the bigger models.
The first use of a GGUF model therefore loads it once, de-quantized to float32, and saves model and
tokenizer with ``save_pretrained`` into ``<cache>/hf/<key>/``; every later load reads safetensors.

``<key>`` is the registry name for a bundled model, and for any other .gguf file its stem plus a
hash of its absolute path, size and mtime (a changed file gets a new folder). A folder is written
under a temporary name and renamed when complete, and it holds ``verispec-source.json`` (written
last) saying where it came from; a folder without that file is not trusted.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from verispec.errors import VerispecError
from verispec.models.registry import BUNDLED, cache_root, ensure_gguf, unknown_model_error

SOURCE_FILE = "verispec-source.json"
"""Written last into a converted folder; its presence marks the folder complete."""

_GGUF_MAGIC = b"GGUF"

CONVERSION = 2
"""Revision of what a conversion writes, in a user GGUF's folder name, so that a folder written
before a change is not reused: 2 states Llama 3's ``rope_freqs`` as RoPE parameters."""


def hf_folder_for(source: str) -> Path:
    """A Hugging Face model folder for ``source``, converting (once) if needed.

    ``source`` is a bundled model name, a local Hugging Face model folder (returned as is) or a
    path to a .gguf file. Raises VerispecError with a clear message for anything else.
    """
    if source in BUNDLED:
        folder = _hf_root() / source
        if not is_complete(folder):  # a complete folder no longer needs the weight packages
            model = BUNDLED[source]
            gguf = ensure_gguf(model)
            _convert(gguf, folder, label=source, origin={"bundled": source, "sha256": model.sha256})
        return folder

    path = _local_path(source)
    if path.is_dir():
        return path
    return _folder_for_gguf(path)


def gguf_file_for(source: str) -> Path | None:
    """The GGUF file behind ``source``: a bundled model's verified file, or a .gguf path (checked
    to start like a GGUF file; its structure is checked by whoever parses it). None when ``source``
    is a Hugging Face model folder. Raises VerispecError as :func:`hf_folder_for` does."""
    if source in BUNDLED:
        return ensure_gguf(BUNDLED[source])
    path = _local_path(source)
    if path.is_dir():
        return None
    _check_magic(path)
    return path


def gguf_key(path: Path) -> str:
    """Cache key of a GGUF file: its stem and a hash of its absolute path, size and mtime, so a
    changed file gets a new key."""
    path = path.resolve()
    stat = path.stat()
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem)
    return f"{stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def _local_path(source: str) -> Path:
    """``source`` as a local Hugging Face folder (with its config.json) or an existing file,
    resolved; VerispecError for anything else (an unknown name lists the bundled models)."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise VerispecError(
                f"{source} is not a Hugging Face model folder (it has no config.json); "
                "pass a folder written by save_pretrained, a .gguf file or a bundled model name"
            )
        return path
    if not path.exists():
        if path.suffix.lower() == ".gguf" or os.sep in source or source.startswith(("~", ".")):
            raise VerispecError(f"no such file or folder: {source}")
        raise unknown_model_error(source)
    return path.resolve()


def is_converted(name: str) -> bool:
    """Whether bundled model ``name`` already has a complete converted folder in the cache."""
    return is_complete(_hf_root() / name)


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion (its source file is written last)."""
    return (folder / SOURCE_FILE).is_file() and (folder / "config.json").is_file()


def _hf_root() -> Path:
    return cache_root() / "hf"


def _folder_for_gguf(path: Path) -> Path:
    """Converted folder for a user-supplied GGUF file (validated first: it may be anything)."""
    stat = path.stat()
    folder = _hf_root() / f"{gguf_key(path)}-c{CONVERSION}"
    if not is_complete(folder):
        _validate_gguf(path)
        origin = {"gguf": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        _convert(path, folder, label=str(path), origin=origin)
    return folder


def _validate_gguf(path: Path) -> None:
    """Raise VerispecError unless ``path`` parses as a whole GGUF file (magic, header, tensor data)."""
    _check_magic(path)
    import gguf  # only needed here; keeps `verispec models` light

    try:
        reader = gguf.GGUFReader(path)  # memory-maps the file and parses every tensor's extent
        del reader
    except Exception as exc:  # the reader raises ValueError, IndexError, ... on a cut file
        raise VerispecError(
            f"{path} is not a readable GGUF file (truncated or corrupt download?): {exc}"
        ) from exc


def _check_magic(path: Path) -> None:
    """Raise VerispecError unless ``path`` starts with the GGUF magic bytes."""
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != _GGUF_MAGIC:
        raise VerispecError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); "
            "pass a .gguf file, a Hugging Face model folder or a bundled model name"
        )


def _estimate_seconds(gguf_size: int) -> int:
    """Rough conversion time on a 2-core CPU (measured: 20 s for 98 MB, 56 s for 491 MB, 82 s for 1.1 GB)."""
    return 10 * round(1.5 + 6.5 * gguf_size / 1e9)


def _convert(gguf: Path, folder: Path, *, label: str, origin: dict) -> None:
    """De-quantize ``gguf`` with transformers and save model and tokenizer into ``folder``."""
    import torch  # heavy imports only when converting
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.models import rope_freqs
    from verispec.models.gguf_file import read_gguf

    print(
        f"converting {label} (first use, ~{_estimate_seconds(gguf.stat().st_size)} s) into {folder} ...",
        file=sys.stderr,
    )
    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, KeyError, OSError) as exc:  # unsupported architecture, bad metadata, ...
            raise VerispecError(f"transformers could not load {label}: {exc}") from exc
        divisors = rope_freqs.file_divisors(read_gguf(gguf))  # Llama 3's: transformers drops them
        if divisors is not None:
            rope_freqs.state_in_config(model.config, divisors, required=True)
        # The weights are plain float32 tensors now; transformers only refuses to save them because
        # the model still says it is GGUF-quantized. Forget that and it saves (logits bitwise equal).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model, tokenizer
        gc.collect()  # free the de-quantized weights before the caller loads the saved ones

        seconds = time.perf_counter() - started
        tmp.chmod(0o755)  # mkdtemp (and safetensors) make them private; the cache is shared
        for file in tmp.iterdir():
            file.chmod(0o644)
        (tmp / SOURCE_FILE).write_text(json.dumps({**origin, "convert_seconds": round(seconds, 1)}, indent=1))
        _publish(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"converted {label} in {seconds:.0f} s", file=sys.stderr)


def _publish(tmp: Path, folder: Path) -> None:
    """Rename the finished ``tmp`` folder to ``folder``; fine if another process got there first."""
    if folder.exists() and not is_complete(folder):
        shutil.rmtree(folder)  # left by something other than verispec: it can't be trusted
    try:
        os.rename(tmp, folder)
    except OSError:
        if not is_complete(folder):
            raise
