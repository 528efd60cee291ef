"""Which target a set of heads belongs to, so heads trained for another model are refused.

Heads read a target's hidden states and reuse its LM head and embeddings: on another model they
would propose garbage (the output would still be exact, but nothing would be accepted), so loading
them there is an error, not a silent slowdown. A model is identified by

- ``config_sha256``: a hash of the architecture fields that shape hidden states (model type, sizes,
  layer and head counts, vocabulary, tied embeddings);
- ``embedding_probe``: for a few fixed rows of the input embedding table, the dot product with a
  fixed +-1 vector, and the row's norm. Two fine-tunes of one architecture share a config but not
  their embeddings. The probe is compared with a tolerance (a few percent of the row norm), so the
  same model loaded in float32, bfloat16 or float16 still matches.

The name is recorded for messages only: a local folder holding the same model has another name.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from verispec.errors import VerispecError

_CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
_PROBE_ROWS = 8
_PROBE_TOLERANCE = 0.05
"""Allowed probe difference as a fraction of the row norm: bfloat16 rounding moves a +-1 dot
product by ~0.4% of the norm, an unrelated model's rows by ~100%."""


@dataclass(frozen=True)
class TargetIdentity:
    name: str
    vocab_size: int
    hidden_size: int
    config_sha256: str
    embedding_probe: tuple[tuple[float, float], ...]
    """(dot with the fixed +-1 vector, L2 norm) of each probed embedding row."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["embedding_probe"] = [list(p) for p in self.embedding_probe]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetIdentity:
        return cls(
            name=str(data["name"]),
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            config_sha256=str(data["config_sha256"]),
            embedding_probe=tuple((float(a), float(b)) for a, b in data["embedding_probe"]),
        )

    @property
    def short(self) -> str:
        """A short key for cache folders: the config hash and the probe, hashed together."""
        text = self.config_sha256 + json.dumps([round(a, 2) for a, _ in self.embedding_probe])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def identify(target: Any) -> TargetIdentity:
    """The identity of a loaded target (:class:`verispec.models.hf.HFCausalLM`)."""
    cfg = target.config
    fields = {f: getattr(cfg, f, None) for f in _CONFIG_FIELDS}
    fields["vocab_size"] = int(target.vocab_size)
    fields["hidden_size"] = int(target.hidden_size)
    config_sha = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    return TargetIdentity(
        name=str(target.name),
        vocab_size=int(target.vocab_size),
        hidden_size=int(target.hidden_size),
        config_sha256=config_sha,
        embedding_probe=_probe(target.model.get_input_embeddings()),
    )


def embedding_table(embedding: torch.nn.Module) -> torch.Tensor:
    """The float32 table [vocab, hidden] of an input embedding: its weight, or a GGUF embedding's
    de-quantized blocks (which keep no float table)."""
    weight = getattr(embedding, "weight", None)
    if weight is not None:
        return weight.detach().float()
    return embedding.dequantized()  # type: ignore[operator]


def _probe(embedding: torch.nn.Module) -> tuple[tuple[float, float], ...]:
    weight = getattr(embedding, "weight", None)
    if weight is not None:
        vocab, hidden = weight.shape
    else:
        vocab, hidden = embedding.num_embeddings, embedding.embedding_dim
    signs = torch.randint(0, 2, (hidden,), generator=torch.Generator().manual_seed(0)).double() * 2 - 1
    rows = [(i * vocab) // _PROBE_ROWS + 1 for i in range(_PROBE_ROWS)]
    with torch.no_grad():  # the rows as they are (a GGUF embedding de-quantizes only these)
        picked = weight.detach()[rows] if weight is not None else embedding(torch.tensor(rows))
    return tuple((float(r @ signs), float(r.norm())) for r in picked.double().cpu())


def check_identity(saved: TargetIdentity, target: Any, what: str) -> None:
    """Raise :class:`VerispecError` unless ``target`` is the model ``saved`` describes."""
    here = identify(target)
    reasons = []
    if saved.vocab_size != here.vocab_size:
        reasons.append(f"vocabulary {saved.vocab_size} vs {here.vocab_size}")
    if saved.hidden_size != here.hidden_size:
        reasons.append(f"hidden size {saved.hidden_size} vs {here.hidden_size}")
    if not reasons and saved.config_sha256 != here.config_sha256:
        reasons.append("a different architecture config")
    if not reasons and not _probes_match(saved.embedding_probe, here.embedding_probe):
        reasons.append("different embedding weights")
    if reasons:
        raise VerispecError(
            f"{what} were trained for {saved.name}, not for {here.name} ({'; '.join(reasons)}); "
            f"train heads for this target with `verispec train ... --target {here.name}`"
        )


def _probes_match(a: tuple[tuple[float, float], ...], b: tuple[tuple[float, float], ...]) -> bool:
    if len(a) != len(b):
        return False
    for (dot_a, norm_a), (dot_b, norm_b) in zip(a, b, strict=True):
        scale = max(norm_a, norm_b, 1e-12)
        if abs(dot_a - dot_b) > _PROBE_TOLERANCE * scale or not math.isclose(norm_a, norm_b, rel_tol=0.05):
            return False
    return True
