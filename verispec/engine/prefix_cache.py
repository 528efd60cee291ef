"""The prefix cache: keys and values of earlier requests, reused by later ones that start the same way.

A chat resends its whole conversation every turn and an agent its whole transcript every call; on a
CPU a prefill runs at tens to a few hundred tokens per second, so recomputing them costs seconds
before the first token. Here a sequence that ends leaves its keys and values behind in blocks of
:data:`BLOCK` tokens, and a new sequence whose prompt starts with the same blocks takes them instead
of computing them. Reuse goes to the token, not to the block: a prompt takes the run of whole blocks
it starts with, then as many first positions of the next block as it shares with one stored under
the last of them (a sequence's last, partial block is stored too), as SGLang's radix cache does. A
chat's next turn recomputes only its new text, not up to ``BLOCK - 1`` tokens of the last one with it.

**Exact.** On the paths where a position's keys, values and hidden state depend on its tokens alone,
not on how the forwards that computed it were grouped (GGUF and int8 weights with verispec's
attention, :attr:`~verispec.models.hf.HFCausalLM.position_invariant`), a reused block holds the
very bits the new sequence would have computed, whether an earlier prefill or an earlier decode
step wrote it: output and log-probabilities are identical with and without the cache. Other paths
(float weights through BLAS, int4's many-row prompt kernel, CUDA) keep no prefix cache. What a
proposer keeps is reused or rebuilt from the same material: the target's hidden rows are stored
beside the keys where the engine hands hidden states to a proposer (EAGLE, Medusa) or a tap; a
proposer's own keys and values (a draft model's, an EAGLE drafter's pairs) are blocks of their own
(:data:`DRAFT`), under the same keys and budget, where they are exact to reuse too
(:meth:`~verispec.proposers.base.Proposer.prefix_kv`), and otherwise the proposer is fed the reused
tokens or hidden rows as its prefill would have fed them.

**Keys.** A block is found by a hash chained over the scope and every token up to its end
(``h_i = H(h_{i-1}, tokens of block i)``, ``h_{-1} = H(scope)``), as vLLM's automatic prefix
caching does; the block also keeps its tokens and they are compared on a hit, so a hash collision
can never hand over another text's keys. The scope (:attr:`~verispec.engine.state.Request.cache_scope`)
is part of the first hash: a request finds only blocks its own scope left, because how fast a
prompt's first token comes back tells whether someone else's text started the same way. A request
with no scope neither reads nor writes.

**Memory.** Blocks are evicted least recently used first under a byte budget. A hit touches its
blocks last to first, so a conversation's first blocks, which every later turn needs, go last.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch

from verispec.models.kv import KVBuffer

BLOCK = 16
"""Tokens per block. Reuse is not limited to whole blocks: a block's first m positions serve any
prompt that shares its first m tokens (a position's keys depend on the tokens up to it alone), and a
sequence's last, partial block is kept too, so a later turn recomputes only its new text. Smaller
blocks cost more hashing and more tensors per token."""

CANDIDATES = 64
"""Blocks under one parent compared token by token (most recent first) where a prompt leaves the
chain of whole blocks, and where a partial block is stored (is it covered already, which shorter
ones does it replace): bounds a lookup's and a store's cost under a parent with many continuations
(a shared system prompt's); a longer match past them is missed, never a wrong one taken."""

TARGET, DRAFT = "", "draft"
"""Whose positions a block holds (the ``part`` of :meth:`PrefixCache.reuse` and :meth:`PrefixCache.keep`):
the target's, or the proposer's own (a draft model's, an EAGLE drafter's pairs). The part enters the
first hash of the chain, so the two never mix."""


@dataclass(eq=False)
class _Block:
    tokens: tuple[int, ...]  # BLOCK of them, fewer for a sequence's last, partial block
    parent: bytes  # the key of the block before it (or of the scope)
    keys: torch.Tensor  # [L, Hkv, len(tokens), D]
    values: torch.Tensor
    hidden: torch.Tensor | None  # [len(tokens), H'] where the engine keeps hidden rows
    nbytes: int


@dataclass(frozen=True)
class Reused:
    """What a lookup handed to a sequence."""

    tokens: int
    """Positions now in the sequence's cache."""
    hidden: torch.Tensor | None
    """Their hidden rows, ``[tokens, H']``, where the cache keeps them."""


class PrefixCache:
    """Blocks of keys and values (and hidden rows) of finished prefixes, by scope and tokens."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._children: dict[bytes, dict[bytes, None]] = {}  # parent -> its blocks, oldest first
        self.hits = 0
        """Tokens handed out by lookups (reused instead of computed)."""
        self.queried = 0
        """Prompt tokens lookups were asked about."""

    def __len__(self) -> int:
        return len(self._blocks)

    def reuse(
        self,
        scope: str,
        token_ids: Sequence[int],
        cache: KVBuffer,
        limit: int,
        *,
        with_hidden: bool = False,
        part: str = TARGET,
    ) -> Reused:
        """Fill the empty ``cache`` with the longest prefix of ``token_ids`` that cached blocks of
        ``part`` hold, at most ``limit`` positions (the engine keeps the prompt's last token to feed
        itself): the run of whole blocks it starts with, then the first positions of the block under
        the last of them that shares the most of the next tokens. ``with_hidden``: only blocks that
        kept their hidden rows. :attr:`hits` and :attr:`queried` count the target's lookups."""
        if cache.length:
            raise ValueError("a prefix is reused into an empty cache only")
        if part == TARGET:
            self.queried += max(0, limit)
        found: list[tuple[bytes, _Block, int]] = []  # key, block, positions taken from it
        parent = _root(scope, part)
        for key, tokens in _chain(parent, token_ids, limit // BLOCK):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens or (with_hidden and block.hidden is None):
                break
            found.append((key, block, BLOCK))
            parent = key
        start = len(found) * BLOCK
        partial = self._partial(parent, tuple(token_ids[start : min(limit, start + BLOCK)]), with_hidden)
        if partial is not None:
            found.append(partial)
        if not found:
            return Reused(0, None)
        for key, _, _ in reversed(found):  # last block first: the first blocks are evicted last
            self._blocks.move_to_end(key)
        keys = torch.cat([b.keys[:, :, :m] for _, b, m in found], dim=2)  # [L, Hkv, n, D]
        values = torch.cat([b.values[:, :, :m] for _, b, m in found], dim=2)
        for layer in range(keys.shape[0]):
            cache.write(layer, 0, keys[layer], values[layer])
        n = keys.shape[2]
        cache.advance(n)
        if part == TARGET:
            self.hits += n
        hidden = None
        if with_hidden:
            hidden = torch.cat([b.hidden[:m] for _, b, m in found if b.hidden is not None])
        return Reused(n, hidden)

    def keep(
        self,
        scope: str,
        token_ids: Sequence[int],
        cache: KVBuffer,
        hidden: torch.Tensor | None = None,
        *,
        part: str = TARGET,
    ) -> int:
        """Store the blocks of ``cache`` (``part``'s positions) that are not stored yet, the last
        one partial where the positions end inside a block; returns how many were new.

        ``token_ids`` are the tokens at the cache's positions (at least ``cache.length`` of them;
        only positions the cache holds are kept). ``hidden``: their hidden rows, one per cached
        position, or None where the engine keeps none. A partial block that a new block extends
        is dropped: the longer one serves every prompt the shorter did."""
        held = min(cache.length, len(token_ids))
        if hidden is not None:
            held = min(held, hidden.shape[0])
        if not self.budget_bytes or held <= 0:
            return 0
        root = _root(scope, part)
        chain = _chain(root, token_ids, held // BLOCK)
        tail = tuple(token_ids[len(chain) * BLOCK : held])
        if tail:
            chain.append((_next(chain[-1][0] if chain else root, tail), tail))
        parents = [root] + [key for key, _ in chain[:-1]]
        new = []
        for i, ((key, tokens), parent) in enumerate(zip(chain, parents, strict=True)):
            if key not in self._blocks and not (len(tokens) < BLOCK and self._covered(parent, tokens)):
                new.append((i, key, tokens, parent))
        if new:
            layers = sorted(cache.keys)
            first, last = new[0][0] * BLOCK, new[-1][0] * BLOCK + len(new[-1][2])
            keys = torch.stack([cache.keys[i][:, first:last] for i in layers])  # [L, Hkv, span, D]
            values = torch.stack([cache.values[i][:, first:last] for i in layers])
            for i, key, tokens, parent in new:
                lo, hi = i * BLOCK - first, i * BLOCK - first + len(tokens)
                rows = hidden[i * BLOCK : i * BLOCK + len(tokens)].clone() if hidden is not None else None
                block = _Block(
                    tokens, parent, keys[:, :, lo:hi].clone(), values[:, :, lo:hi].clone(), rows, 0
                )
                block.nbytes = sum(_bytes(t) for t in (block.keys, block.values, block.hidden))
                self._drop_prefixes_of(parent, tokens)
                self._blocks[key] = block
                self._children.setdefault(parent, {})[key] = None
                self.nbytes += block.nbytes
        for key, _ in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)
        self._evict()
        return len(new)

    def clear(self) -> None:
        self._blocks.clear()
        self._children.clear()
        self.nbytes = 0

    def _partial(
        self, parent: bytes, wanted: tuple[int, ...], with_hidden: bool
    ) -> tuple[bytes, _Block, int] | None:
        """The block under ``parent`` whose first tokens match the most of ``wanted`` (at least
        one), and how many; among the :data:`CANDIDATES` most recently stored."""
        best: tuple[bytes, _Block, int] | None = None
        if not wanted:
            return None
        for key in self._recent(parent):
            block = self._blocks[key]
            if with_hidden and block.hidden is None:
                continue
            m = _common(block.tokens, wanted)
            if m and (best is None or m > best[2]):
                best = (key, block, m)
                if m == len(wanted):
                    break
        return best

    def _covered(self, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether one of the :data:`CANDIDATES` blocks stored last under ``parent`` starts with
        ``tokens`` (a partial block's). Missing an older one only stores the partial block twice."""
        return any(self._blocks[key].tokens[: len(tokens)] == tokens for key in self._recent(parent))

    def _drop_prefixes_of(self, parent: bytes, tokens: tuple[int, ...]) -> None:
        """Remove the partial blocks under ``parent`` that ``tokens`` extend, among the
        :data:`CANDIDATES` stored last (a sequence's own partial block is among them; an older one
        left behind stays correct, only redundant, until it is evicted)."""
        for key in self._recent(parent):
            block = self._blocks[key]
            if len(block.tokens) < len(tokens) and tokens[: len(block.tokens)] == block.tokens:
                self._remove(key)

    def _recent(self, parent: bytes) -> list[bytes]:
        """The keys of the :data:`CANDIDATES` blocks stored last under ``parent``, newest first."""
        return list(islice(reversed(self._children.get(parent, {})), CANDIDATES))

    def _remove(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        self.nbytes -= block.nbytes
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.pop(key, None)
            if not siblings:
                del self._children[block.parent]

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self._blocks:
            self._remove(next(iter(self._blocks)))


def _root(scope: str, part: str) -> bytes:
    """The key the chain of ``scope``'s (and ``part``'s) blocks starts from."""
    return hashlib.blake2b(
        scope.encode(), digest_size=16, person=b"verispec-prefix", salt=part.encode()
    ).digest()


def _next(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of the block holding ``tokens`` after the block (or scope) keyed ``parent``."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def _chain(root: bytes, token_ids: Sequence[int], blocks: int) -> list[tuple[bytes, tuple[int, ...]]]:
    """The first ``blocks`` whole blocks of ``token_ids`` after ``root``: each one's chained key and
    its tokens."""
    out = []
    digest = root
    for i in range(blocks):
        tokens = tuple(token_ids[i * BLOCK : (i + 1) * BLOCK])
        digest = _next(digest, tokens)
        out.append((digest, tokens))
    return out


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
