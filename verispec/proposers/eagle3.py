"""The ``eagle3`` proposer: EAGLE-3 drafters in the ecosystem's formats draft verispec's trees.

Drafters trained on GPUs at a scale a small machine never reaches (speculators' ``*-speculator.eagle3``
checkpoints, the EAGLE authors' and SGLang's research folders) load from a local folder with
:func:`~verispec.heads.speculators_io.load_eagle3` and draft exactly as they were trained to
(:mod:`verispec.heads.eagle3`). The drafting itself is :class:`~verispec.proposers.eagle.EagleProposer`'s:
catch up on the true pairs, expand the tree level by level (EAGLE-2), keep the best nodes under the
depth policy, verify the tree exactly. Three things differ, and only those are overridden here:

- what the target hands over: the *raw* inputs of the drafter's auxiliary layers
  (:attr:`~verispec.proposers.base.Proposer.raw_features`), where verispec's EAGLE reads the final
  normed state;
- what a token is embedded with: the drafter's own table (a checkpoint without one takes the target's);
- what scores a node: the drafter's own LM head over its reduced vocabulary, whose ids map to the
  target's through ``d2t`` (:class:`DraftVocabHead`).

A drafter made for another target is refused (:func:`check_target`): a different vocabulary or hidden
size cannot work at all, and a different verifier name means the drafter learned another model's
states, which would draft garbage, slowly.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from verispec.errors import VerispecError
from verispec.heads.eagle3 import Eagle3Drafter
from verispec.heads.identity import embedding_table
from verispec.heads.io import DEFAULT_TREE
from verispec.heads.speculators_io import Eagle3Metadata, is_eagle3_folder, load_eagle3
from verispec.proposers.base import Proposer, register
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.heads_base import HeadsQuantization, heads_quantization

if TYPE_CHECKING:
    from verispec.config import SpecConfig
    from verispec.models.base import CausalLM


class DraftVocabHead(nn.Module):
    """An EAGLE-3 drafter's own LM head behind :class:`~verispec.heads.vocab.VocabHead`'s interface
    (``vocab`` the target id of each draft id, empty for the full vocabulary; ``to_target``), so the
    tree drafting, the request rules and the grammar masks treat both heads alike."""

    def __init__(self, drafter: Eagle3Drafter, target_size: int) -> None:
        super().__init__()
        self._logits = drafter.logits  # a bound method: the drafter stays the proposer's module
        ids = torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device)
        vocab = drafter.to_target_ids(ids)
        self.register_buffer("vocab", vocab if drafter.uses_draft_vocab else vocab[:0])
        self.size = int(drafter.config.draft_vocab_size)
        self.target_size = int(target_size)
        self.softcap = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden.float()).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab[draft_ids] if self.vocab.numel() else draft_ids


class Eagle3Proposer(EagleProposer):
    """EAGLE-2 trees from an ecosystem EAGLE-3 drafter (module docstring)."""

    name = "eagle3"
    kind = "eagle3"
    raw_features = True

    def __init__(
        self,
        drafter: Eagle3Drafter,
        target_vocab_size: int,
        *,
        nodes: int,
        width: int,
        quantize: HeadsQuantization = "none",
    ) -> None:
        head = DraftVocabHead(drafter, target_vocab_size)
        super().__init__(drafter, head, drafter.embed_tokens, nodes=nodes, width=width, quantize=quantize)  # type: ignore[arg-type]
        self._aux_width = drafter.config.num_aux * drafter.config.aux_width

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over the aux layers' raw states, which follow the final state in each hidden row."""
        return self.drafter.fuse(hidden[:, -self._aux_width :])

    @classmethod
    def build(cls, spec: SpecConfig, target: CausalLM) -> Eagle3Proposer:  # type: ignore[override]
        """Load the drafter of ``spec.heads`` (the folder itself, or its ``eagle3/``, as heads folders
        hold one subfolder per kind) for ``target``; no EAGLE-3 drafter is shipped."""
        if spec.heads is None:
            raise VerispecError(
                "method eagle3 needs --heads DIR: a speculators-format or research-format EAGLE-3 folder "
                "(config.json and model.safetensors) made for this target"
            )
        folder = Path(spec.heads).expanduser()
        if not is_eagle3_folder(folder) and is_eagle3_folder(folder / cls.kind):
            folder = folder / cls.kind
        return cls.for_target(folder, target, spec)

    @classmethod
    def for_target(cls, folder: Path, target: Any, spec: SpecConfig | None = None) -> Eagle3Proposer:
        """The proposer of the drafter in ``folder``, checked against ``target`` and on its device."""
        drafter, meta = load_eagle3(
            folder, target_embeddings=lambda: embedding_table(target.model.get_input_embeddings())
        )
        check_target(drafter, meta, target)
        if not drafter.config.aux_layer_ids:  # research folders may leave them to the engine
            layers = int(target.config.num_hidden_layers)
            drafter.config = replace(drafter.config, aux_layer_ids=default_aux_layers(layers))
        target.check_feature_layers(drafter.config.aux_layer_ids)
        device = getattr(target, "device", torch.device("cpu"))
        proposer = cls(
            drafter.to(device),
            int(target.vocab_size),
            nodes=(spec.tree_nodes if spec is not None else None) or DEFAULT_TREE["eagle"]["nodes"],
            width=(spec.tree_width if spec is not None else None) or DEFAULT_TREE["eagle"]["width"],
            quantize=heads_quantization(target),
        )
        proposer.device = device
        proposer.description.update(heads=str(folder), format=meta.format, verifier=meta.verifier)
        return proposer


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's usual auxiliary layers, low, middle and high (speculators' and vLLM's default), in
    their convention: the input of each layer."""
    return (2, num_layers // 2, num_layers - 3)


def check_target(drafter: Eagle3Drafter, meta: Eagle3Metadata, target: Any) -> None:
    """Refuse a drafter made for another target: its vocabulary, its hidden size or its verifier."""
    cfg = drafter.config
    reasons = []
    if cfg.target_vocab_size != int(target.vocab_size):
        reasons.append(f"its vocabulary has {cfg.target_vocab_size} tokens, the target's {target.vocab_size}")
    width = cfg.target_hidden_size or cfg.hidden_size
    if width != int(target.hidden_size):
        reasons.append(f"it reads states of width {width}, the target's are {target.hidden_size}")
    if not reasons and meta.verifier and not same_model(meta.verifier, target_names(target)):
        reasons.append(f"it was trained for {meta.verifier!r}, the target is {target.name!r}")
    if reasons:
        raise VerispecError(
            f"the EAGLE-3 drafter in {meta.path} was not made for this target: {'; '.join(reasons)}. "
            "Bring the drafter trained for this model (if it is the same model under another name, "
            "set speculators_config.verifier.name_or_path in its config.json to the target's name)"
        )


def target_names(target: Any) -> list[str]:
    """Every name the target goes by: verispec's and the Hugging Face path it was loaded from."""
    names = [str(target.name)]
    source = getattr(getattr(target, "config", None), "_name_or_path", None)
    if source:
        names.append(str(source))
    return names


_QUANT_SUFFIX = re.compile(r"[-_.](gguf|q\d(_[a-z0-9]+)*|iq\d\w*|f16|f32|bf16|fp16|fp8|int[48]|awq|gptq)$")


def _base_name(name: str) -> str:
    """``Qwen/Qwen2.5-Coder-1.5B-Instruct`` and ``qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`` alike:
    the last path part, lower case, without file and quantization suffixes."""
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    while True:
        shorter = _QUANT_SUFFIX.sub("", base)
        if shorter == base:
            return base
        base = shorter


def same_model(verifier: str, names: list[str]) -> bool:
    """Whether a checkpoint's verifier is one of the target's names, up to case, folders, a GGUF's
    file and quantization suffixes."""
    want = _base_name(verifier)
    return any(_base_name(n) == want for n in names)


@register("eagle3")
def _build(spec: SpecConfig, target: CausalLM, draft: CausalLM | None) -> Proposer:
    return Eagle3Proposer.build(spec, target)
