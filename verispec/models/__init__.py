"""Model loading: a registry name, a local Hugging Face folder or a .gguf file, behind one protocol."""

from __future__ import annotations

from pathlib import Path

from verispec.config import ModelLoadConfig
from verispec.models.base import BatchOutput, CausalLM, ForwardOutput, KVCache
from verispec.models.hf import HFCausalLM, load_hf_folder

__all__ = ["BatchOutput", "CausalLM", "ForwardOutput", "HFCausalLM", "KVCache", "load_model"]


def load_model(source: str | Path, cfg: ModelLoadConfig | None = None) -> HFCausalLM:
    """Load ``source`` (registry name, HF folder or .gguf path) for inference.

    A GGUF is de-quantized once and cached as safetensors, so the second load takes seconds.
    """
    from verispec.models.cache import hf_folder_for

    folder = hf_folder_for(str(source))
    name = Path(source).name if Path(str(source)).exists() else str(source)
    return load_hf_folder(folder, name=name, cfg=cfg or ModelLoadConfig())
