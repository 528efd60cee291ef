"""Reading EAGLE-3 checkpoints in the formats people publish them in, so that a drafter trained
elsewhere drafts in verispec (:mod:`verispec.heads.speculators_save` writes them, so that one trained
here runs in speculators, vLLM or SGLang).

Two formats, one arithmetic (:mod:`verispec.heads.eagle3`):

- **speculators** (vllm-project/speculators, what vLLM loads natively): ``config.json`` with
  ``speculators_model_type: "eagle3"``, the layer's sizes in ``transformer_layer_config`` (a Llama or
  Qwen3 config), the EAGLE-3 flags at the top level, the verifier in ``speculators_config``; weights
  ``model.safetensors`` (or shards with ``model.safetensors.index.json``) named ``embed_tokens.weight``,
  ``fc.weight``, ``layers.0.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``. ``d2t``/``t2d``
  are absent when the draft vocabulary is the target's.
- **research** (the EAGLE authors' releases, SpecForge/SGLang's ``LlamaForCausalLMEagle3``): a flat,
  Llama-like ``config.json`` with ``draft_vocab_size`` (and ``target_hidden_size``), weights
  ``model.safetensors`` or ``pytorch_model.bin`` with the layer named ``midlayer.*``, and often no
  ``embed_tokens.weight``: SGLang always substitutes the target's embeddings, vLLM does when the file
  has none.

Where the flags live and what they default to: the EAGLE-3 flags default to False in both
(speculators' ``Eagle3SpeculatorConfig`` and the authors' code: the residual is the raw ``h``). vLLM
reads ``norm_before_residual`` & co. from a research config's top level too; the SGLang
``llama_eagle3.py`` we checked (sgl-project/sglang 03d5a77) reads none of them, so a drafter with
any flag set only runs right there on SGLang versions that do. (speculators' own converter for
research checkpoints takes ``norm_before_residual`` from its command line, not from the file.)

Auxiliary layer ids come in two conventions, off by one. vLLM and speculators
(``eagle_aux_hidden_state_layer_ids``, top level) capture the *input* of decoder layer i, i.e.
``output_hidden_states[i]``; SGLang (``eagle_config.eagle_aux_hidden_state_layer_ids``) adds one before
capturing, so its id i is the *output* of layer i, ``output_hidden_states[i + 1]`` (SpecForge's default
``[1, L/2 - 1, L - 4]`` is vLLM's ``[2, L/2, L - 3]``). verispec keeps vLLM's convention
(:attr:`Eagle3Config.aux_layer_ids`): :func:`load_eagle3` adds one to SGLang's ids and
:func:`~verispec.heads.speculators_save.save_sglang` subtracts it. (vLLM also falls back to
``eagle_config``'s ids, without the offset.)

Nothing malformed loads quietly: a missing or misshapen tensor, a non-finite weight (speculators
fills unloaded weights with NaN), ``d2t``/``t2d`` that disagree, an option verispec does not
implement: each is a :class:`~verispec.errors.VerispecError` saying what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from verispec.errors import VerispecError
from verispec.heads.eagle3 import Eagle3Config, Eagle3Drafter
from verispec.models.base import head_dim_of

CheckpointFormat = Literal["speculators", "research"]
LAYER_TYPES = ("llama", "qwen3")
IGNORED = ("verifier_norm.weight", "verifier_lm_head.weight")
"""speculators' training-only tensors (the verifier's final norm and LM head rows); never needed to draft."""


@dataclass(frozen=True)
class Eagle3Metadata:
    """What a checkpoint says besides the network: where it came from and how to wire it up."""

    format: CheckpointFormat
    path: Path
    verifier: str | None = None
    """speculators' ``verifier.name_or_path``: the target the drafter was trained for, if recorded."""
    verifier_architectures: tuple[str, ...] = ()
    speculative_tokens: int | None = None
    """Draft depth of the checkpoint's default proposal method (speculators), if recorded."""
    embeddings_from_target: bool = False
    """The checkpoint had no ``embed_tokens.weight``; the target's were used."""
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    """``config.json`` as read."""


def load_eagle3(
    folder: str | Path,
    *,
    target_embeddings: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Eagle3Drafter, Eagle3Metadata]:
    """An EAGLE-3 drafter from a speculators or research-format folder (module docstring).

    ``target_embeddings [target_vocab, H]`` (the target's input embedding matrix) stand in for a
    checkpoint without ``embed_tokens.weight``; without them such a checkpoint is refused rather than
    drafting from uninitialised embeddings; a callable is asked only then (a GGUF target's table is
    de-quantized for it). Weights are converted to ``dtype``.
    """
    folder = Path(folder)
    raw = _read_json(folder / "config.json")
    fmt = _detect_format(raw, folder)
    config = _speculators_config(raw) if fmt == "speculators" else _research_config(raw)
    tensors = _rename(_read_weights(folder), fmt)
    state, from_target = _state_dict(config, tensors, target_embeddings, folder)
    with torch.device("meta"):  # no random initialisation of weights about to be replaced
        drafter = Eagle3Drafter(config)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    drafter.load_state_dict(state, assign=True)
    drafter.eval()
    metadata = Eagle3Metadata(
        format=fmt, path=folder, embeddings_from_target=from_target, config=raw, **_verifier_fields(raw)
    )
    return drafter, metadata


# -- reading ------------------------------------------------------------------------------------------


def is_eagle3_folder(folder: Path) -> bool:
    """Whether ``folder`` holds an EAGLE-3 checkpoint (either format), judged by its config.json
    alone: what a ``--heads`` folder is, before anything is loaded."""
    try:
        _detect_format(_read_json(folder / "config.json"), folder)
    except VerispecError:
        return False
    return True


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise VerispecError(f"{path.parent} is not an EAGLE-3 checkpoint: no config.json") from None
    except (OSError, json.JSONDecodeError) as err:
        raise VerispecError(f"cannot read {path}: {err}") from None
    if not isinstance(value, dict):
        raise VerispecError(f"{path} is not a JSON object")
    return value


def _detect_format(raw: dict[str, Any], folder: Path) -> CheckpointFormat:
    if raw.get("format") == "verispec-heads":  # its config has a draft_vocab_size too
        kind = raw.get("kind")
        raise VerispecError(f"{folder} holds verispec's own {kind} heads, not an EAGLE-3 checkpoint")
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise VerispecError(f"{folder} is a speculators {kind!r} checkpoint; verispec reads eagle3 ones")
        return "speculators"
    archs = [str(a) for a in raw.get("architectures") or []]
    if "draft_vocab_size" in raw or any("Eagle3" in a and "ForCausalLM" in a for a in archs):
        return "research"  # SGLang's LlamaForCausalLMEagle3, vLLM's Eagle3LlamaForCausalLM
    raise VerispecError(
        f"{folder} is not an EAGLE-3 checkpoint: its config.json has neither speculators_model_type "
        "(speculators format) nor draft_vocab_size (EAGLE/SGLang research format)"
    )


def _speculators_config(raw: dict[str, Any]) -> Eagle3Config:
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise VerispecError("speculators eagle3 config.json: transformer_layer_config is missing")
    if not isinstance(raw.get("speculators_config", {}), dict):
        raise VerispecError("speculators eagle3 config.json: speculators_config is not an object")
    # speculators builds a Qwen3Config when model_type is absent; its defaults (head_dim 128) differ.
    hf = _hf_layer_config(layer, default_type="qwen3")
    return _build_config(
        hf,
        draft_vocab_size=raw.get("draft_vocab_size", 32000),  # speculators' default
        aux_layer_ids=raw.get("eagle_aux_hidden_state_layer_ids") or (),
        target_hidden_size=raw.get("target_hidden_size"),
        flags=raw,
    )


def _research_config(raw: dict[str, Any]) -> Eagle3Config:
    if raw.get("bias"):
        raise VerispecError("EAGLE-3 research config.json: an fc with a bias (bias: true) is not supported")
    hf = _hf_layer_config(raw, default_type="llama")
    if raw.get("eagle_aux_hidden_state_layer_ids"):  # vLLM style: vLLM's convention already
        ids = list(raw["eagle_aux_hidden_state_layer_ids"])
    else:  # SGLang's: the output of layer i
        eagle = raw.get("eagle_config") or {}
        ids = [int(i) + 1 for i in (eagle.get("eagle_aux_hidden_state_layer_ids") or [])]
    flags = dict(raw)
    flags["fc_norm"] = bool(raw.get("fc_norm") or raw.get("use_aux_norm"))
    return _build_config(
        hf,
        draft_vocab_size=raw.get("draft_vocab_size") or hf.vocab_size,  # SGLang: None -> full vocabulary
        aux_layer_ids=ids,
        target_hidden_size=raw.get("target_hidden_size"),
        flags=flags,
    )


def _hf_layer_config(values: dict[str, Any], default_type: str) -> Any:
    """The layer's transformers config, built as speculators and SGLang build it, so head_dim, the
    rotary parameters (legacy ``rope_theta``/``rope_scaling`` or ``rope_parameters``) and the norms'
    epsilon get transformers' defaults and normalisation, not ours."""
    from transformers import LlamaConfig
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    kind = values.get("model_type", default_type)
    if kind not in LAYER_TYPES:
        raise VerispecError(f"EAGLE-3 layer model_type {kind!r} is not supported (only {LAYER_TYPES})")
    cls = LlamaConfig if kind == "llama" else Qwen3Config
    try:
        hf = cls(**{k: v for k, v in values.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError) as err:
        raise VerispecError(f"EAGLE-3 layer config is malformed: {err}") from None
    if int(hf.num_hidden_layers) != 1:
        raise VerispecError(
            f"EAGLE-3 drafter with {hf.num_hidden_layers} decoder layers: verispec implements one layer"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise VerispecError(f"EAGLE-3 layer activation {hf.hidden_act!r} is not supported (silu is)")
    sliding = "sliding_attention" in (getattr(hf, "layer_types", None) or [])
    if kind == "qwen3" and (getattr(hf, "use_sliding_window", False) or sliding):
        raise VerispecError("EAGLE-3 Qwen3 layer with sliding-window attention is not supported")
    return hf


def _build_config(
    hf: Any, *, draft_vocab_size: Any, aux_layer_ids: Any, target_hidden_size: Any, flags: Mapping[str, Any]
) -> Eagle3Config:
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type") == "llama3" and "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = hf.max_position_embeddings
    try:
        return Eagle3Config(
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_attention_heads=int(hf.num_attention_heads),
            num_key_value_heads=int(hf.num_key_value_heads or hf.num_attention_heads),
            head_dim=head_dim_of(hf),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            draft_vocab_size=int(draft_vocab_size),
            target_vocab_size=int(hf.vocab_size),
            norm_before_residual=bool(flags.get("norm_before_residual", False)),
            aux_layer_ids=tuple(int(i) for i in aux_layer_ids),
            norm_before_fc=bool(flags.get("norm_before_fc", False)),
            fc_norm=bool(flags.get("fc_norm", False)),
            norm_output=bool(flags.get("norm_output", False)),
            target_hidden_size=int(target_hidden_size) if target_hidden_size else None,
            qk_norm=hf.model_type == "qwen3",
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope_scaling=rope,
        )
    except (TypeError, ValueError) as err:
        raise VerispecError(f"EAGLE-3 config.json is malformed: {err}") from None


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's weight files: safetensors (single or sharded) or PyTorch ``.bin``."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index_name).is_file():
            weight_map = _read_json(folder / index_name).get("weight_map")
            if not isinstance(weight_map, dict):
                raise VerispecError(f"{folder / index_name} has no weight_map")
            out: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                out.update(_read_file(folder / shard))
            return out
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return _read_file(folder / name)
    raise VerispecError(f"{folder} has no weights (model.safetensors, pytorch_model.bin or a sharded index)")


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise VerispecError(f"EAGLE-3 weights {path} are missing") from None
    except (OSError, SafetensorError, RuntimeError, ValueError) as err:
        raise VerispecError(f"cannot read EAGLE-3 weights {path}: {err}") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise VerispecError(f"{path} is not a state dict of tensors")
    return loaded


def _rename(tensors: dict[str, torch.Tensor], fmt: CheckpointFormat) -> dict[str, torch.Tensor]:
    """Tensor names as :class:`Eagle3Drafter` has them (research: ``midlayer.`` -> ``layers.0.``, and no
    ``model.`` prefix, as SGLang's loader accepts either); speculators' training-only tensors dropped."""
    out = {}
    for name, value in tensors.items():
        if fmt == "research":
            name = name.removeprefix("model.")
            if name.startswith("midlayer."):
                name = "layers.0." + name.removeprefix("midlayer.")
        if name not in IGNORED:
            out[name] = value
    return out


def _state_dict(
    config: Eagle3Config,
    tensors: dict[str, torch.Tensor],
    target_embeddings: torch.Tensor | Callable[[], torch.Tensor] | None,
    folder: Path,
) -> tuple[dict[str, torch.Tensor], bool]:
    """The drafter's full state dict from the checkpoint's tensors, every name and shape checked;
    whether the embeddings came from the target."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Eagle3Drafter(config).state_dict().items()}
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise VerispecError(f"{folder}: tensors the EAGLE-3 drafter does not have: {', '.join(unknown[:8])}")
    state = dict(tensors)
    from_target = "embed_tokens.weight" not in state
    if from_target:
        state["embed_tokens.weight"] = _target_embeddings(config, target_embeddings, folder)
    if config.norm_before_fc and "input_norm.weight" not in state:
        state["input_norm.weight"] = torch.ones(expected["input_norm.weight"])  # speculators' init
    state.update(_vocab_maps(config, state.pop("d2t", None), state.pop("t2d", None), folder))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise VerispecError(f"{folder}: EAGLE-3 weights are missing {', '.join(missing[:8])}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise VerispecError(
                f"{folder}: {name} has shape {tuple(state[name].shape)}, the config implies {tuple(shape)}"
            )
        if state[name].is_floating_point() and not bool(torch.isfinite(state[name]).all()):
            raise VerispecError(f"{folder}: {name} has NaN or infinite values (never trained or saved?)")
    return state, from_target


def _target_embeddings(
    config: Eagle3Config, embeddings: torch.Tensor | Callable[[], torch.Tensor] | None, folder: Path
) -> torch.Tensor:
    if callable(embeddings):
        embeddings = embeddings()
    if embeddings is None:
        raise VerispecError(
            f"{folder} has no embed_tokens.weight (the drafter shares its target's): pass "
            "target_embeddings=<the target's input embedding matrix> to load_eagle3"
        )
    want = (config.target_vocab_size, config.hidden_size)
    if tuple(embeddings.shape) != want:
        raise VerispecError(
            f"target_embeddings have shape {tuple(embeddings.shape)}, the drafter needs {want} "
            "(target vocabulary x drafter hidden size): is this the target it was trained for?"
        )
    return embeddings.detach()


def _vocab_maps(
    config: Eagle3Config, d2t: torch.Tensor | None, t2d: torch.Tensor | None, folder: Path
) -> dict[str, torch.Tensor]:
    """``d2t`` and ``t2d`` checked against each other; ``t2d`` is derived when only ``d2t`` is stored
    (SGLang reads only ``d2t``). A full draft vocabulary without ``d2t`` is the identity."""
    vd, vt = config.draft_vocab_size, config.target_vocab_size
    if d2t is None:
        if vd != vt:
            raise VerispecError(
                f"{folder}: a draft vocabulary of {vd} of {vt} tokens needs d2t (draft -> target ids)"
            )
        return {"d2t": torch.zeros(vd, dtype=torch.long), "t2d": torch.ones(vt, dtype=torch.bool)}
    if d2t.dim() != 1 or d2t.shape[0] != vd or d2t.is_floating_point():
        raise VerispecError(f"{folder}: d2t must be {vd} integers, got {d2t.dtype} {tuple(d2t.shape)}")
    targets = torch.arange(vd) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= vt or targets.unique().numel() != vd:
        raise VerispecError(f"{folder}: d2t does not map the draft vocabulary to distinct target ids < {vt}")
    derived = torch.zeros(vt, dtype=torch.bool)
    derived[targets] = True
    if t2d is not None and (t2d.shape != (vt,) or not torch.equal(t2d.bool(), derived)):
        raise VerispecError(f"{folder}: t2d does not mark exactly the target ids d2t maps to")
    return {"d2t": d2t.long(), "t2d": derived}


def _verifier_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The verifier and the default proposal's depth from ``speculators_config`` (absent: None)."""
    spec = raw.get("speculators_config") or {}
    verifier = spec.get("verifier") or {}
    methods = [m for m in spec.get("proposal_methods") or [] if isinstance(m, dict)]
    default = spec.get("default_proposal_method")
    chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})
    tokens = chosen.get("speculative_tokens")
    try:
        return {
            "verifier": verifier.get("name_or_path"),
            "verifier_architectures": tuple(str(a) for a in verifier.get("architectures") or ()),
            "speculative_tokens": int(tokens) if tokens is not None else None,
        }
    except (AttributeError, TypeError, ValueError) as err:
        raise VerispecError(f"speculators eagle3 config.json: malformed speculators_config ({err})") from None
