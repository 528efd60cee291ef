"""The one proposer protocol and the registry of proposers by name.

A proposer suggests draft tokens; it never decides how many (that is the depth policy's job) and
never looks at the target's verdict beyond being told what was committed. Shared resources (a draft
model's weights) live on the proposer; everything that belongs to one sequence (a KV cache, an
n-gram index) lives in an opaque per-sequence state object that the engine keeps beside the
sequence. That split lets a batch of sequences share one proposer, and :meth:`Proposer.propose_batch`
draft for many sequences in one forward pass.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from verispec.types import Draft

if TYPE_CHECKING:
    import torch

    from verispec.config import SamplingConfig, SpecConfig
    from verispec.models.base import CausalLM
    from verispec.models.kv import KVBuffer
    from verispec.penalties import RequestRules


class Proposer(ABC):
    """Suggests draft tokens for sequences; per-sequence state is returned by :meth:`new_state`."""

    name: ClassVar[str]
    needs_hidden: ClassVar[bool] = False
    """True for proposers that draft from the target's hidden states (Medusa, EAGLE): the engine
    then hands them the target's last-layer hidden states of every committed position."""
    feature_layers: tuple[int, ...] = ()
    """Decoder layers whose normed inputs a ``needs_hidden`` proposer also wants (EAGLE-3's low and
    middle layers): they follow the last-layer state in each hidden row, ``[n, (1 + F) H]``."""
    raw_features: bool = False
    """Those layers' inputs before their norm instead (the residual stream): what drafters in the
    ecosystem's EAGLE-3 format read (:mod:`verispec.heads.eagle3`)."""
    drafts_trees: ClassVar[bool] = False
    """True for proposers whose trees carry scores (Medusa, EAGLE): the engine asks them for their
    full depth and the depth policy then keeps the best prefix of each tree (its node budget)."""

    @abstractmethod
    def new_state(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Any:
        """Start a sequence with this prompt; the returned object is passed back on every call."""

    @abstractmethod
    def propose(self, state: Any, token_ids: Sequence[int], k: int) -> Draft:
        """Draft up to ``k`` tokens to follow ``token_ids`` (every committed token, prompt included).

        May return fewer than k tokens (even none) when it has nothing good to offer. A tree
        (several candidates per position) may be at most k deep.
        """

    def constrain(self, state: Any, rules: RequestRules) -> None:
        """Draft this sequence with its request's penalties, logit bias and grammar (``rules``, whose
        matcher follows the committed output), so that drafts agree with the adjusted target more
        often. Verification is exact either way (it judges the target's adjusted rows against
        whatever the proposer drafted from); the default ignores them."""
        return None

    def set_scope(self, state: Any, scope: str | None) -> None:  # noqa: B027 - optional hook
        """The sequence's cache scope (:attr:`verispec.engine.state.Request.cache_scope`), told once
        after :meth:`new_state`: a proposer that keeps material across requests (earlier outputs)
        drafts from, and adds to, only that scope's; None: this sequence's own context only."""

    def max_tree_size(self, k: int) -> int:
        """The most nodes a draft ``k`` deep may have (a chain: k)."""
        return k

    def backlog(self, state: Any, token_ids: Sequence[int]) -> int:
        """Committed tokens the proposer must process before it can draft (a draft model that sat out
        steps catches up on them in one forward); the depth policy prices them. 0 by default."""
        return 0

    def propose_batch(
        self,
        states: Sequence[Any],
        token_ids: Sequence[Sequence[int]],
        ks: Sequence[int],
        *,
        min_logp: float = -math.inf,
    ) -> list[Draft]:
        """Draft for several sequences at once (a draft model batches its forwards); one by one here.

        ``min_logp``: for scored trees (:attr:`drafts_trees`), the path log-probability below which
        the depth policy will keep no node this step; a proposer may stop expanding there."""
        return [self.propose(s, t, k) for s, t, k in zip(states, token_ids, ks, strict=True)]

    @abstractmethod
    def update(
        self, state: Any, token_ids: Sequence[int], num_accepted: int, hidden: torch.Tensor | None = None
    ) -> None:
        """Tell the proposer what was committed after verification.

        ``token_ids`` is the whole committed sequence after this step; ``num_accepted`` is how many of
        the last draft's tokens the verifier kept (the token after them is the target's own). For a
        proposer that :attr:`needs_hidden`, ``hidden`` is ``[num_accepted + 1, H]``: the target's
        hidden states at the step's pending token and each accepted draft token, i.e. the states
        whose LM-head outputs gave the step's committed tokens.
        """

    def prefill(self, state: Any, hidden: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """For proposers that :attr:`needs_hidden`: the target's hidden states ``[n, H]`` of the
        next n prompt positions, as the engine prefills them (all prompt tokens but the last)."""

    def prefill_tokens(  # noqa: B027 - optional hook
        self, states: Sequence[Any], rows: Sequence[Sequence[int]]
    ) -> None:
        """The engine's prefill chunks (prompt tokens), as it feeds them to the target, for the
        sequences whose draft the depth policy expects to start
        (:meth:`~verispec.engine.drafting.Drafting.feeds_draft`). A proposer with a model of its own
        (a draft model) feeds them too, so its first proposal has only the last prompt token to
        catch up on; the other sequences catch up later, if ever, in one pass priced as a backlog."""

    def prefix_kv(self, state: Any) -> KVBuffer | None:
        """The proposer's own keys and values of the sequence's committed tokens (a draft model's
        cache, an EAGLE drafter's pairs), where the prefix cache may store them and hand them to a
        later request that starts the same way, exactly: only where a position's keys and values are
        the same bits however the forwards that computed it were grouped. The engine fills it after
        handing a proposer that :attr:`needs_hidden` the reused positions' rows (:meth:`prefill`).
        None (the default): nothing of the kind, and a reused prefix's tokens are fed through
        :meth:`prefill_tokens` (its hidden rows through :meth:`prefill`) instead."""
        return None

    def release(self, state: Any) -> None:  # noqa: B027 - optional hook, nothing to free by default
        """Free per-sequence resources (a KV cache) when the sequence finishes."""


class BatchProposer(Proposer):
    """A proposer that drafts a whole batch in one pass (a draft model's forward, the heads'): it
    overrides :meth:`propose_batch`, and :meth:`propose` is a batch of one."""

    def propose(self, state: Any, token_ids: Sequence[int], k: int) -> Draft:
        return self.propose_batch([state], [token_ids], [k])[0]


ProposerFactory = Callable[["SpecConfig", "CausalLM", "CausalLM | None"], Proposer]
"""Builds a proposer from the speculation config, the target model and an optional draft model."""

REGISTRY: dict[str, ProposerFactory] = {}
"""Proposer factories by method name, filled at import by :func:`register` (the built-in ones when
:mod:`verispec.proposers` is imported); look-ups go through :func:`verispec.proposers.build_proposer`."""


def register(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    """Class or function decorator: make a proposer available under ``name``."""

    def wrap(factory: ProposerFactory) -> ProposerFactory:
        if name in REGISTRY:
            raise ValueError(f"proposer {name!r} registered twice")
        REGISTRY[name] = factory
        return factory

    return wrap
