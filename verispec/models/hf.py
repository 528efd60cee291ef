"""Hugging Face causal LMs behind the :mod:`verispec.models.base` protocol.

The forward runs the decoder stack and applies the LM head only to the positions whose logits
are needed: a verify step over k+1 tokens needs k+1 rows, and a prefill of a long prompt needs one,
so the 152k-wide head is not paid for every prompt token. The decoder's output (after the final
norm) is returned as the hidden state for Medusa/EAGLE heads.
"""

from __future__ import annotations

import hashlib
import inspect
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from verispec.config import ModelLoadConfig
from verispec.errors import VerispecError
from verispec.models.base import ForwardOutput
from verispec.models.quant import quantize_int8_dynamic, resolve_quantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFKVCache:
    """A transformers ``DynamicCache`` with an explicit length and a one-call rollback."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.inner = DynamicCache(config=model.config)
        # Sliding-window layers drop old positions; recording lets them roll back past the window.
        self.inner.activate_past_recording()
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def advance(self, n: int) -> None:
        self._length += n

    def trim(self, n: int) -> None:
        """Drop the last ``n`` positions (rejected draft tokens)."""
        if n < 0 or n > self._length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self._length}")
        if n == 0:
            return
        if not self.inner.is_croppable:
            raise VerispecError("this model's KV cache cannot be rolled back, so it cannot verify drafts")
        self.inner.crop(-n)
        self._length -= n


class HFCausalLM:
    """A loaded transformers model with the verispec forward/cache protocol."""

    def __init__(self, model: PreTrainedModel, name: str, tokenizer: object | None = None) -> None:
        self.model = model.eval()
        self.name = name
        self.tokenizer = tokenizer
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        # out_features also exists on quantized Linears, whose `weight` is a method.
        self.vocab_size = int(self.lm_head.out_features)
        self.hidden_size = int(cfg.hidden_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.device = next(model.parameters()).device
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.eos_token_ids = frozenset(_eos_ids(model, tokenizer))
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns, then goes away).
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.load_seconds = 0.0
        self.quantization = "none"

    def new_cache(self) -> HFKVCache:
        return HFKVCache(self.model)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        cache: HFKVCache,  # T positions before, T + S after
        *,
        logits_to_keep: int = 1,
        return_hidden: bool = False,
        position_ids: torch.Tensor | None = None,  # [B, S]
        attention_mask: torch.Tensor | None = None,  # [B, 1, S, T+S] bool
    ) -> ForwardOutput:
        seq_len = input_ids.shape[1]
        if cache.length + seq_len > self.max_context:
            raise VerispecError(
                f"{self.name}: {cache.length + seq_len} tokens exceed the model's context "
                f"of {self.max_context}"
            )
        kwargs: dict[str, object] = {}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        kwargs[self._cache_kwarg] = cache.inner
        out = self.decoder(input_ids=input_ids.to(self.device), use_cache=True, **kwargs)
        cache.advance(seq_len)
        hidden = out.last_hidden_state  # [B, S, H]
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden).float()  # [B, keep, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return ForwardOutput(logits=logits, hidden=hidden if return_hidden else None)


def _eos_ids(model: PreTrainedModel, tokenizer: object | None) -> set[int]:
    """Every id that ends a turn: the generation config's EOS (an int or a list) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids


def load_hf_folder(
    folder: Path, name: str, cfg: ModelLoadConfig, *, with_tokenizer: bool = True
) -> HFCausalLM:
    """Load a Hugging Face model folder (safetensors/bin + config.json) and its tokenizer if present."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise VerispecError(f"device {cfg.device!r} requested but CUDA is not available; use --device cpu")
    start = time.perf_counter()
    quantization = resolve_quantization(cfg.quantization, cfg.device, cfg.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[cfg.dtype], device_map=cfg.device)
    except (OSError, ValueError) as exc:
        raise VerispecError(f"cannot load a causal LM from {folder}: {exc}") from exc
    if quantization == "int8":
        quantize_int8_dynamic(model, int8_cache_file(folder))
    tokenizer = _load_tokenizer(folder) if with_tokenizer else None
    lm = HFCausalLM(model, name=name, tokenizer=tokenizer)
    lm.quantization = quantization
    lm.load_seconds = time.perf_counter() - start
    return lm


def int8_cache_file(folder: Path) -> Path:
    """Where the int8 weights of the model in ``folder`` are cached, keyed by the weight files'
    paths, sizes and modification times (a changed model gets a new key)."""
    from verispec.models.registry import cache_root

    stamp = hashlib.sha256()
    for f in sorted(folder.resolve().glob("*.safetensors")) + sorted(folder.resolve().glob("*.bin")):
        info = f.stat()
        stamp.update(f"{f}:{info.st_size}:{info.st_mtime_ns}".encode())
    return cache_root() / "int8" / f"{folder.name}-{stamp.hexdigest()[:16]}.safetensors"


def _load_tokenizer(folder: Path) -> object | None:
    """The folder's tokenizer, or None for a weights-only folder (prompts must then be token ids)."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
