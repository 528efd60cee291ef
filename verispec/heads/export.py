"""``verispec export``: drafters in the formats the GPU serving engines load.

A drafter trained or measured on one CPU should serve where a model outgrows one machine, so export
writes what those engines read, and prints the command that serves it:

- ``speculators``: an EAGLE-3 drafter (any format :func:`~verispec.heads.speculators_io.load_eagle3`
  reads) as a speculators folder, which vLLM serves with ``vllm serve DIR`` (the folder names its
  verifier) or as the ``model`` of a ``--speculative-config``;
- ``sglang``: the same drafter in the research format SGLang's ``--speculative-algorithm EAGLE3``
  loads (``midlayer.*`` names, its own layer-id convention);
- ``vllm-medusa``: verispec's Medusa heads in the names vLLM's Medusa loader reads
  (``blocks.{i}.layers.{j}``, one ``lm_heads.{i}`` per head, ``token_map`` for a reduced vocabulary).

verispec's own EAGLE heads (:mod:`verispec.heads.eagle`) are another architecture, which neither
engine runs; they are refused with the way to an EAGLE-3 drafter (``verispec train eagle3``).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from verispec.errors import VerispecError
from verispec.heads.io import CONFIG_FILE, load_heads, read_config
from verispec.heads.medusa import MedusaHeads
from verispec.heads.speculators_io import is_eagle3_folder, load_eagle3
from verispec.heads.speculators_save import save_sglang, save_speculators

FORMATS = ("speculators", "sglang", "vllm-medusa")


def add_export_flags(parser: argparse.ArgumentParser) -> None:
    """``verispec export``: the flags (the command line module calls :func:`run_export`)."""
    parser.add_argument("--heads", required=True, help="the drafter: an EAGLE-3 folder, or Medusa heads")
    parser.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    parser.add_argument("--out", required=True, help="the folder to write (created; must be empty)")
    parser.add_argument(
        "--target",
        default=None,
        help="the target (registry name, folder or .gguf): Medusa's LM heads are its rows, and an "
        "EAGLE-3 checkpoint without embeddings takes its table",
    )
    parser.add_argument(
        "--verifier",
        default=None,
        help="the target's Hugging Face id to write (default: the drafter's own, else --target)",
    )


def run_export(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise VerispecError(f"--out {out} is not empty")
    source = Path(args.heads).expanduser()
    target = _load_target(args.target) if args.target else None
    steps = 3
    if args.format == "vllm-medusa":
        if target is None:
            raise VerispecError("--format vllm-medusa needs --target: each head's LM head is the target's")
        steps = export_vllm_medusa(source, target, out)
    else:
        args.verifier = export_eagle3(source, out, args.format, target, args.verifier)
    print(f"wrote {out}")
    for line in serve_commands(args.format, out, args.verifier or args.target, steps):
        print(line)
    return 0


def _load_target(name: str) -> Any:
    from verispec.config import ModelLoadConfig
    from verispec.models import load_model

    return load_model(name, ModelLoadConfig())


def export_eagle3(source: Path, out: Path, fmt: str, target: Any | None, verifier: str | None) -> str | None:
    """Write the EAGLE-3 drafter of ``source`` as ``fmt``; returns the verifier named in the result."""
    if not is_eagle3_folder(source):
        if (source / CONFIG_FILE).is_file() or (source / "eagle" / CONFIG_FILE).is_file():
            raise VerispecError(
                f"{source} holds verispec's own heads, which are not the EAGLE-3 architecture vLLM and "
                "SGLang run; train an EAGLE-3 drafter with `verispec train eagle3` and export that"
            )
        raise VerispecError(f"{source} is not an EAGLE-3 checkpoint (speculators or research format)")
    embeddings = None
    if target is not None:
        from verispec.heads.identity import embedding_table

        embeddings = lambda: embedding_table(target.model.get_input_embeddings())  # noqa: E731
    drafter, meta = load_eagle3(source, target_embeddings=embeddings)
    name = verifier or meta.verifier or (str(target.name) if target is not None else None)
    if fmt == "speculators":
        architectures = meta.verifier_architectures or _architectures(target)
        save_speculators(drafter, out, name, verifier_architectures=architectures)
    else:
        _check_sglang_arithmetic(drafter)
        save_sglang(drafter, out)
    return name


SGLANG_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
"""The options SGLang's ``LlamaForCausalLMEagle3`` does not read (sgl-project/sglang 03d5a77): it
always computes the EAGLE authors' arithmetic, all of them off."""


def _check_sglang_arithmetic(drafter: Any) -> None:
    """Refuse a drafter SGLang would run with other arithmetic than it was trained with: it would
    load without a word and draft badly (lossless still, but slow)."""
    on = [flag for flag in SGLANG_FLAGS if getattr(drafter.config, flag)]
    if on:
        raise VerispecError(
            f"SGLang's EAGLE-3 layer computes none of {', '.join(on)}, which this drafter was trained "
            "with: serve it with vLLM (--format speculators), or train one without them "
            "(`verispec train eagle3 --norm-before-residual off`)"
        )


def _architectures(target: Any | None) -> tuple[str, ...]:
    if target is None:
        return ("LlamaForCausalLM",)
    return tuple(getattr(target.model.config, "architectures", None) or ("LlamaForCausalLM",))


def export_vllm_medusa(source: Path, target: Any, out: Path) -> int:
    """verispec's Medusa heads (checked against ``target``) in vLLM's Medusa format (module
    docstring); returns the number of heads (vLLM's ``num_speculative_tokens`` for them)."""
    from verispec.heads.vocab import float_lm_head_weight

    if read_config(source).get("kind") != "medusa":
        raise VerispecError(f"{source} holds no Medusa heads")
    loaded = load_heads(source, target, kind="medusa")
    heads: MedusaHeads = loaded.module  # type: ignore[assignment]
    cfg = heads.config
    weight = float_lm_head_weight(target)  # [V, H]
    vocab = loaded.draft_vocab
    rows = weight[vocab.long()] if vocab is not None else weight
    tensors: dict[str, torch.Tensor] = {}
    for i, head in enumerate(heads.medusa_head):
        for j, block in enumerate(head):
            tensors[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.detach()
            tensors[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.detach()
        tensors[f"lm_heads.{i}.weight"] = rows
    if vocab is not None:
        tensors["token_map"] = vocab.long()
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": int(target.vocab_size),
        "truncated_vocab_size": int(rows.shape[0]),
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": True,
        "max_paths": 64,
        "topk": 10,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return cfg.num_heads


def serve_commands(fmt: str, out: Path, target: str | None, steps: int = 3) -> list[str]:
    """The commands that serve the written folder, for the user to copy (and for the docs)."""
    model = shlex.quote(target or "<target's Hugging Face id>")
    folder = shlex.quote(str(out))
    if fmt == "speculators":
        config = json.dumps({"model": str(out), "method": "eagle3", "num_speculative_tokens": steps})
        return [
            "serve it with vLLM (the folder names its target):",
            f"  vllm serve {folder}",
            "or name the target yourself:",
            f"  vllm serve {model} --speculative-config {shlex.quote(config)}",
        ]
    if fmt == "sglang":
        return [
            "serve it with SGLang:",
            f"  python -m sglang.launch_server --model-path {model} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {folder} --speculative-num-steps {steps} "
            "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16",
        ]
    config = json.dumps({"model": str(out), "method": "medusa", "num_speculative_tokens": steps})
    return [
        "serve it with vLLM:",
        f"  vllm serve {model} --speculative-config {shlex.quote(config)}",
    ]
