"""The prefix cache: keys and values of earlier requests, reused by later ones that start the same way.

A chat resends its whole conversation every turn and an agent its whole transcript every call; on a
CPU a prefill runs at tens to a few hundred tokens per second, so recomputing them costs seconds
before the first token. Here a sequence that ends leaves its keys and values behind in blocks of
:data:`BLOCK` tokens, and a new sequence whose prompt starts with the same blocks takes them instead
of computing them: its prefill starts after the last shared block.

**Exact.** On the paths where a position's keys, values and hidden state depend on its tokens alone,
not on how the forwards that computed it were grouped (GGUF and int8 weights with verispec's
attention, :attr:`~verispec.models.hf.HFCausalLM.position_invariant`), a reused block holds the
very bits the new sequence would have computed, whether an earlier prefill or an earlier decode
step wrote it: output and log-probabilities are identical with and without the cache. Other paths
(float weights through BLAS, int4's many-row prompt kernel, CUDA) keep no prefix cache. What a
proposer keeps is reused or rebuilt from the same material: the target's hidden rows are stored
beside the keys where the engine hands hidden states to a proposer (EAGLE, Medusa) or a tap; a draft
model's own keys and values are blocks of their own (:data:`DRAFT`), under the same keys and budget,
where the draft is exact to reuse too (:meth:`~verispec.proposers.base.Proposer.prefix_kv`), and
otherwise it is fed the reused tokens as its prefill would have fed them.

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

import numpy as np
import torch

from verispec.models.kv import KVBuffer

BLOCK = 16
"""Tokens per block: a later prompt reuses whole blocks, so at most BLOCK - 1 shared tokens are
recomputed; smaller blocks cost more hashing and more tensors per token."""

TARGET, DRAFT = "", "draft"
"""Whose positions a block holds (the ``part`` of :meth:`PrefixCache.reuse` and :meth:`PrefixCache.keep`):
the target's, or a draft model's. The part enters the first hash of the chain, so the two never mix."""


@dataclass(eq=False)
class _Block:
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [L, Hkv, BLOCK, D]
    values: torch.Tensor
    hidden: torch.Tensor | None  # [BLOCK, H'] where the engine keeps hidden rows
    nbytes: int


@dataclass(frozen=True)
class Reused:
    """What a lookup handed to a sequence."""

    tokens: int
    """Positions now in the sequence's cache (a multiple of :data:`BLOCK`)."""
    hidden: torch.Tensor | None
    """Their hidden rows, ``[tokens, H']``, where the cache keeps them."""


class PrefixCache:
    """Blocks of keys and values (and hidden rows) of finished prefixes, by scope and tokens."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
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
        """Fill the empty ``cache`` with the longest run of cached blocks of ``part`` that starts
        ``token_ids``, at most ``limit`` positions (the engine keeps the prompt's last token to feed
        itself); ``with_hidden``: only blocks that kept their hidden rows. :attr:`hits` and
        :attr:`queried` count the target's lookups."""
        if cache.length:
            raise ValueError("a prefix is reused into an empty cache only")
        if part == TARGET:
            self.queried += max(0, limit)
        found: list[_Block] = []
        keys_found: list[bytes] = []
        for key, tokens in _chain(scope, token_ids, limit // BLOCK, part):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens or (with_hidden and block.hidden is None):
                break
            found.append(block)
            keys_found.append(key)
        if not found:
            return Reused(0, None)
        for key in reversed(keys_found):  # last block first: the first blocks are evicted last
            self._blocks.move_to_end(key)
        keys = torch.cat([b.keys for b in found], dim=2)  # [L, Hkv, n, D]
        values = torch.cat([b.values for b in found], dim=2)
        for layer in range(keys.shape[0]):
            cache.write(layer, 0, keys[layer], values[layer])
        n = len(found) * BLOCK
        cache.advance(n)
        if part == TARGET:
            self.hits += n
        hidden = None
        if with_hidden:
            hidden = torch.cat([b.hidden for b in found if b.hidden is not None])
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
        """Store the whole blocks of ``cache`` (``part``'s positions) that are not stored yet;
        returns how many were new.

        ``token_ids`` are the tokens at the cache's positions (at least ``cache.length`` of them;
        only full blocks of positions the cache holds are kept). ``hidden``: their hidden rows, one
        per cached position, or None where the engine keeps none."""
        if not self.budget_bytes:
            return 0
        held = min(cache.length, len(token_ids))
        if hidden is not None:
            held = min(held, hidden.shape[0])
        chain = list(_chain(scope, token_ids, held // BLOCK, part))
        new = [(i, key, tokens) for i, (key, tokens) in enumerate(chain) if key not in self._blocks]
        if not new:
            for key, _ in reversed(chain):
                self._blocks.move_to_end(key)
            return 0
        layers = sorted(cache.keys)
        first, last = new[0][0] * BLOCK, (new[-1][0] + 1) * BLOCK
        keys = torch.stack([cache.keys[i][:, first:last] for i in layers])  # [L, Hkv, span, D]
        values = torch.stack([cache.values[i][:, first:last] for i in layers])
        for i, key, tokens in new:
            lo, hi = i * BLOCK - first, (i + 1) * BLOCK - first
            block = _Block(
                tokens,
                keys[:, :, lo:hi].clone(),
                values[:, :, lo:hi].clone(),
                hidden[i * BLOCK : (i + 1) * BLOCK].clone() if hidden is not None else None,
                0,
            )
            block.nbytes = sum(_bytes(t) for t in (block.keys, block.values, block.hidden))
            self._blocks[key] = block
            self.nbytes += block.nbytes
        for key, _ in reversed(chain):
            self._blocks.move_to_end(key)
        self._evict()
        return len(new)

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def _evict(self) -> None:
        while self.nbytes > self.budget_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.nbytes -= block.nbytes


def _chain(
    scope: str, token_ids: Sequence[int], blocks: int, part: str = TARGET
) -> list[tuple[bytes, tuple[int, ...]]]:
    """The first ``blocks`` blocks of ``token_ids``: each one's chained key and its tokens."""
    ids = np.asarray(token_ids[: blocks * BLOCK], dtype=np.int64)
    digest = hashlib.blake2b(
        scope.encode(), digest_size=16, person=b"verispec-prefix", salt=part.encode()
    ).digest()
    out = []
    for i in range(blocks):
        chunk = ids[i * BLOCK : (i + 1) * BLOCK]
        digest = hashlib.blake2b(digest + chunk.tobytes(), digest_size=16).digest()
        out.append((digest, tuple(chunk.tolist())))
    return out


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
