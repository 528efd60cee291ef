"""How to fit heads: :class:`TrainSettings`, the choices it validates, and the default precision.

The data a run trains on is :class:`~verispec.training.data.DataSpec`'s business; these settings say
what is fitted to it (kind and sizes, labels, schedule, precision) and are saved with the heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.errors import VerispecError
from verispec.heads.io import DEFAULT_TREE, KINDS

PRECISIONS = ("fp32", "bf16")
"""Matrix products in training. bf16 (autocast) takes 2.3x less time per product on a CPU with
AVX512-BF16 (an 8192 x 1536 LM head over 3000 rows: 432 -> 187 ms here, 2 threads) and makes an
EAGLE step over 1000 positions 1.8x faster; where the CPU lacks native bfloat16 it is emulated and
slower, so ``auto`` picks it only where oneDNN reports support."""
LABELS = ("soft", "target", "data")
"""soft: the target's distribution over the draft vocabulary (its LM head on the stored hidden state
whose output the label is); target: its argmax; data: the text's own next token."""
TRAIN_KINDS = (*KINDS, "eagle3")
"""What ``verispec train`` fits: verispec's own heads (:data:`~verispec.heads.io.KINDS`, saved in its
format) and ``eagle3``, an EAGLE-3 drafter saved in speculators' format
(:mod:`verispec.training.eagle3`)."""
EVAL_SPLITS = ("heldout", "train")
"""The splits :meth:`TokenData.eval_sequences` measures heads on: held-out text, or a same-size
sample of the training text (the gap between them shows memorisation)."""


@dataclass(frozen=True)
class TrainSettings:
    """How to fit heads (the data is :class:`~verispec.training.data.DataSpec`)."""

    kind: str
    num_heads: int = 4
    """Medusa: K heads (tree depth up to K)."""
    intermediate_size: int | None = None
    """EAGLE: MLP width of the layer (None: the target's)."""
    unroll: int = 3
    """EAGLE: passes of training-time test (draft depths trained on the drafter's own features)."""
    aux_layers: tuple[int, ...] = ()
    """EAGLE-3: target layers whose raw inputs the drafter concatenates, in its ``fc``'s order
    (vLLM's and speculators' ids: i is the input of decoder layer i)."""
    norm_before_residual: bool = False
    """EAGLE-3: the residual around the layer's attention is ``hidden_norm(h)`` rather than ``h``.
    Off (the EAGLE authors' arithmetic) runs alike in vLLM and SGLang, whose EAGLE-3 layer reads no
    such option; speculators' trainer turns it on."""
    draft_vocab: int = 8192
    """Most frequent label tokens the heads draft over (0: the whole vocabulary)."""
    eagle_init: str = "identity"
    """EAGLE: 'identity' (start as the feature passed through; :meth:`EagleDrafter.init_identity`)
    or 'random' (PyTorch's default init, which earlier shipped heads used)."""
    init_from: str | None = None
    """Heads folder to start from (same kind, target and sizes), e.g. to go on training shipped
    heads on a larger cache; replaces ``eagle_init``. The draft vocabulary is chosen afresh."""
    labels: str = "soft"
    """See :data:`LABELS`: 'soft' and 'target' distil the target itself, 'data' learns the text."""
    epochs: int = 2
    batch_tokens: int = 2048
    lr: float = 1e-3
    feature_weight: float = 0.1
    """EAGLE: weight of the smooth-L1 loss between predicted and true next features."""
    depth_decay: float = 0.8
    """Loss weight of tree depth d is depth_decay ** (d - 1)."""
    seed: int = 0
    tree_nodes: int | None = None
    tree_width: int | None = None
    precision: str = "fp32"
    """See :data:`PRECISIONS`: 'bf16' runs the forward and backward under bfloat16 autocast (weights,
    optimizer state and the loss stay float32)."""

    def __post_init__(self) -> None:
        if self.kind not in TRAIN_KINDS:
            raise VerispecError(f"unknown heads kind {self.kind!r}; choose one of {', '.join(TRAIN_KINDS)}")
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        if self.eagle_init not in ("identity", "random"):
            raise VerispecError(f"--eagle-init must be identity or random, got {self.eagle_init!r}")
        if self.precision not in PRECISIONS:
            raise VerispecError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.labels not in LABELS:
            raise VerispecError(f"--labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        for name, low in (("num_heads", 1), ("unroll", 1), ("epochs", 1), ("batch_tokens", 16)):
            if getattr(self, name) < low:
                raise VerispecError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.draft_vocab < 0 or not self.lr > 0:
            raise VerispecError("draft_vocab must be >= 0 and lr > 0")

    @property
    def eval_depths(self) -> int:
        """EAGLE depths measured after training and by ``--eval-only``: at least 5, beyond ``unroll``
        too, because the drafter runs deeper at inference than it was unrolled in training."""
        return max(self.unroll, 5)

    @property
    def tree(self) -> dict[str, int]:
        default = DEFAULT_TREE.get(self.kind, DEFAULT_TREE["eagle"])  # eagle3 drafts trees as eagle
        return {"nodes": self.tree_nodes or default["nodes"], "width": self.tree_width or default["width"]}


def default_precision() -> str:
    """bf16 where oneDNN has native bfloat16 kernels (AVX512-BF16 or AMX), fp32 elsewhere."""
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
