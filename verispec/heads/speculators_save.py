"""Writing EAGLE-3 checkpoints in the two formats :mod:`verispec.heads.speculators_io` reads: the
speculators folder vLLM loads, and the research folder SGLang loads (the formats, their conventions and
why they differ are described there). Every option is written explicitly, since the engines and
speculators default some of them differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from verispec.errors import VerispecError
from verispec.heads.eagle3 import Eagle3Config, Eagle3Drafter

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose format :func:`save_speculators` writes (and the tests load back)."""


def save_speculators(
    drafter: Eagle3Drafter,
    folder: str | Path,
    verifier_name: str | None,
    *,
    verifier_architectures: tuple[str, ...] = ("LlamaForCausalLM",),
    speculative_tokens: int = 3,
    dtype: torch.dtype | None = None,
    include_embeddings: bool = True,
) -> None:
    """Write ``drafter`` as a speculators checkpoint (``config.json`` + ``model.safetensors``) that
    ``speculators.models.SpeculatorModel.from_pretrained`` and vLLM load.

    ``verifier_name`` is the target's Hugging Face id or path (speculators' ``from_pretrained`` reads
    that model's config and weights when it is set; None writes ``null``). Weights keep the drafter's
    dtype unless ``dtype`` is given; ``include_embeddings=False`` leaves ``embed_tokens.weight`` out
    (vLLM then shares the target's; speculators fills it from the verifier).
    """
    cfg = drafter.config
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": _layer_config_dict(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids) or None,
        **_flags(cfg),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype or drafter.fc.weight.dtype).removeprefix("torch."),
    }
    skip = set() if drafter.uses_draft_vocab else {"d2t", "t2d"}
    if not include_embeddings:
        skip.add("embed_tokens.weight")
    _write(Path(folder), config, _tensors(drafter, dtype, skip))


def save_sglang(
    drafter: Eagle3Drafter,
    folder: str | Path,
    *,
    dtype: torch.dtype | None = None,
    include_embeddings: bool = True,
) -> None:
    """Write ``drafter`` in the research format SGLang's ``LlamaForCausalLMEagle3`` (and vLLM) load:
    a flat Llama ``config.json`` plus ``model.safetensors`` with ``midlayer.*`` names.

    The aux layer ids go to ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's convention
    (vLLM's id minus one, module docstring); ``norm_before_residual`` and the other flags are written
    at the top level, explicitly, where vLLM reads them (older SGLang ignores them). Refused: Qwen3
    layers and biases, which SGLang's Llama layer has no weights for.
    """
    cfg = drafter.config
    if cfg.qk_norm or cfg.attention_bias or cfg.mlp_bias:
        raise VerispecError(
            "save_sglang: SGLang's LlamaForCausalLMEagle3 has no q/k norms or biases; this drafter "
            "(Qwen3 layer or biased projections) can only be saved with save_speculators"
        )
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config_dict(cfg),  # flat: SGLang builds its LlamaConfig from the whole file
        "draft_vocab_size": cfg.draft_vocab_size,
        **_flags(cfg),
        "torch_dtype": str(dtype or drafter.fc.weight.dtype).removeprefix("torch."),
    }
    if cfg.target_hidden_size is not None:
        config["target_hidden_size"] = cfg.target_hidden_size
    if cfg.aux_layer_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids]}
    skip = set() if include_embeddings else {"embed_tokens.weight"}
    tensors = {_to_research_name(k): v for k, v in _tensors(drafter, dtype, skip).items()}
    _write(Path(folder), config, tensors)


def _layer_config_dict(cfg: Eagle3Config) -> dict[str, Any]:
    """The decoder layer as a transformers Llama/Qwen3 config dict, with the rotary settings in the
    legacy ``rope_theta``/``rope_scaling`` keys that transformers 4 and 5 (and vLLM, SGLang) all read."""
    layer: dict[str, Any] = {
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "vocab_size": cfg.target_vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": False,
    }
    if not cfg.qk_norm:
        layer["mlp_bias"] = cfg.mlp_bias
    scaling = dict(cfg.rope_scaling)
    if scaling:
        layer["rope_scaling"] = scaling
        if "original_max_position_embeddings" in scaling:  # transformers warns when it is not below this
            layer["max_position_embeddings"] = int(
                scaling["original_max_position_embeddings"] * float(scaling.get("factor", 1.0))
            )
    return layer


def _flags(cfg: Eagle3Config) -> dict[str, bool]:
    return {
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }


def _tensors(drafter: Eagle3Drafter, dtype: torch.dtype | None, skip: set[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in drafter.state_dict().items():
        if name in skip:
            continue
        value = value.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[name] = value.cpu().contiguous()
    return out


def _to_research_name(name: str) -> str:
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def _write(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """``config.json`` and ``model.safetensors`` (written to a temporary name first, so an interrupted
    save leaves no half file under the real one)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
