"""What the Medusa and EAGLE proposers share: a trained module that rides on the target.

Both draft token trees from the target's own hidden states through a (possibly reduced-vocabulary)
share of its LM head, take their tree shape from the heads' manifest unless the spec overrides it,
and run quantized when the target does (:func:`heads_quantization`). Keeping that here means a
third learned drafter gets the same loading rules (refusal of heads trained for another target,
tree defaults) without copying them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import torch

from verispec.errors import VerispecError
from verispec.heads.io import LoadedHeads, load_heads, resolve_heads_folder
from verispec.heads.vocab import VocabHead
from verispec.proposers.base import BatchProposer

if TYPE_CHECKING:
    from verispec.config import SpecConfig
    from verispec.models.base import CausalLM
    from verispec.penalties import RequestRules


HeadsQuantization = Literal["none", "int8", "int4"]


def heads_quantization(target: Any) -> HeadsQuantization:
    """How learned heads run beside ``target``: float when it does, else int4 where verispec's int4
    kernel runs on this CPU, else int8.

    Why int4 even beside an int8 target: a drafting pass has 1-4 rows, where a product costs its
    weight read plus a fixed overhead, and both are lower for the int4 kernel than for fbgemm's
    int8 (1.5B EAGLE drafter on a 2-core AVX2 CPU, cold caches, 4 rows: 1.17 ms per pass with its
    8k-token LM head vs 2.15 ms; docs/design.md#int4-heads). A draft only has to be good, not exact,
    and the target verifies every token at its own precision, so output is unchanged.
    """
    if getattr(target, "quantization", "none") not in ("int8", "int4", "gguf"):
        return "none"
    from verispec.models.int4 import cpu_supports_int4

    return "int4" if cpu_supports_int4() else "int8"


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension, except that a row the request's rules left all -inf
    (no drafted token allowed) stays all -inf instead of turning into NaN."""
    logp = logits.float().log_softmax(dim=-1)
    return logp.masked_fill(logp.isnan(), float("-inf"))


class HeadsProposer(BatchProposer):
    """A proposer built around ``module`` (trained heads) and the target's LM head."""

    needs_hidden = True
    drafts_trees = True
    kind: ClassVar[str]
    """The heads kind this proposer loads ("medusa", "eagle"), as in the heads' config."""

    def __init__(
        self,
        module: torch.nn.Module,
        vocab_head: VocabHead,
        *,
        nodes: int,
        width: int,
        quantize: HeadsQuantization = "none",
    ) -> None:
        """``quantize``: the heads' Linears (the vocabulary head is the target's, see
        :class:`~verispec.heads.vocab.VocabHead`); see :func:`heads_quantization`."""
        if nodes < 1 or width < 1:
            raise VerispecError(f"tree nodes and width must be >= 1, got nodes={nodes} width={width}")
        module.eval()
        if quantize != "none":
            from verispec.models.fused import fuse_projections
            from verispec.models.quant import quantize_model

            quantize_model(module, quantize)
            fuse_projections(module)
        self.vocab_head = vocab_head
        self.device = torch.device("cpu")
        """Where the heads run: the target's device (:meth:`from_loaded` moves them there)."""
        self.nodes = nodes
        self.width = min(width, vocab_head.size)
        self.description: dict[str, object] = {
            "tree_nodes": nodes,
            "tree_width": self.width,
            "draft_vocab": vocab_head.size,
            "quantization": quantize,
        }
        """What defines this proposer, for benchmark reports."""

    def max_tree_size(self, k: int) -> int:
        return self.nodes

    def constrain(self, state: Any, rules: RequestRules) -> None:
        state.rules = rules

    def under_rules(
        self,
        logits: torch.Tensor,
        rules: RequestRules,
        token_ids: Sequence[int],
        row_paths: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Draft-vocabulary ``logits [R, N]`` as a request's rules adjust the target's: each row goes
        to the target's vocabulary (-inf outside the draft's), through :meth:`RequestRules.rows` for
        the committed ``token_ids`` plus its path, and back. A row may come back all -inf: the
        grammar allows no token of the draft vocabulary there."""
        ids = self.vocab_head.vocab
        if not ids.numel():
            return rules.rows(logits, token_ids, row_paths)
        full = logits.new_full((logits.shape[0], self.vocab_head.target_size), float("-inf"))
        full[:, ids] = logits
        return rules.rows(full, token_ids, row_paths)[:, ids]

    @classmethod
    def from_loaded(cls, loaded: LoadedHeads, target: Any, spec: SpecConfig | None = None) -> Self:
        """Build from heads loaded by :func:`~verispec.heads.io.load_heads` for ``target``.

        The spec's tree settings win over the ones the heads were shipped with.
        """
        layers = getattr(loaded.module.config, "feature_layers", ())
        if layers and hasattr(target, "check_feature_layers"):
            target.check_feature_layers(layers)  # heads for this target's sizes but another depth
        quantization = heads_quantization(target)
        device = getattr(target, "device", torch.device("cpu"))  # heads run where the target's states are
        proposer = cls(
            loaded.module.to(device),
            VocabHead(target, loaded.draft_vocab, int4=quantization == "int4").to(device),
            *cls._target_parts(target),
            nodes=(spec.tree_nodes if spec is not None else None) or loaded.tree["nodes"],
            width=(spec.tree_width if spec is not None else None) or loaded.tree["width"],
            quantize=quantization,
        )
        proposer.device = device
        proposer.description["heads"] = str(loaded.path) if loaded.path is not None else None
        return proposer

    @classmethod
    def _target_parts(cls, target: Any) -> tuple[Any, ...]:
        """Extra constructor arguments taken from the target (EAGLE: its token embeddings)."""
        return ()

    @classmethod
    def build(cls, spec: SpecConfig, target: CausalLM) -> Self:
        """The registered factory: find the heads named by the spec (or shipped) and load them."""
        folder = resolve_heads_folder(spec.heads, cls.kind, target.name)
        return cls.from_loaded(load_heads(folder, target, kind=cls.kind), target, spec)

    @staticmethod
    def require_hidden(hidden: torch.Tensor | None, name: str) -> torch.Tensor:
        """The verified positions' hidden states, which the engine owes a ``needs_hidden`` proposer."""
        if hidden is None:
            raise RuntimeError(f"the {name} proposer needs the target's hidden states (needs_hidden)")
        return hidden
