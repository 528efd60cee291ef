"""Training an EAGLE-3 drafter in speculators' format: its draft vocabulary, its start from the
target, batches of raw target states, the training-time-test loss, accuracy per depth, and the fit
and the folder ``verispec train eagle3`` runs and writes.

The drafter is :class:`~verispec.heads.eagle3.Eagle3Drafter` (speculators' ``Eagle3DraftModel``), so
what is trained here runs in speculators, vLLM and SGLang as well as in verispec. It learns from the
same hidden-state stores as verispec's own heads (:mod:`verispec.training.store`), with the target's
*raw* residual stream at the input of its ``aux_layers`` cached as taps (``DataSpec.raw_taps``: a
store of its own, never mixed with the normed taps verispec's EAGLE reads).

Pair j is ``(g_j, x_{j+1})``, ``g_j`` the aux states after token j; its label is token j+2 (the
target's argmax there, as :mod:`verispec.training.eagle`). Pass s of training-time test feeds row j
the previous pass's output with the true token ``x_{j+1+s}`` (speculators' teacher forcing,
:meth:`Eagle3Drafter.forward`), so its label is token j+2+s: every per-position tensor is shifted s
places left for pass s (:func:`_shifted`). Pass s's loss is weighted ``depth_decay ** s`` (0.8, as the
EAGLE-3 authors and SpecForge weight steps and verispec's EAGLE does: a deeper draft only counts when
the ones before it were accepted; speculators' trainer defaults to equal weights, its
``ttt_step_loss_decay=1``).

Choices, each speculators' unless said otherwise:

- the draft vocabulary: the ``draft_vocab`` most frequent labels of the training split, ties to the
  lower id, sorted by id (``d2t[i] = target_id(i) - i``, ``t2d`` their mask); speculators counts the
  text's labelled tokens, verispec counts labels, which are the target's own greedy tokens unless
  ``--labels data``;
- ``embed_tokens`` is the target's input embedding and ``lm_head`` its LM head's rows of the draft
  vocabulary, both frozen (speculators' ``embed_requires_grad=False`` and its frozen ``lm_head``);
  ``fc``, the decoder layer and ``norm`` are trained, from PyTorch's default init (``norm`` at ones;
  starting it at the target's final-norm gain, ~1.8 on SmolLM2, makes the untrained drafter's
  logits sharper and its first steps worse: over 18 steps on 8.6k SmolLM2 tokens, loss of the last
  six 9.8 vs 7.6, top-4 0.17 vs 0.27);
- the layer is a Llama layer of the target's sizes with no EAGLE-3 option on by default, where
  speculators' trainer turns ``norm_before_residual`` (and for EAGLE-3 ``norm_before_fc`` and
  ``norm_output``) on: the SGLang loader verispec checked reads none of them
  (:mod:`verispec.heads.speculators_io`), so such a drafter would draft wrongly there, while vLLM
  computes either; ``--norm-before-residual on`` trains speculators' variant;
- soft labels (the default) fit the target's distribution renormalised over the draft vocabulary,
  as speculators' ``kl_div`` does (cross-entropy here: the same gradients); a position whose label
  lies outside the draft vocabulary is left out of the loss with every kind of label (the drafter
  cannot propose it; speculators still fits the renormalised distribution there). Accuracy counts
  such positions as misses.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig
from verispec.heads.eagle3 import Eagle3Config, Eagle3Drafter, rope_tables, ttt_masks
from verispec.heads.identity import embedding_table
from verispec.heads.io import WEIGHTS_FILE, file_sha256
from verispec.heads.speculators_io import load_eagle3
from verispec.heads.speculators_save import save_speculators
from verispec.heads.vocab import VocabHead, float_lm_head_weight
from verispec.training.config import TrainSettings
from verispec.training.eagle import length_batches, pair_positions
from verispec.training.loop import fit
from verispec.training.tokens import TokenData, accuracy_rows

DEFAULT_DRAFT_VOCAB = 32000
"""speculators' default ``draft_vocab_size`` (and the EAGLE-3 authors' for Llama 3)."""


# ----------------------------------------------------------------------------- the drafter's shape


def aux_layers_for(num_layers: int, ids: Sequence[int] | None = None) -> tuple[int, ...]:
    """The target layers an EAGLE-3 drafter reads: ``ids`` (checked), or speculators' default
    ``[2, L // 2, L - 3]``, refused where it does not give distinct layers (targets under 8 layers)."""
    chosen = tuple(int(i) for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(set(chosen)) == len(chosen) and all(0 <= i < num_layers for i in chosen):
        return chosen
    if ids:
        raise VerispecError(
            f"--aux-layers must be distinct decoder layers 0..{num_layers - 1} of the target, got "
            f"{list(chosen)} (id i is the input of layer i; the last layer's output is not tapped)"
        )
    raise VerispecError(
        f"the default aux layers [2, L/2, L-3] are {list(chosen)} for a target of {num_layers} layers, "
        "not distinct layers: pass --aux-layers"
    )


def select_draft_vocab(data: TokenData, size: int, vocab_size: int) -> tuple[torch.Tensor | None, float]:
    """The draft vocabulary (target ids, ascending) of ``size`` tokens, None for the whole target
    vocabulary (``size`` 0 or at least ``vocab_size``), and the share of training labels it covers.

    speculators' rule: most frequent first, ties to the lower id (so tokens never seen fill it up
    in id order), then sorted, as ``d2t`` must be for ``draft id + d2t`` to be increasing."""
    counts = data.label_counts(vocab_size)[:vocab_size]
    if size <= 0 or size >= vocab_size:
        return None, 1.0
    order = torch.sort(-counts, stable=True).indices
    chosen = order[:size].sort().values
    return chosen, float(counts[chosen].sum() / counts.sum().clamp_min(1))


def eagle3_config(
    target: Any,
    aux_layers: Sequence[int],
    draft_vocab_size: int,
    intermediate_size: int | None = None,
    norm_before_residual: bool = False,
) -> Eagle3Config:
    """A Llama layer of the target's sizes (``intermediate_size`` may narrow its MLP) and its rotary
    settings; ``norm_before_residual`` off unless asked (module docstring)."""
    base = EagleConfig.for_target(target, intermediate_size)
    cfg = target.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return Eagle3Config(
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads,
        head_dim=base.head_dim,
        rms_norm_eps=base.rms_norm_eps,
        rope_theta=base.rope_theta,
        draft_vocab_size=draft_vocab_size,
        target_vocab_size=int(target.vocab_size),
        norm_before_residual=norm_before_residual,
        aux_layer_ids=tuple(aux_layers),
        rope_scaling=dict(rope) if isinstance(rope, dict) else {},
    )


def new_drafter(target: Any, config: Eagle3Config, vocab_ids: torch.Tensor | None) -> Eagle3Drafter:
    """A drafter started from the target: its embeddings and its LM head's rows of the draft
    vocabulary (both frozen, module docstring); the rest PyTorch's default init."""
    size = int(vocab_ids.numel()) if vocab_ids is not None else int(target.vocab_size)
    if size != config.draft_vocab_size:
        raise ValueError(f"a draft vocabulary of {size} tokens for a config of {config.draft_vocab_size}")
    drafter = Eagle3Drafter(config)
    embeddings = embedding_table(target.model.get_input_embeddings())
    if tuple(embeddings.shape) != tuple(drafter.embed_tokens.weight.shape):
        raise VerispecError(
            f"{target.name}'s input embeddings are {tuple(embeddings.shape)}, its vocabulary and hidden "
            f"size say {tuple(drafter.embed_tokens.weight.shape)}"
        )
    head = float_lm_head_weight(target)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embeddings)
        drafter.lm_head.weight.copy_(head[vocab_ids] if vocab_ids is not None else head)
        if vocab_ids is not None:
            drafter.d2t.copy_(vocab_ids - torch.arange(vocab_ids.numel()))
            drafter.t2d.zero_()
            drafter.t2d[vocab_ids] = True
    return frozen_target_parts(drafter)


def frozen_target_parts(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """``embed_tokens`` and ``lm_head`` out of training, as speculators keeps them."""
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.lm_head.weight.requires_grad_(False)
    return drafter


def load_for_target(folder: str | Path, target: Any) -> Eagle3Drafter:
    """A saved EAGLE-3 drafter (speculators or research format) checked against ``target``: its
    vocabulary, hidden size and recorded aux layers (to start training from, or to measure)."""
    embeddings = embedding_table(target.model.get_input_embeddings())
    drafter, _ = load_eagle3(folder, target_embeddings=embeddings)
    cfg = drafter.config
    if cfg.target_vocab_size != int(target.vocab_size) or cfg.aux_width != int(target.hidden_size):
        raise VerispecError(
            f"{folder} drafts for a target of {cfg.target_vocab_size} tokens and hidden size "
            f"{cfg.aux_width}; {target.name} has {target.vocab_size} and {target.hidden_size}"
        )
    if not cfg.aux_layer_ids:
        raise VerispecError(f"{folder} does not say which target layers it reads (aux layer ids)")
    return frozen_target_parts(drafter)


def draft_vocab_of(drafter: Eagle3Drafter) -> torch.Tensor | None:
    """The drafter's draft vocabulary as target ids in draft order (None: the whole vocabulary)."""
    if not drafter.uses_draft_vocab:
        return None
    return drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))


def verifier_architectures(target: Any) -> tuple[str, ...]:
    """The target's ``architectures`` for speculators' verifier record; a GGUF target's config has
    none, so its model type's causal-LM class stands in."""
    archs = getattr(target.config, "architectures", None)
    if archs:
        return tuple(str(a) for a in archs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(getattr(target.config, "model_type", "")))
    return (name,) if name else ()


# ----------------------------------------------------------------------------- batches and passes


@dataclass
class Eagle3Batch:
    aux: torch.Tensor  # [B, L, F H] g_j: the raw inputs of the aux layers at token j
    input_ids: torch.Tensor  # [B, L] x_{j+1}
    next_hidden: torch.Tensor  # [B, L, H] the target's last state after x_{j+1} (its view of x_{j+2})
    label: torch.Tensor  # [B, L] label of x_{j+2}
    greedy: torch.Tensor  # [B, L] the target's argmax for x_{j+2}
    valid: torch.Tensor  # [B, L]


def eagle3_batch(data: TokenData, seqs: list[tuple[int, int]], layers: tuple[int, ...]) -> Eagle3Batch:
    """Pairs ``(g_j, x_{j+1})`` of each sequence, padded to the longest; padding is never valid and,
    after every real position, never attended to by one (as :func:`~verispec.training.eagle.eagle_batch`)."""
    index, nxt, valid = pair_positions(seqs, data.total)
    return Eagle3Batch(
        aux=data.aux(index, layers),
        input_ids=data.tokens[nxt],
        next_hidden=data.features(nxt),
        label=data.label[nxt],
        greedy=data.greedy[nxt],
        valid=valid & data.ok[nxt],
    )


def ttt_outputs(
    drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The layer outputs ``[B, L, H]`` of each of ``steps`` passes of :meth:`Eagle3Drafter.forward`
    (its arithmetic, step for step), before the LM head: training and evaluation score only the rows
    that count, and the LM head over every padded or unlabelled row would be most of the cost."""
    cfg = drafter.config
    positions = torch.arange(1, input_ids.shape[1] + 1, device=input_ids.device)
    hidden = drafter.fuse(aux)
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs = []
    for s, mask in enumerate(ttt_masks(input_ids.shape[1], steps)):
        ids = _shifted(input_ids, s, 0)
        cos, sin = (r.to(hidden.dtype) for r in rope_tables(positions + s, drafter.inv_freq))
        x, keys, values = drafter.layer_pass(drafter.embed(ids), hidden, cos, sin, mask.to(ids.device), past)
        past.append((keys, values))
        hidden = drafter.norm(x) if cfg.norm_output else x
        outs.append(hidden)
    return outs


def _shifted(x: torch.Tensor, s: int, fill: float | bool) -> torch.Tensor:
    """``x [B, L, ...]`` moved ``s`` places left along L, ``fill`` coming in: pass s's view of a
    per-position tensor (its row j is about token j+2+s)."""
    if s == 0:
        return x
    pad = x.new_full((x.shape[0], min(s, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, s:], pad], dim=1)


# ----------------------------------------------------------------------------- loss and accuracy


def eagle3_loss(
    drafter: Eagle3Drafter,
    vocab: VocabHead,
    batch: Eagle3Batch,
    to_draft: torch.Tensor,
    settings: TrainSettings,
) -> torch.Tensor:
    """Cross-entropy of every training-time-test pass, pass s weighted ``depth_decay ** s``, over the
    positions whose label is in the draft vocabulary (module docstring)."""
    draft_label = to_draft[batch.label]
    counted = batch.valid & (draft_label >= 0)
    teacher, row_of = None, None
    if settings.labels == "soft":  # every pass reads the same targets' rows, shifted: one LM head for all
        with torch.no_grad():
            teacher = vocab(batch.next_hidden[counted]).float().softmax(dim=-1)
        row_of = torch.full(counted.shape, -1, dtype=torch.long)
        row_of[counted] = torch.arange(int(counted.sum()))
    terms = []
    outs = ttt_outputs(drafter, batch.aux, batch.input_ids, settings.unroll)
    for s, out in enumerate(outs):
        rows = _shifted(counted, s, False)
        if not rows.any():
            continue
        logits = drafter.logits(out[rows]).float()
        want = (
            teacher[_shifted(row_of, s, -1)[rows]]
            if teacher is not None
            else _shifted(draft_label, s, -1)[rows]
        )
        terms.append(settings.depth_decay**s * F.cross_entropy(logits, want))
    return torch.stack(terms).sum() if terms else outs[0].sum() * 0.0  # nothing counted: no step


@torch.no_grad()
def evaluate_eagle3(
    drafter: Eagle3Drafter,
    data: TokenData,
    width: int,
    depths: int,
    batch_tokens: int = 4096,
    split: str = "heldout",
) -> list[dict[str, float]]:
    """Accuracy at draft depth 1..``depths`` (beyond the trained passes too): top-1 and top-``width``
    against the target's greedy token, given the true tokens before it (speculators' teacher forcing;
    ``split="train"``: on a sample of the training text). The same table as
    :func:`~verispec.training.eagle.evaluate_eagle`."""
    hits = torch.zeros(depths, 2)
    count = torch.zeros(depths)
    k = min(width, drafter.config.draft_vocab_size)
    for seqs in length_batches(data.eval_sequences(split), batch_tokens, None):
        batch = eagle3_batch(data, seqs, drafter.config.aux_layer_ids)
        for s, out in enumerate(ttt_outputs(drafter, batch.aux, batch.input_ids, depths)):
            rows = _shifted(batch.valid, s, False)
            top = drafter.to_target_ids(drafter.logits(out[rows]).topk(k, dim=-1).indices)
            want = _shifted(batch.greedy, s, -1)[rows]
            hits[s, 0] += (top[:, 0] == want).sum()
            hits[s, 1] += (top == want[:, None]).any(-1).sum()
            count[s] += rows.sum()
    return accuracy_rows(hits, count, width)


# ----------------------------------------------------------------------------- training and saving


def train_eagle3(
    target: Any,
    data: TokenData,
    settings: TrainSettings,
    *,
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """Fit an EAGLE-3 drafter reading ``settings.aux_layers`` (``data`` must hold their raw taps);
    returns it (eval mode, ready for :func:`~verispec.heads.speculators_save.save_speculators`) and a
    report with held-out accuracy per depth. With ``init_from`` it goes on from a saved EAGLE-3
    drafter, whose sizes and draft vocabulary it keeps."""
    torch.manual_seed(settings.seed)
    layers = settings.aux_layers or aux_layers_for(int(target.config.num_hidden_layers))
    started_from: str | None = None
    if settings.init_from:
        drafter = load_for_target(settings.init_from, target)
        if settings.aux_layers and drafter.config.aux_layer_ids != settings.aux_layers:
            raise VerispecError(
                f"--init-from {settings.init_from} reads layers {list(drafter.config.aux_layer_ids)}, "
                f"not {list(settings.aux_layers)}"
            )
        layers, vocab_ids = drafter.config.aux_layer_ids, draft_vocab_of(drafter)
        weights = Path(settings.init_from) / WEIGHTS_FILE
        started_from = file_sha256(weights) if weights.is_file() else None
    else:
        vocab_ids, _ = select_draft_vocab(data, settings.draft_vocab, target.vocab_size)
        size = int(vocab_ids.numel()) if vocab_ids is not None else int(target.vocab_size)
        drafter = new_drafter(
            target,
            eagle3_config(target, layers, size, settings.intermediate_size, settings.norm_before_residual),
            vocab_ids,
        )
    counts = data.label_counts(target.vocab_size)
    covered = counts[vocab_ids].sum() if vocab_ids is not None else counts.sum()
    vocab = VocabHead(target, vocab_ids, for_training=True)
    to_draft = vocab.target_to_draft(target.vocab_size)
    train_seqs = data.sequences(heldout=False)
    stats = fit(
        drafter,
        lambda epoch: length_batches(
            train_seqs, settings.batch_tokens, np.random.default_rng(settings.seed * 1000 + epoch)
        ),
        lambda seqs: eagle3_loss(drafter, vocab, eagle3_batch(data, seqs, layers), to_draft, settings),
        settings,
        checkpoint,
        resume=resume,
        progress=progress,
    )
    accuracy = evaluate_eagle3(drafter, data, settings.tree["width"], settings.eval_depths)
    report = {
        **stats,
        "train_positions": sum(b - a - 1 for a, b in train_seqs),
        "heldout_accuracy": accuracy,
        "aux_layer_ids": list(layers),
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "draft_vocab_label_coverage": round(float(covered / counts.sum().clamp_min(1)), 4),
        "frozen": ["embed_tokens (the target's)", "lm_head (the target's rows of the draft vocabulary)"],
        "settings": asdict(settings),
        **({"init_from_sha256": started_from} if started_from else {}),
    }
    return drafter, report


TRAINING_FILE = "training.json"
"""Beside an EAGLE-3 drafter's speculators files: how it was made and its held-out accuracy per depth
(speculators' format has no place for them; verispec's own heads keep them in ``config.json``)."""


def save_eagle3(
    drafter: Eagle3Drafter, out: Path, verifier: str, target: Any, record: dict[str, Any]
) -> None:
    """The drafter in speculators' format (float32, embeddings included: a folder that drafts on its
    own), its default proposal as deep as it was unrolled, and :data:`TRAINING_FILE`."""
    steps = int(record["settings"]["unroll"])
    save_speculators(
        drafter,
        out,
        verifier,
        verifier_architectures=verifier_architectures(target),
        speculative_tokens=steps,
    )
    (out / TRAINING_FILE).write_text(
        json.dumps({"verifier": verifier, **record}, indent=1, default=str) + "\n"
    )
