"""Token-tree verification: several candidate continuations checked in one target forward.

A :class:`~verispec.types.Draft` holds N draft nodes under a root (the sequence's pending token).
The target scores the root and every node in one forward, each node seeing only its ancestors (a
tree attention mask, see :func:`tree_attention_inputs`), which gives one target distribution per
node.
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

On a chain (one child per node) the walk is the chain rule of :mod:`verispec.verify.rejection`:
greedy and deterministic chains give the same tokens from the same random stream (tested), and a
sampled chain accepts and recovers by the same rule but draws its uniforms one by one. The engine's
verifier (:mod:`verispec.verify.verifier`) hands chains to the chain kernel, which draws them all
at once, so a chain's results stay those of :func:`~verispec.verify.rejection.rejection_sample`.
"""

from __future__ import annotations

import torch

from verispec.config import SamplingConfig
from verispec.sampling import logits_to_probs, sample
from verispec.types import Draft, VerifyResult


def tree_attention_inputs(draft: Draft, start: int) -> tuple[list[int], torch.Tensor | None]:
    """Positions and the attention mask for one forward over ``[root, node_0 .. node_{N-1}]`` whose
    root sits at position ``start``: each node attends to itself and its ancestors only. A chain
    gets no mask (None): causal attention over consecutive positions is its tree mask, and the
    model's causal path is the one plain decoding takes."""
    if draft.is_chain:
        return list(range(start, start + draft.size + 1)), None
    n = draft.size + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(draft.parents.tolist()):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return [start] + [start + d for d in draft.depths()], mask


def verify_tree(
    draft: Draft,
    target_logits: torch.Tensor,  # [N + 1, V]: row 0 after the root, row i + 1 after node i
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Walk the draft from the root (module docstring); greedy at temperature 0, exact otherwise."""
    if target_logits.shape[0] != draft.size + 1:
        raise ValueError(f"need {draft.size + 1} rows of target logits for {draft.size} nodes")
    children = draft.children()
    tokens = draft.tokens.tolist()
    path: list[int] = []
    row = 0  # the root
    while True:
        if sampling.greedy or draft.probs is None:  # the target's own token: its argmax, or a sample
            if sampling.greedy:
                last = int(target_logits[row].argmax())
            else:
                last = int(sample(logits_to_probs(target_logits[row], sampling), generator))
            nxt = next((c for c in children[row] if tokens[c] == last), None)
        else:
            p = logits_to_probs(target_logits[row], sampling).double()  # [V]
            nxt, p = _try_children(children[row], tokens, draft.probs, p, generator)
            if nxt is None:
                last = int(sample(p.float(), generator))
        if nxt is None:  # no child accepted (or a leaf): ``last`` is the recovered or bonus token
            return VerifyResult([*(tokens[i] for i in path), last], len(path), draft.size, tuple(path))
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
        u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
        q = probs[c].double()
        if u * float(q[x]) < float(p[x]):
            return c, p
        p = (p - q).clamp_min(0.0)
        mass = float(p.sum())
        if mass <= 0:  # p was ~q: rejecting had probability ~0, keep p as it was
            return None, before
        p = p / mass
    return None, p
