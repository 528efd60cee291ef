"""Which hidden-state store a target's training data lives in, and making it ready.

A store is named by the target, its quantization and the data settings (the int8 and int4 paths
give different hidden states for the same model: heads for one are trained on its own features),
and every reuse is checked before any work: another model's states, another quantization's, other
feature layers (or their raw inputs where normed ones are asked for, and the other way round), or a
distilled file of another model's replies are refused.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from verispec.errors import VerispecError
from verispec.heads.identity import TargetIdentity
from verispec.models.quant import lm_head_kind
from verispec.training.data import DataSpec, build_examples
from verispec.training.records import check_file, read_records
from verispec.training.store import HiddenStore


def prepare_store(
    target: Any,
    identity: TargetIdentity,
    spec: DataSpec,
    cache_dir: Path | None = None,
    *,
    progress: bool = True,
) -> HiddenStore:
    """A complete hidden-state cache covering ``spec.max_tokens`` for ``target``: reused, resumed,
    extended with the stream's next sequences, or built."""
    store = open_store(target, identity, spec, cache_dir)
    if store.tokens < spec.max_tokens:
        if target.tokenizer is None:
            raise VerispecError(f"{target.name} has no tokenizer; heads need text data")
        start = store.cursor
        if not store.meta and spec.skip_tokens:
            _, start = build_examples(target.tokenizer, spec, spec.skip_tokens, progress=progress)
        examples, cursor = build_examples(
            target.tokenizer, spec, spec.max_tokens - store.tokens, start, progress=progress
        )
        if not examples and not store.meta:
            raise VerispecError(f"no training text found in the sources {', '.join(spec.sources)}")
        if examples:
            quantization = quantization_of(target)
            store.extend(
                examples, cursor, identity, spec, target.hidden_size,
                quantization=quantization, lm_head=lm_head_kind(target),
            )  # fmt: skip
        if store.tokens < spec.max_tokens:
            print(f"the data sources ran out at {store.tokens} of {spec.max_tokens} tokens", file=sys.stderr)
    if not store.complete:
        store.fill(target, progress=progress)
    return store


def _taps(raw: bool) -> str:
    return "raw inputs" if raw else "normed inputs"


def quantization_of(target: Any) -> str:
    return str(getattr(target, "quantization", "none"))


def default_store_dir(target: Any, identity: TargetIdentity, spec: DataSpec) -> Path:
    """Where a store of ``spec``'s data for ``target`` lives unless ``--cache-dir`` says otherwise."""
    from verispec.models.registry import cache_root

    name = f"{identity.name}-{quantization_of(target)}-{identity.short}-{spec.key()}"
    return cache_root() / "heads-data" / name


def open_store(
    target: Any, identity: TargetIdentity, spec: DataSpec, cache_dir: Path | None = None
) -> HiddenStore:
    """The store of ``spec``'s data for ``target`` (empty if new), refused where it holds another
    model's states, another quantization's, other feature layers or other taps of them (raw or
    normed), or where the distilled file holds another model's replies: all before any work. Where
    it was made beside another kind of LM head, its argmaxes are recomputed
    (:meth:`HiddenStore.recompute_argmax`)."""
    # The int8 and int4 paths give different hidden states for the same model: heads for one are
    # trained on its own features, so the quantization names the cache and is checked on reuse.
    quantization = quantization_of(target)
    cache_dir = cache_dir or default_store_dir(target, identity, spec)
    store = HiddenStore.open(cache_dir)
    if store.meta and store.meta.get("target", {}).get("config_sha256") != identity.config_sha256:
        raise VerispecError(f"{cache_dir} holds hidden states of another model; pass another --cache-dir")
    held = store.meta.get("quantization", quantization) if store.meta else quantization
    if held != quantization:
        raise VerispecError(
            f"{cache_dir} holds hidden states of the {held} target, not of the {quantization} one; "
            "pass another --cache-dir or load the target as the cache was made"
        )
    if store.meta and store.feature_layers != spec.feature_layers:
        raise VerispecError(
            f"{cache_dir} keeps the {_taps(store.raw_taps)} of layers {list(store.feature_layers)}, not "
            f"of {list(spec.feature_layers)}; pass another --cache-dir"
        )
    if store.meta and store.feature_layers and store.raw_taps != spec.raw_taps:
        raise VerispecError(
            f"{cache_dir} keeps the {_taps(store.raw_taps)} of layers {list(store.feature_layers)}, not "
            f"their {_taps(spec.raw_taps)} (EAGLE-3 drafters read the raw ones, verispec's EAGLE the "
            "normed ones); pass another --cache-dir"
        )
    if spec.feature_layers and hasattr(target, "check_feature_layers"):
        target.check_feature_layers(spec.feature_layers)
    if store.meta and store.lm_head != lm_head_kind(target):
        store.recompute_argmax(target)
    # Another model's replies are refused before any work; a file with none yet is distill
    # --keep-hidden's before its first reply (training on it fails on reading the examples).
    if spec.distilled is not None and read_records(Path(spec.distilled)):
        check_file(Path(spec.distilled), identity)
        store.recover_prompt_lengths(spec)
    return store
