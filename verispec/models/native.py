"""verispec's own C++ operators: compiled on first use for this CPU, cached, loaded once.

``torch.utils.cpp_extension`` builds each source with the g++ and ninja it needs (~1 min the first
time) into verispec's cache folder, under a name keyed by the source, torch's version and the
flags, so a changed kernel or CPU gets a fresh build and an unchanged one loads in a second. The
build compiles a copy of the source kept in that folder: ninja names sources by path, so two
checkouts or installs of the same code share one build instead of rebuilding each other's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

SOURCES = Path(__file__).parent / "kernels"
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")  # ATen's parallel_for is OpenMP in torch's wheels
"""-ffp-contract=off: no multiply-add fused in one code path and not another (batch invariance)."""
_ISA_FLAGS = {
    "avx512-vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
"""Compiler flags per instruction set the kernels are built for (best first)."""
_ISA_CPUINFO = {
    "avx512-vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", " fma ", " f16c "),
    "avx2": (" avx2 ", " fma ", " f16c "),
}
"""The /proc/cpuinfo flags each needs."""
_AMX_FLAGS = ("-mamx-tile", "-mamx-int8")
"""Added to the AVX-512 VNNI build where the CPU has AMX-INT8 (the int4 kernel's tile path)."""
_AMX_CPUINFO = ("amx_tile", "amx_int8")
_GFNI_FLAGS = ("-mgfni",)
"""Added to the AVX-512 VNNI build where the CPU has GFNI (Ice Lake, Zen 4 and later): the GGUF
kernel unpacks Q6_K and Q3_K codes with one affine bit-matrix product per vector."""
_AVX_VNNI_FLAGS = ("-mavxvnni",)
"""Added to the AVX2 build where the CPU has AVX-VNNI (Intel's 12th-14th generation Core, without
AVX-512; Zen 5): the GGUF kernel's AVX2 tiles multiply with 256-bit ``vpdpbusd``."""
_lock = threading.Lock()
_loaded: dict[str, str | None] = {}  # source name -> None (loaded) or why it failed
_warned: set[str] = set()  # sources whose failed build a caller has warned about


@functools.cache
def cpu_isa() -> str | None:
    """The best instruction set of :data:`_ISA_FLAGS` this CPU has: ``avx512-vnni`` (AVX-512
    F/BW/VL, VNNI, FMA, F16C), else ``avx2`` (AVX2, FMA, F16C), else None."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore").replace("\t", " ")
    except OSError:
        return None
    flags = flags.replace("\n", " \n")
    return next((isa for isa, need in _ISA_CPUINFO.items() if all(f in flags for f in need)), None)


@functools.cache
def _cpuinfo_words() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore").split())
    except OSError:
        return frozenset()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles with int8 products (Intel Sapphire Rapids and later) beside
    AVX-512 VNNI: then the kernels are also built with AMX (the int4 kernel's tile path)."""
    return cpu_isa() == "avx512-vnni" and _cpuinfo_words().issuperset(_AMX_CPUINFO)


def cpu_has_gfni() -> bool:
    """Whether this CPU has GFNI beside AVX-512 VNNI (not Cascade Lake; Ice Lake, Zen 4 on)."""
    return cpu_isa() == "avx512-vnni" and "gfni" in _cpuinfo_words()


def cpu_has_avx_vnni() -> bool:
    """Whether the AVX2 build is the one here and the CPU has AVX-VNNI beside it."""
    return cpu_isa() == "avx2" and "avx_vnni" in _cpuinfo_words()


def flags() -> tuple[str, ...]:
    isa = cpu_isa()
    amx = _AMX_FLAGS if cpu_has_amx() else ()
    gfni = _GFNI_FLAGS if cpu_has_gfni() else ()
    avx_vnni = _AVX_VNNI_FLAGS if cpu_has_avx_vnni() else ()
    return COMMON_FLAGS + (_ISA_FLAGS[isa] if isa else ()) + amx + gfni + avx_vnni


def build_key(source: str) -> str:
    """Names one build of ``source`` (its text, torch, the flags): its folder, and a part of the
    measured step costs' key, since a changed kernel changes what each depth costs."""
    stamp = (SOURCES / source).read_bytes() + torch.__version__.encode() + " ".join(flags()).encode()
    return hashlib.sha256(stamp).hexdigest()[:16]


def load(source: str) -> str | None:
    """Build (first use) or load the operators of ``kernels/<source>``; None when they are
    registered, else why not (a missing compiler or headers), so callers can say so or fall back."""
    with _lock:
        if source not in _loaded:
            from torch.utils.cpp_extension import load as load_extension

            from verispec.models.registry import cache_root

            stem = Path(source).stem
            build = cache_root() / "kernels" / f"{stem}-{build_key(source)}"
            try:
                build.mkdir(parents=True, exist_ok=True)
                copy = build / source  # the build names its source by path: one path for every install
                if not copy.exists():
                    partial = copy.with_name(f"{copy.name}.{os.getpid()}")
                    partial.write_bytes((SOURCES / source).read_bytes())
                    partial.replace(copy)  # whole or absent for another process building it too
                load_extension(
                    name=f"verispec_{stem}",
                    sources=[str(copy)],
                    extra_cflags=list(flags()),
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build),
                    is_python_module=False,
                    verbose=False,
                )
                _loaded[source] = None
            except Exception as exc:  # a missing compiler or headers: the caller decides
                _loaded[source] = f"building {source} failed: {exc}"
        return _loaded[source]


def ready(source: str, fallback: str) -> bool:
    """Whether the operators of ``kernels/<source>`` are there to call (built or loaded on the first
    ask). When the build fails, the first caller to ask warns once, naming ``fallback`` (what it
    runs instead), and every caller gets False from then on: a missing compiler costs speed, never
    a crash."""
    error = load(source)
    if error and source not in _warned:
        _warned.add(source)
        warnings.warn(f"{error}; {fallback}", stacklevel=3)
    return not error
