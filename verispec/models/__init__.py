"""Model loading: a registry name, a local Hugging Face folder or a .gguf file, behind one protocol.

The protocol's classes are imported on first use (they import PyTorch), so the registry
(:mod:`verispec.models.registry`, ``verispec models``) is read without loading PyTorch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from verispec.config import ModelLoadConfig
from verispec.lazy import lazy_attributes

if TYPE_CHECKING:
    from verispec.models.base import BatchOutput, CausalLM, ForwardOutput, KVCache
    from verispec.models.hf import HFCausalLM

__all__ = ["BatchOutput", "CausalLM", "ForwardOutput", "HFCausalLM", "KVCache", "load_model"]

_LAZY = {
    "BatchOutput": "verispec.models.base",
    "CausalLM": "verispec.models.base",
    "ForwardOutput": "verispec.models.base",
    "KVCache": "verispec.models.base",
    "HFCausalLM": "verispec.models.hf",
    "load_hf_folder": "verispec.models.hf",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


def load_model(source: str | Path, cfg: ModelLoadConfig | None = None) -> HFCausalLM:
    """Load ``source`` (registry name, HF folder or .gguf path) for inference.

    With quantization ``gguf`` a GGUF model runs its own blocks, loaded from the file as it is
    (:mod:`verispec.models.gguf_native`); ``auto`` does so too on a CPU where the GGUF kernel has a
    vector build (:func:`native_gguf_by_default`). Otherwise a GGUF is de-quantized once and cached
    as safetensors, so the second load takes seconds.
    """
    from verispec.models.cache import gguf_file_for, hf_folder_for
    from verispec.models.hf import load_hf_folder

    cfg = cfg or ModelLoadConfig()
    name = Path(source).name if Path(str(source)).exists() else str(source)
    if cfg.quantization in ("gguf", "auto"):
        gguf = gguf_file_for(str(source))
        if gguf is not None and (cfg.quantization == "gguf" or native_gguf_by_default(cfg)):
            from verispec.models.gguf_native import load_gguf

            return load_gguf(gguf, name=name, cfg=cfg)
    return load_hf_folder(hf_folder_for(str(source)), name=name, cfg=cfg)  # refuses gguf on a folder


def native_gguf_by_default(cfg: ModelLoadConfig) -> bool:
    """Whether ``auto`` runs a GGUF file's own blocks: on CPU with float32 activations, where the
    GGUF kernel has its AVX-512 VNNI or AVX2 build.

    Why by default: those are the weights llama.cpp runs, to the bit, so verispec's output is the
    model the user downloaded rather than a second rounding of it (the re-quantized int4 path agreed
    with llama.cpp's top token 98.1% of the time on the 1.5B), and loading needs neither a float32
    copy nor minutes of conversion. Elsewhere (no compiler, a CPU without AVX2) ``auto`` keeps the
    int8 path, since the portable build of the kernel is slow."""
    if cfg.device != "cpu" or cfg.dtype != "float32":
        return False
    from verispec.models.gguf_linear import vectorized

    return vectorized()
