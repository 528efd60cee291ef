"""The typed values that flow through one decoding step.

A proposer returns a :class:`Draft` (a chain or a tree of draft tokens: a chain is the tree whose
parents are i - 1); the verifier turns the target's logits and the draft into a
:class:`VerifyResult`; the engine commits it and emits :class:`TokenEvent` values, one per
committed token, which the CLI, the Python API and the server all consume. A finished request is a
:class:`Generation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from verispec.metrics import SpecStats

FinishReason = Literal["stop", "length", "eos"]
"""Why generation ended: a stop string matched, ``max_new_tokens`` was reached, or the model's EOS."""


@dataclass(frozen=True)
class Draft:
    """The draft tokens a proposer suggests for one sequence in one step: N nodes under a root.

    The root is the sequence's pending token (the last committed one, not yet fed to the target);
    ``parents[i]`` is node i's parent, -1 for a child of the root. A chain of k draft tokens is the
    tree whose parents are ``i - 1`` (:meth:`chain`); several candidates per position (Medusa and
    EAGLE trees) are siblings. Parents come before their children, and siblings are in the order
    verification tries them. One type for both, so the engine never asks which one it holds: the
    verifier, the penalties and the KV rollback all work on paths through the tree.

    ``probs`` holds the distribution each node was sampled from (its parent's draft distribution;
    every child of one parent must be an i.i.d. draw from the same row). ``None`` means a
    deterministic proposal (prompt lookup, greedy drafts, the heads' top tokens), which the verifier
    treats as one-hot on the proposed token. Exact rejection sampling needs the real distribution
    whenever the proposer sampled.
    """

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64, -1 for a child of the root
    probs: torch.Tensor | None = None  # [N, V] float32, rows sum to 1
    scores: torch.Tensor | None = None
    """[N]: the drafter's log-probability that the path to each node is accepted, non-increasing
    (best node first). With it, :meth:`prefix` of any length is the best subtree of that size, which
    is how the depth policy sizes a tree. Only for deterministic candidates (``probs`` None)."""
    is_chain: bool = field(init=False, compare=False)
    """Whether every node's parent is the node before it (a chain of draft tokens)."""

    def __post_init__(self) -> None:
        n = self.tokens.shape[0] if self.tokens.dim() == 1 else -1
        if n < 0 or self.parents.shape != (n,):
            raise ValueError(
                f"a draft needs 1-D tokens and parents of the same length, got "
                f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}"
            )
        index = torch.arange(n, dtype=self.parents.dtype)
        if bool(((self.parents < -1) | (self.parents >= index)).any()):
            raise ValueError("every parent must come before its child (or be -1, the root)")
        if self.probs is not None and self.probs.shape[0] != n:
            raise ValueError("a draft's probs need one row per node")
        if self.scores is not None:
            if self.probs is not None:
                raise ValueError("scores size a tree of deterministic candidates only (probs is None)")
            if self.scores.shape != (n,) or bool((self.scores[1:] > self.scores[:-1] + 1e-6).any()):
                raise ValueError("a draft's scores need one non-increasing score per node")
        object.__setattr__(self, "is_chain", bool((self.parents == index - 1).all()))

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: torch.Tensor | None = None) -> Draft:
        """k draft tokens, each after the one before: ``tokens [k]``, ``probs [k, V]`` or None."""
        return cls(tokens, torch.arange(tokens.shape[0], dtype=torch.long) - 1, probs)

    @classmethod
    def empty(cls) -> Draft:
        """No draft: the step decodes plainly (k = 0)."""
        return cls.chain(torch.empty(0, dtype=torch.long))

    @property
    def size(self) -> int:
        """Nodes in the draft: the verify rows it costs beyond the pending token's."""
        return int(self.tokens.shape[0])

    @property
    def expected(self) -> float:
        """Accepted tokens expected of a scored tree, if its scores are right: the sum of its nodes'
        path probabilities (0 without scores or nodes)."""
        return float(self.scores.exp().sum()) if self.scores is not None else 0.0

    @property
    def depth(self) -> int:
        """Most tokens the draft can add: a chain's length, a tree's deepest path."""
        return self.size if self.is_chain else max(self.depths(), default=0)

    def depths(self) -> list[int]:
        """Depth of each node (children of the root have depth 1)."""
        depth: list[int] = []
        for p in self.parents.tolist():
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def children(self) -> list[list[int]]:
        """children[0] lists the root's children, children[i + 1] node i's, in the order tried."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def row_paths(self) -> list[list[int]]:
        """The draft tokens before each verify row: row 0 is the root's (none), row i + 1 comes
        after the path to node i, node i included. A chain's row j comes after tokens 0..j-1."""
        paths: list[list[int]] = [[]]
        for token, parent in zip(self.tokens.tolist(), self.parents.tolist(), strict=True):
            paths.append([*paths[parent + 1], token])
        return paths

    def prefix(self, n: int) -> Draft:
        """The first ``n`` nodes: a valid draft, as parents come first; the best ``n`` by score.

        Cutting by a count chosen from the scores keeps verification exact only because the
        candidates are deterministic; a tree of sampled candidates (``probs``) is never cut.
        """
        if self.probs is not None:
            raise ValueError("a tree of sampled candidates cannot be cut (its siblings must stay i.i.d.)")
        n = max(0, min(n, self.size))
        scores = self.scores[:n] if self.scores is not None else None
        return Draft(self.tokens[:n], self.parents[:n], None, scores)


@dataclass(frozen=True)
class VerifyResult:
    """What the verifier decided for one sequence.

    ``tokens`` are the tokens to commit: the ``num_accepted`` accepted draft tokens followed by
    exactly one token of the target's own (recovered at the first rejection, or bonus when the walk
    ended at an accepted leaf; for a chain, when every draft token was accepted). ``path`` is the
    accepted nodes' indices, root to leaf; a chain's is ``0 .. num_accepted - 1`` (the default).
    """

    tokens: list[int]
    num_accepted: int
    num_drafted: int
    path: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.path and self.num_accepted:  # a chain's: its first num_accepted nodes
            object.__setattr__(self, "path", tuple(range(self.num_accepted)))
        elif len(self.path) != self.num_accepted:
            raise ValueError(f"an accepted path of {len(self.path)} nodes for {self.num_accepted} accepted")

    @property
    def bonus(self) -> bool:
        """True when every draft token was accepted (a chain) and the last token is the target's bonus."""
        return self.num_accepted == self.num_drafted

    @property
    def kept_rows(self) -> list[int]:
        """The verify rows (0: the pending token's, i + 1: node i's) whose keys and values stay in
        the KV cache, in order: the pending token's and the accepted path's."""
        return [0, *(i + 1 for i in self.path)]


@dataclass(frozen=True)
class TokenEvent:
    """One committed token, as streamed to callers.

    ``text`` is the text this token adds to the output (it can be empty while a multi-byte
    character is incomplete). ``from_draft`` is True when the token was proposed by the proposer and
    accepted by the verifier; False for the target's own recovered, bonus or plain tokens.
    """

    token_id: int
    text: str
    from_draft: bool
    logprob: float | None
    """The token's log-probability under the target's raw distribution (its logits before
    temperature, top-k and top-p), when the request asked for logprobs; else None."""
    step: int
    finish_reason: FinishReason | None = None
    stats: SpecStats | None = None
    """Set on the last event only: the statistics of the whole generation."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The request's ``logprobs`` most likely tokens at this position, as (token id, log-probability)
    under the same distribution as ``logprob``, most likely first."""


@dataclass
class Generation:
    """A finished generation: the new tokens, their text, why it stopped and its statistics."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: SpecStats
    prompt_token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None] | None = None
    """With ``prompt_logprobs``: per prompt token, its log-probability and the most likely tokens
    there (as ``TokenEvent.logprob`` / ``top_logprobs``); None for the first token."""
