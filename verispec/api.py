"""The Python entry point: ``verispec.load(...)`` builds an engine from names and settings."""

from __future__ import annotations

from pathlib import Path

from verispec.config import (
    DraftModelConfig,
    Method,
    ModelLoadConfig,
    NgramConfig,
    SchedulerConfig,
    SpecConfig,
)
from verispec.costs import load_costs_file
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.models import load_model
from verispec.proposers.base import build_proposer


def load(
    target: str | Path,
    draft: str | Path | None = None,
    method: Method | None = None,
    num_speculative_tokens: int = 5,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    quantization: str = "auto",
    ngram_max: int = 4,
    ngram_min: int = 1,
    draft_p_min: float = 0.0,
    depth: str = "adaptive",
    disable_by_batch_size: int | None = None,
    costs: str | Path | None = None,
    max_batch_size: int = 8,
    max_waiting: int = 64,
    heads: str | Path | None = None,
    tree_nodes: int | None = None,
    tree_width: int | None = None,
    acceptance: str = "exact",
) -> SpecEngine:
    """Load a target (and a draft model when the method needs one) and return a ready engine.

    ``method`` is ``"draft"``, ``"ngram"`` or None for plain decoding; a given ``draft`` with no
    method means ``"draft"``. Models are registry names (``verispec models``), local Hugging Face
    folders or ``.gguf`` files. ``quantization="auto"`` runs float32 models on CPU with int8
    weights (the fast path, see :mod:`verispec.models.quant`); ``"none"`` keeps float weights.
    ``depth`` is ``"adaptive"`` (k per sequence and step, up to ``num_speculative_tokens``, see
    :mod:`verispec.policy`) or ``"fixed"``; its costs are measured on first use (and cached) unless
    ``costs`` names a file (``forward.json`` of ``verispec bench forward``). ``max_batch_size``
    sequences decode together and up to ``max_waiting`` more queue behind them.

    ``method="medusa"`` or ``"eagle"`` drafts token trees from the target's hidden states with
    trained heads: ``heads`` is their folder (``verispec train``), None takes those shipped for the
    target; ``tree_nodes``/``tree_width`` override the heads' tree budget and candidates per level.
    ``"eagle+ngram"``/``"medusa+ngram"`` add prompt lookup's continuation to that tree as one more
    branch (see :mod:`verispec.proposers.hybrid`).
    ``acceptance="typical"`` is Medusa's typical acceptance, which is LOSSY at temperature > 0 (the
    output no longer follows the target's distribution, see :mod:`verispec.verify.typical`).
    """
    if method is None and draft is not None:
        method = "draft"
    if method == "draft" and draft is None:
        raise VerispecError("method 'draft' needs a draft model (--draft NAME|FOLDER|FILE.gguf)")
    spec = SpecConfig(
        method=method,
        num_speculative_tokens=num_speculative_tokens,
        ngram=NgramConfig(max_ngram=ngram_max, min_ngram=ngram_min),
        draft=DraftModelConfig(model=str(draft) if draft is not None else None, p_min=draft_p_min),
        depth=depth,  # type: ignore[arg-type]
        disable_by_batch_size=disable_by_batch_size,
        heads=str(heads) if heads is not None else None,
        tree_nodes=tree_nodes,
        tree_width=tree_width,
        acceptance=acceptance,  # type: ignore[arg-type]
    )
    scheduler = SchedulerConfig(max_batch_size=max_batch_size, max_waiting=max_waiting)
    load_cfg = ModelLoadConfig(
        device=device,
        dtype=dtype,  # type: ignore[arg-type]
        threads=threads,
        quantization=quantization,  # type: ignore[arg-type]
    )
    target_model = load_model(target, load_cfg)
    draft_model = load_model(draft, load_cfg) if method == "draft" and draft is not None else None
    proposer = build_proposer(spec, target_model, draft_model)
    return SpecEngine(
        target_model,
        proposer,
        spec,
        tokenizer=target_model.tokenizer,
        draft=draft_model,
        scheduler=scheduler,
        costs=load_costs_file(Path(costs)) if costs is not None else None,
    )
