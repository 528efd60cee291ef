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
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from verispec.config import ModelLoadConfig
from verispec.errors import VerispecError
from verispec.models import lean, native
from verispec.models.attention import NATIVE_SOURCE as NATIVE_ATTENTION
from verispec.models.attention import register as register_attention
from verispec.models.base import BatchOutput, ForwardOutput
from verispec.models.fused import fuse_projections
from verispec.models.int4 import prompt_rows
from verispec.models.kv import KVBuffer, RowBatch
from verispec.models.quant import quantize_model, resolve_quantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCausalLM:
    """A loaded transformers model with the verispec forward/cache protocol."""

    def __init__(
        self,
        model: PreTrainedModel,
        name: str,
        tokenizer: object | None = None,
        *,
        native_layers: bool = True,
        native_attention: bool = True,
    ) -> None:
        self.model = model.eval()
        # The engine's KV buffers are read by verispec's own attention (see verispec.models.attention).
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(register_attention())
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
        self.lean = lean.supports(self.decoder)
        """Run the decoder with :func:`verispec.models.lean.forward` (same bits, less Python);
        False runs transformers' own forward."""
        self.native_layers = native_layers
        """The lean forward runs the layers' small operations in C++ where they build (float32 on
        CPU; within rounding of transformers'); False keeps torch's, transformers' bits."""
        self.native_attention = native_attention
        """Decode and verify rows attend in C++ where it builds (float32 on CPU); False keeps the
        Python loop over positions. Both paths are batch-invariant; they differ in the last bits, so
        a model keeps one for all its forwards."""

    def new_cache(self) -> KVBuffer:
        return KVBuffer()

    @property
    def position_invariant(self) -> bool:
        """Whether a position's keys, values and hidden state depend on its tokens alone, not on
        how the forwards that computed it were grouped (a prefill chunk, a decode step, a verify
        row): then one request's cache can stand in for another's computation, to the bit
        (:mod:`verispec.engine.prefix_cache`). True for the GGUF and int8 weights (each output
        element from its own row, integer sums) with verispec's C++ attention, which takes prompt
        rows too; float weights go through BLAS, whose sums change with the number of rows, and
        int4 runs prompt rows through a kernel of their own."""
        if self.quantization not in ("gguf", "int8") or not self.native_attention:
            return False
        dtype = getattr(self.config, "dtype", None)
        if self.device.type != "cpu" or dtype not in (None, torch.float32, "float32"):
            return False
        return native.ready(NATIVE_ATTENTION, "prompt keys are not reused across requests")

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, S]
        cache: KVBuffer,  # T positions before, T + S after
        *,
        logits_to_keep: int = 1,
        return_hidden: bool = False,
    ) -> ForwardOutput:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                f"forward takes one sequence [1, S]; use forward_batch for more, got {input_ids.shape}"
            )
        keep = logits_to_keep or input_ids.shape[1]
        out = self.forward_batch(
            [cache], [input_ids[0].tolist()], logits_to_keep=[keep], return_hidden=return_hidden
        )
        hidden = out.hidden[0].unsqueeze(0) if out.hidden is not None else None
        return ForwardOutput(logits=out.logits[0].unsqueeze(0), hidden=hidden)

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: Sequence[KVBuffer],
        tokens: Sequence[Sequence[int]],
        *,
        logits_to_keep: Sequence[int],
        return_hidden: bool = False,
        positions: Sequence[Sequence[int]] | None = None,
        tree_masks: Sequence[torch.Tensor | None] | None = None,
        hidden_to_keep: Sequence[int] | None = None,
        feature_layers: Sequence[int] = (),
        raw_features: bool = False,
    ) -> BatchOutput:
        """One decoder pass over several sequences, each appending its own tokens to its own cache.

        Row b's logits are for its last ``logits_to_keep[b]`` new tokens (0: none). Hidden states
        come back for the last ``hidden_to_keep[b]`` tokens, or with ``return_hidden`` for the
        same tokens as the logits; ``feature_layers`` appends the normed inputs of those decoder
        layers to each hidden state (``[keep, (1 + len) H]``, see :func:`verispec.models.lean.forward`),
        or with ``raw_features`` their inputs before that norm (EAGLE-3's auxiliary states).
        ``positions`` overrides
        the default positions (cache length onwards), as token trees do; ``tree_masks`` gives each
        row's attention among its new tokens (see :class:`RowBatch`).

        A pass that keeps no logits feeds prompt tokens (the engine's prefill, the heads' training
        data): on the int4 path it runs the many-row kernel (:func:`~verispec.models.int4.prompt_rows`).
        """
        if not tokens or any(len(t) == 0 for t in tokens):
            raise ValueError("every row of a batched forward needs at least one token")
        starts = [c.length for c in caches]
        lengths = [len(t) for t in tokens]
        for keep in (logits_to_keep, hidden_to_keep or lengths):
            if any(not 0 <= k <= n for k, n in zip(keep, lengths, strict=True)):
                raise ValueError("a row keeps logits or hidden states for at most its own tokens")
        for start, n in zip(starts, lengths, strict=True):
            if start + n > self.max_context:
                raise VerispecError(
                    f"{self.name}: {start + n} tokens exceed the model's context of {self.max_context}"
                )
        taps = self.check_feature_layers(feature_layers)
        rows = RowBatch(
            caches=caches,
            starts=starts,
            lengths=lengths,
            tree_masks=tree_masks,
            native_attention=self.native_attention,
        )
        # the rows packed side by side, each at its own positions (RowBatch)
        input_ids = torch.tensor([[t for row in tokens for t in row]], dtype=torch.long)
        if positions is not None:
            position_ids = torch.tensor([[p for row in positions for p in row]], dtype=torch.long)
        else:
            position_ids = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape != input_ids.shape:
            raise ValueError("every row needs as many positions as tokens")
        input_ids, position_ids = input_ids.to(self.device), position_ids.to(self.device)
        with prompt_rows() if not any(logits_to_keep) else nullcontext():
            if self.lean:
                hidden = lean.forward(
                    self.decoder,
                    input_ids,
                    position_ids,
                    rows,
                    taps,
                    native=self.native_layers,
                    raw_taps=raw_features,
                )  # [1, N, H']
            else:
                hidden = self._decoder_forward(input_ids, position_ids, rows, taps, raw_features)
        for cache, n in zip(caches, lengths, strict=True):
            cache.advance(n)
        ends = rows.offsets[1:]
        hidden = hidden[0]  # [N, H']
        kept = [hidden[end - k : end] for end, k in zip(ends, logits_to_keep, strict=True)]
        flat = torch.cat(kept)[:, : self.hidden_size]  # [sum keep, H]
        logits = self.lm_head(flat).float() if flat.shape[0] else flat.new_zeros(0, self.vocab_size)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        hidden_rows: list[torch.Tensor] | None = None
        if hidden_to_keep is not None:
            hidden_rows = [hidden[end - h : end] for end, h in zip(ends, hidden_to_keep, strict=True)]
        elif return_hidden:
            hidden_rows = kept
        return BatchOutput(logits=list(logits.split([h.shape[0] for h in kept])), hidden=hidden_rows)

    def check_feature_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """``layers`` as a tuple, refused unless each names one of this model's decoder layers."""
        count = int(self.config.num_hidden_layers)
        bad = [i for i in layers if not 0 <= int(i) < count]
        if bad:
            raise VerispecError(
                f"{self.name} has decoder layers 0..{count - 1}; feature layers {bad} do not exist"
            )
        return tuple(int(i) for i in layers)

    def _decoder_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        rows: RowBatch,
        taps: tuple[int, ...],
        raw: bool = False,
    ) -> torch.Tensor:
        """transformers' own decoder forward; a tap's feature is caught at its layer's input norm
        (``raw``: the norm's input, else its output)."""
        tapped: dict[int, torch.Tensor] = {}
        hooks = [
            self.decoder.layers[i].input_layernorm.register_forward_hook(
                lambda _m, args, out, i=i: tapped.__setitem__(i, args[0] if raw else out)
            )
            for i in taps
        ]
        try:
            hidden = self.decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=_NO_MASKS,
                use_cache=True,
                verispec_rows=rows,
                **{self._cache_kwarg: rows},
            ).last_hidden_state
        finally:
            for hook in hooks:
                hook.remove()
        return lean.with_taps(hidden, tapped, taps)


_NO_MASKS = {"full_attention": None, "sliding_attention": None, "chunked_attention": None}
"""Given as the decoder's attention mask so transformers builds none: the rowwise attention knows
each row's causal prefix from its :class:`RowBatch`."""


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
    if quantization == "gguf":
        raise VerispecError(
            f"--quantization gguf runs a GGUF file's own blocks, and {folder} is a Hugging Face folder; "
            "pass a .gguf file or a bundled model name, or use --quantization auto, none, int8 or int4"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[cfg.dtype], device_map=cfg.device)
    except (OSError, ValueError) as exc:
        raise VerispecError(f"cannot load a causal LM from {folder}: {exc}") from exc
    if quantization != "none":
        quantize_model(model, quantization, quant_cache_file(folder, quantization))
        fuse_projections(model)  # q/k/v and gate/up as one product each: same results, fewer calls
    tokenizer = _load_tokenizer(folder) if with_tokenizer else None
    lm = HFCausalLM(model, name=name, tokenizer=tokenizer)
    lm.quantization = quantization
    lm.load_seconds = time.perf_counter() - start
    return lm


def quant_cache_file(folder: Path, scheme: str) -> Path:
    """Where the ``scheme`` (int8/int4) weights of the model in ``folder`` are cached, keyed by the
    weight files' paths, sizes and modification times (a changed model gets a new key)."""
    from verispec.models.registry import cache_root

    stamp = hashlib.sha256()
    for f in sorted(folder.resolve().glob("*.safetensors")) + sorted(folder.resolve().glob("*.bin")):
        info = f.stat()
        stamp.update(f"{f}:{info.st_size}:{info.st_mtime_ns}".encode())
    if scheme == "int4":
        from verispec.models.int4 import LAYOUT

        stamp.update(LAYOUT.encode())  # a changed kernel layout must not read old files
    return cache_root() / scheme / f"{folder.name}-{stamp.hexdigest()[:16]}.safetensors"


def _load_tokenizer(folder: Path) -> object | None:
    """The folder's tokenizer, or None for a weights-only folder (prompts must then be token ids)."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
