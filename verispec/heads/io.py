"""Saving and loading heads: a folder with ``config.json`` and ``model.safetensors``.

Format (``format: "verispec-heads"``, ``format_version: 1``)::

    config.json
      kind             "medusa" | "eagle"
      medusa | eagle   the network's sizes (MedusaConfig / EagleConfig fields)
      target           TargetIdentity: name, vocab_size, hidden_size, config_sha256, embedding_probe
      draft_vocab_size N, or 0 when the heads draft over the target's whole vocabulary
      tree             defaults for drafting: {"nodes": budget of tree nodes, "width": top-k per level}
      training         how the heads were made: command, data, tokens, held-out accuracy per position
    model.safetensors
      the network's parameters (float16), plus ``draft_vocab`` [N] int64 (target token ids, in
      draft-index order) when N > 0

Nothing of the target is stored (its LM head and embeddings are used in place), so heads are a few
MB, and loading checks the target identity and refuses heads trained for another model
(:func:`verispec.heads.identity.check_identity`).

How this maps to what vLLM and SGLang load (not drop-in; a converter would need to):

- Medusa: tensor names are the original FasterDecoding/Medusa ``medusa_head.{i}.{j}.linear.weight``
  and ``.bias``, which vLLM's Medusa loader maps onto its ``blocks.{i}.layers.{j}``. vLLM also wants
  a per-head LM head (``lm_heads.{i}.weight``): the target's head, or its rows for a truncated
  vocabulary, which vLLM expresses as ``truncated_vocab_size`` plus a ``token_map``: our
  ``draft_vocab``.
- EAGLE: ``fc.weight`` and ``layers.0.{self_attn,mlp,*_layernorm}.*`` are EAGLE's names (vLLM's and
  SGLang's EAGLE loaders read them); ``draft_vocab`` is EAGLE-3's ``d2t`` written as absolute ids
  (``d2t = draft_vocab - arange(N)``), and ``t2d`` is its indicator over the target vocabulary. Two
  differences: our features are the target's hidden states *after* its final norm (EAGLE-1 reads
  them before it, EAGLE-3 concatenates three layers), and ``embed_norm``/``feature_norm``/``norm`` are
  extra RMSNorms, so an exporter must fold or re-train them. With ``feature_layers`` (EAGLE-3's
  multi-layer features) the feature is ``h_last + tap_fc([tap_norm(x_i) for i in feature_layers])``,
  ``x_i`` the normed input of decoder layer i; EAGLE-3's own ``fc`` maps the raw residual streams
  of three layers ``[low; mid; high]`` 3H -> H, so that too needs a converter, not a rename.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.identity import TargetIdentity, check_identity
from verispec.heads.medusa import MedusaConfig, MedusaHeads

HeadsKind = Literal["medusa", "eagle"]
KINDS: tuple[str, ...] = ("medusa", "eagle")
FORMAT = "verispec-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
"""Heads shipped with verispec: ``shipped/<target name>/<kind>/`` and ``shipped/MANIFEST.json``."""

DEFAULT_TREE = {"medusa": {"nodes": 16, "width": 4}, "eagle": {"nodes": 16, "width": 4}}


@dataclass
class LoadedHeads:
    kind: HeadsKind
    module: nn.Module
    target: TargetIdentity
    draft_vocab: torch.Tensor | None
    tree: dict[str, int]
    training: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def build_module(kind: str, sizes: dict[str, Any]) -> nn.Module:
    if kind == "medusa":
        return MedusaHeads(MedusaConfig(**sizes))
    if kind == "eagle":
        return EagleDrafter(EagleConfig(**sizes))
    raise VerispecError(f"unknown heads kind {kind!r}; choose one of {', '.join(KINDS)}")


def save_heads(
    folder: Path,
    kind: HeadsKind,
    module: nn.Module,
    target: TargetIdentity,
    draft_vocab: torch.Tensor | None,
    *,
    tree: dict[str, int] | None = None,
    training: dict[str, Any] | None = None,
) -> None:
    """Write ``folder/config.json`` and ``folder/model.safetensors`` (float16 weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(torch.float16).contiguous() for name, t in module.state_dict().items()}
    if draft_vocab is not None:
        tensors["draft_vocab"] = draft_vocab.long().contiguous()
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        kind: module.config.to_dict(),  # type: ignore[union-attr]
        "target": target.to_dict(),
        "draft_vocab_size": int(draft_vocab.numel()) if draft_vocab is not None else 0,
        "tree": tree or DEFAULT_TREE[kind],
        "training": training or {},
    }
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "kind": kind})
    tmp.replace(folder / WEIGHTS_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise VerispecError(f"no heads in {folder} (missing {CONFIG_FILE})") from None
    except json.JSONDecodeError as exc:
        raise VerispecError(f"{path} is not valid JSON: {exc}") from None
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise VerispecError(f"{path} is not a verispec heads config (format {FORMAT} v{FORMAT_VERSION})")
    return config


def load_heads(folder: Path, target: Any | None = None, *, kind: str | None = None) -> LoadedHeads:
    """Load heads from ``folder``; with ``target``, refuse heads trained for another model."""
    config = read_config(folder)
    found = config["kind"]
    if kind is not None and found != kind:
        raise VerispecError(f"{folder} holds {found} heads, not {kind} heads")
    identity = TargetIdentity.from_dict(config["target"])
    if target is not None:
        check_identity(identity, target, f"the {found} heads in {folder}")
    module = build_module(found, config[found])
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except FileNotFoundError:
        raise VerispecError(f"{folder} has {CONFIG_FILE} but no {WEIGHTS_FILE}") from None
    vocab = tensors.pop("draft_vocab", None)
    try:
        module.load_state_dict({k: v.float() for k, v in tensors.items()})
    except RuntimeError as exc:
        raise VerispecError(f"{folder / WEIGHTS_FILE} does not match its config: {exc}") from None
    if (vocab.numel() if vocab is not None else 0) != int(config.get("draft_vocab_size", 0)):
        raise VerispecError(f"{folder}: draft_vocab does not have draft_vocab_size entries")
    return LoadedHeads(
        kind=found,
        module=module.eval(),
        target=identity,
        draft_vocab=vocab,
        tree={**DEFAULT_TREE[found], **config.get("tree", {})},
        training=config.get("training", {}),
        path=folder,
    )


def shipped_heads(target_name: str, kind: str) -> Path | None:
    """The folder of the ``kind`` heads shipped for the target called ``target_name``, or None."""
    folder = SHIPPED_DIR / target_name / kind
    return folder if (folder / CONFIG_FILE).is_file() else None


def shipped_heads_fit(target: Any, kind: str) -> bool:
    """Whether ``kind`` heads are shipped for ``target`` and were trained for this very model.

    Shipped heads are found by the target's name, and a local folder may carry a bundled model's
    name while holding another model: there the heads would be refused at load. Only the recorded
    identity is compared (no weights are read), so asking costs one small JSON file.
    """
    folder = shipped_heads(str(target.name), kind)
    if folder is None:
        return False
    try:
        saved = TargetIdentity.from_dict(read_config(folder)["target"])
        check_identity(saved, target, f"the shipped {kind} heads")
    except VerispecError:
        return False
    return True


def heads_kinds_in(heads: str | Path) -> tuple[str, ...]:
    """The kinds of heads a ``--heads`` folder holds (itself or its ``<kind>/`` subfolders)."""
    folder = Path(heads).expanduser()
    if (folder / CONFIG_FILE).is_file():
        return (read_config(folder)["kind"],)
    return tuple(kind for kind in KINDS if (folder / kind / CONFIG_FILE).is_file())


def resolve_heads_folder(heads: str | Path | None, kind: str, target_name: str) -> Path:
    """The folder to load ``kind`` heads from: ``heads`` itself, its ``<kind>/`` subfolder, or (None)
    the heads shipped for ``target_name``."""
    if heads is None:
        folder = shipped_heads(target_name, kind)
        if folder is None:
            shipped = sorted(p.parent.name for p in SHIPPED_DIR.glob(f"*/{kind}/{CONFIG_FILE}"))
            raise VerispecError(
                f"no {kind} heads are shipped for {target_name} (shipped for: "
                f"{', '.join(shipped) or 'none'}); train them with "
                f"`verispec train {kind} --target {target_name} --out DIR` and pass --heads DIR"
            )
        return folder
    folder = Path(heads).expanduser()
    if (folder / CONFIG_FILE).is_file():
        return folder
    if (folder / kind / CONFIG_FILE).is_file():
        return folder / kind
    raise VerispecError(f"no {kind} heads in {folder} (looked for {CONFIG_FILE} there and in {kind}/)")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(root: Path = SHIPPED_DIR) -> dict[str, Any]:
    """(Re)write ``root/MANIFEST.json`` from every ``<target>/<kind>/`` folder under ``root``: files with
    size and sha256, and each folder's training record (command, data, held-out accuracy)."""
    entries = []
    for config_path in sorted(root.glob(f"*/*/{CONFIG_FILE}")):
        folder = config_path.parent
        config = read_config(folder)
        files = {
            f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
            for f in sorted(folder.iterdir())
            if f.is_file()
        }
        entries.append(
            {
                "path": str(folder.relative_to(root)),
                "kind": config["kind"],
                "target": config["target"]["name"],
                "draft_vocab_size": config["draft_vocab_size"],
                "sizes": config[config["kind"]],
                "tree": config.get("tree", {}),
                "files": files,
                "training": config.get("training", {}),
            }
        )
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "heads": entries}
    (root / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
