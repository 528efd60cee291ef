"""The Python entry point: ``verispec.load(...)`` builds an engine from names and settings.

Its keywords are the settings of :mod:`verispec.config` by their public names (:mod:`verispec.settings`),
written out so that IDEs, type checkers and the API reference show them as they are; a test holds
their names and defaults to the config dataclasses'. Every refused value raises
:class:`~verispec.errors.ConfigError` naming the keyword, before any model loads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.config import (
    AUTO,
    METHODS,
    PLAIN,
    Acceptance,
    DepthPolicyName,
    DraftModelConfig,
    DType,
    Method,
    MethodChoice,
    ModelLoadConfig,
    NgramConfig,
    Quantization,
    SchedulerConfig,
    SpecConfig,
    SuffixConfig,
)
from verispec.costs import load_costs_file
from verispec.engine import SpecEngine
from verispec.errors import ConfigError, VerispecError
from verispec.heads.io import heads_kinds_in, shipped_heads_fit
from verispec.heads.speculators_io import is_eagle3_folder
from verispec.models import load_model
from verispec.openmp import off_main_thread
from verispec.proposers import build_proposer

if TYPE_CHECKING:
    from verispec.models import CausalLM


def default_method(
    target: CausalLM, draft: str | Path | None = None, heads: str | Path | None = None
) -> Method:
    """The method a target speculates with when none is named: the fastest lossless setup it has.

    Every method is lossless (greedy output equals plain decoding's), so the default only has to be
    fast, and the adaptive depth policy keeps it from being slow: it drafts only where the expected
    tokens per second beat plain decoding's, and stops for a sequence whose drafts keep failing or
    a batch too large to gain. So the default speculates with whatever the target has:

    - a draft model, when one is given: naming one says how to draft;
    - an EAGLE-3 drafter (speculators or research format) plus suffix decoding, when ``heads`` is one;
    - EAGLE heads plus suffix decoding, when heads are given or shipped for this very target: the
      heads draft everywhere and suffix decoding the runs an answer copies from its prompt, its own
      text or (within the request's cache scope) earlier answers. On the 1.5B under the adaptive
      policy this was the fastest setup on HumanEval and Spec-Bench alike, a few percent ahead of
      the heads plus prompt lookup (``docs/results/zen4-qwen2.5-coder-1.5b-native-gguf/``); given
      Medusa heads alone: Medusa plus suffix decoding;
    - suffix decoding otherwise: it needs nothing trained, costs no forward pass to draft, and pays
      where an answer repeats its prompt or earlier answers (code, edits, summaries, tool calls); it
      finds what prompt lookup finds and scores its trees by how often a continuation followed.
    """
    if draft is not None:
        return "draft"
    if heads is not None:
        if is_eagle3_folder(Path(heads).expanduser()):
            return "eagle3+suffix"
        kinds = heads_kinds_in(heads)
        if not kinds:
            raise VerispecError(f"no eagle or medusa heads in {heads} (nor in its eagle/ or medusa/)")
        return "eagle+suffix" if "eagle" in kinds else "medusa+suffix"
    if shipped_heads_fit(target, "eagle"):
        return "eagle+suffix"
    return "suffix"


def _requested(method: MethodChoice | None) -> str | None:
    """``method`` as asked: a method, None for plain decoding (``"none"`` or None) or :data:`AUTO`;
    refused here, before any model loads, when it names nothing."""
    if method is None or method == PLAIN:
        return None
    if method != AUTO and method not in METHODS:
        known = f"{', '.join(METHODS)}, {AUTO} or {PLAIN}"
        raise ConfigError("method", f"must be one of {known}; unknown method {method!r}")
    return method


def load(
    target: str | Path,
    draft: str | Path | None = None,
    method: MethodChoice | None = AUTO,
    num_speculative_tokens: int = 5,
    *,
    device: str = "cpu",
    dtype: DType = "float32",
    threads: int | None = None,
    quantization: Quantization = "auto",
    ngram_max: int = 4,
    ngram_min: int = 1,
    suffix_max_pattern: int = 24,
    suffix_min_prob: float = 0.1,
    suffix_spec_factor: float = 1.0,
    suffix_cache_tokens: int = 1_000_000,
    draft_p_min: float = 0.0,
    depth: DepthPolicyName = "adaptive",
    disable_by_batch_size: int | None = None,
    costs: str | Path | None = None,
    max_batch_size: int = 8,
    max_waiting: int = 64,
    prefix_cache_gb: float = 2.0,
    heads: str | Path | None = None,
    tree_nodes: int | None = None,
    tree_width: int | None = None,
    acceptance: Acceptance = "exact",
) -> SpecEngine:
    """Load a target (and a draft model when the method needs one) and return a ready engine.

    ``method`` is one of :data:`~verispec.config.METHODS`, ``"none"`` (or None) for plain decoding,
    or ``"auto"`` (the default): the method :func:`default_method` picks for this target, i.e.
    ``"draft"`` with a ``draft``, else EAGLE heads plus prompt lookup where heads are given or
    shipped for the target, else prompt lookup. Models are registry names (``verispec models``),
    local Hugging Face folders or ``.gguf`` files. ``quantization="auto"`` runs a GGUF model's own
    blocks on CPU (:func:`verispec.models.native_gguf_by_default`) and other float32 models with
    int8 weights (:mod:`verispec.models.quant`); ``"none"`` keeps float weights.
    ``depth`` is ``"adaptive"`` (k per sequence and step, up to ``num_speculative_tokens``, see
    :mod:`verispec.policy`) or ``"fixed"``; its costs are measured on first use (and cached) unless
    ``costs`` names a file (``forward.json`` of ``verispec bench forward``). ``max_batch_size``
    sequences decode together and up to ``max_waiting`` more queue behind them. ``prefix_cache_gb``
    of memory keep earlier requests' keys and values for later ones that start the same way (a
    chat's earlier turns; :mod:`verispec.engine.prefix_cache`); 0 turns it off.

    ``method="medusa"`` or ``"eagle"`` drafts token trees from the target's hidden states with
    trained heads: ``heads`` is their folder (``verispec train``), None takes those shipped for the
    target; ``tree_nodes``/``tree_width`` override the heads' tree budget and candidates per level.
    ``"eagle+ngram"``/``"medusa+ngram"`` add prompt lookup's continuation to that tree as one more
    branch (see :mod:`verispec.proposers.hybrid`). ``"suffix"`` drafts trees of what followed the
    context's tail in the request and in its cache scope's earlier outputs (``suffix_*`` settings,
    :mod:`verispec.proposers.suffix`); ``"eagle+suffix"``/``"medusa+suffix"`` merge them with the heads'.
    ``acceptance="typical"`` is Medusa's typical acceptance, which is LOSSY at temperature > 0 (the
    output no longer follows the target's distribution, see :mod:`verispec.verify.typical`).
    """
    requested = _requested(method)
    if requested == "draft" and draft is None:
        raise ConfigError(
            "draft", "must name a draft model for method draft (registry name, folder or .gguf)"
        )
    spec = SpecConfig(  # every setting checked before a model loads; "auto" is resolved after
        method=None if requested == AUTO else requested,  # type: ignore[arg-type]
        num_speculative_tokens=num_speculative_tokens,
        ngram=NgramConfig(max_ngram=ngram_max, min_ngram=ngram_min),
        suffix=SuffixConfig(
            max_pattern=suffix_max_pattern,
            min_prob=suffix_min_prob,
            spec_factor=suffix_spec_factor,
            cache_tokens=suffix_cache_tokens,
        ),
        draft=DraftModelConfig(model=str(draft) if draft is not None else None, p_min=draft_p_min),
        depth=depth,
        disable_by_batch_size=disable_by_batch_size,
        costs=str(costs) if costs is not None else None,
        heads=str(heads) if heads is not None else None,
        tree_nodes=tree_nodes,
        tree_width=tree_width,
        acceptance=acceptance,
    )
    scheduler = SchedulerConfig(
        max_batch_size=max_batch_size, max_waiting=max_waiting, prefix_cache_gb=prefix_cache_gb
    )
    load_cfg = ModelLoadConfig(device=device, dtype=dtype, threads=threads, quantization=quantization)

    def build() -> SpecEngine:
        target_model = load_model(target, load_cfg)
        chosen = spec
        if requested == AUTO:
            chosen = replace(spec, method=default_method(target_model, draft, heads))
        draft_model = load_model(draft, load_cfg) if chosen.method == "draft" and draft is not None else None
        return SpecEngine(
            target_model,
            build_proposer(chosen, target_model, draft_model),
            chosen,
            tokenizer=target_model.tokenizer,
            draft=draft_model,
            scheduler=scheduler,
            costs=load_costs_file(Path(chosen.costs)) if chosen.costs is not None else None,
        )

    # Loaded on a thread that ends, so that whichever thread steps the engine (the caller's, an
    # AsyncEngine's) holds the only OpenMP team: see verispec.openmp.
    return off_main_thread(build)
