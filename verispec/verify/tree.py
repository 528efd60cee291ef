"""Token-tree verification: several candidate continuations checked in one target forward.

A :class:`DraftTree` holds N draft nodes under a root (the sequence's pending token). The target
scores the root and every node in one forward, each node seeing only its ancestors (a tree
attention mask, see :func:`tree_attention_inputs`), which gives one target distribution per node.
Verification walks down from the root; at each node it tries the node's children in order:

- **greedy**: move to the child whose token is the target's argmax, if there is one;
- **deterministic candidates** (top-k of a head, no draft probabilities): sample the target's own
  token from ``p`` and move to the child holding it, if one does. Each child x is so taken with
  probability ``p(x)``, as accepting x with probability ``p(x)`` and on rejection trying the next
  sibling under ``p`` without x would; but the walk spends one draw per committed token, as plain
  decoding does, so seeded output equals plain decoding's (:mod:`verispec.verify.rejection`);
- **sampled candidates** (children drawn i.i.d. from the draft distribution ``q`` at their parent):
  accept child x with probability ``min(1, p(x) / q(x))``; on rejection replace p by the residual
  ``normalize(max(0, p - q))`` and try the next sibling (SpecInfer's multi-round speculative
  sampling).

When no child is accepted the walk ends with a token sampled from what is left of p (recovered),
and at an accepted leaf with one from the leaf's own distribution (bonus). Each rule leaves the
token emitted at every depth distributed exactly as the target's p given the accepted path, so
the output is the target's distribution however the tree was shaped (tested in
``tests/verify/test_tree.py`` by chi-square against the exact distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample


@dataclass(frozen=True)
class DraftTree:
    """N draft nodes; parents precede children and siblings are in the order they are tried."""

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64, -1 for a child of the root
    probs: torch.Tensor | None = None
    """[N, V]: the distribution each node was sampled from (its parent's draft distribution; every
    child of one parent must be an i.i.d. draw from the same row). None: deterministic candidates."""
    scores: torch.Tensor | None = None
    """[N]: the drafter's log-probability that the path to each node is accepted, non-increasing
    (best node first). With it, :meth:`prefix` of any length is the best subtree of that size, which
    is how the depth policy sizes a tree. Only for deterministic candidates (``probs`` None)."""

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.parents.shape != (n,):
            raise ValueError("DraftTree needs 1-D tokens and parents of the same length")
        if any(int(p) >= i or int(p) < -1 for i, p in enumerate(self.parents.tolist())):
            raise ValueError("every parent must come before its child (or be -1, the root)")
        if self.probs is not None and self.probs.shape[0] != n:
            raise ValueError("DraftTree.probs needs one row per node")
        if self.scores is not None:
            if self.probs is not None:
                raise ValueError("scores size a tree of deterministic candidates only (probs is None)")
            if self.scores.shape != (n,) or bool((self.scores[1:] > self.scores[:-1] + 1e-6).any()):
                raise ValueError("DraftTree.scores needs one non-increasing score per node")

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes: a valid tree, as parents come first; the best ``n`` by score.

        Cutting by a count chosen from the scores keeps verification exact only because the
        candidates are deterministic; a tree of sampled candidates (``probs``) is never cut.
        """
        if self.probs is not None:
            raise ValueError("a tree of sampled candidates cannot be cut (its siblings must stay i.i.d.)")
        n = max(0, min(n, self.size))
        scores = self.scores[:n] if self.scores is not None else None
        return DraftTree(self.tokens[:n], self.parents[:n], None, scores)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def children(self) -> list[list[int]]:
        """children[0] lists the root's children, children[i + 1] node i's."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        depth: list[int] = []
        for p in self.parents.tolist():
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth


@dataclass(frozen=True)
class TreeResult:
    tokens: list[int]
    """The accepted path's tokens, then one token of the target's own."""
    path: list[int]
    """Indices of the accepted nodes, root to leaf."""
    num_drafted: int

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def tree_attention_inputs(tree: DraftTree, start: int) -> tuple[list[int], torch.Tensor]:
    """Positions and the attention mask for one forward over ``[root, node_0 .. node_{N-1}]`` whose
    root sits at position ``start``: each node attends to itself and its ancestors only."""
    n = tree.size + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(tree.parents.tolist()):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return [start] + [start + d for d in tree.depths()], mask


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,  # [N + 1, V]: row 0 after the root, row i + 1 after node i
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> TreeResult:
    """Walk the tree from the root (module docstring); greedy at temperature 0, exact otherwise."""
    if target_logits.shape[0] != tree.size + 1:
        raise ValueError(f"need {tree.size + 1} rows of target logits for {tree.size} nodes")
    children = tree.children()
    tokens = tree.tokens.tolist()
    path: list[int] = []
    row = 0  # the root
    while True:
        if sampling.greedy or tree.probs is None:  # the target's own token: its argmax, or a sample
            if sampling.greedy:
                own = int(target_logits[row].argmax())
            else:
                own = int(sample(logits_to_probs(target_logits[row], sampling), generator))
            nxt = next((c for c in children[row] if tokens[c] == own), None)
            if nxt is None:  # no child holds it (or a leaf): it is the recovered or bonus token
                return TreeResult(tokens=[tokens[i] for i in path] + [own], path=path, num_drafted=tree.size)
        else:
            p = logits_to_probs(target_logits[row], sampling).double()  # [V]
            nxt, p = _try_children(children[row], tokens, tree.probs, p, generator)
            if nxt is None:
                last = int(sample(p.float(), generator))
                return TreeResult(tokens=[tokens[i] for i in path] + [last], path=path, num_drafted=tree.size)
        path.append(nxt)
        row = nxt + 1


def _try_children(
    candidates: list[int],
    tokens: list[int],
    probs: torch.Tensor,  # [N, V]: each node's draft distribution (sampled candidates)
    p: torch.Tensor,  # [V] float64, the target's distribution here
    generator: torch.Generator | None,
) -> tuple[int | None, torch.Tensor]:
    """The first accepted sampled candidate (or None) and the distribution left for the recovered
    token (SpecInfer's multi-round rule)."""
    for c in candidates:
        before = p
        x = tokens[c]
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        q = probs[c].double()
        if u * float(q[x]) < float(p[x]):
            return c, p
        p = (p - q).clamp_min(0.0)
        mass = float(p.sum())
        if mass <= 0:  # p was ~q: rejecting had probability ~0, keep p as it was
            return None, before
        p = p / mass
    return None, p
