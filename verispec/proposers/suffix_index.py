"""Token streams indexed by hash chains: where the context's tail occurred before, in time that does
not grow with the stream.

Suffix decoding (:mod:`verispec.proposers.suffix`) asks one question per step: where did the last
few tokens of the context occur before, and what followed them? A suffix tree answers it exactly,
but a Python object per (position, depth) costs gigabytes at 10^7 cached tokens. Here the tokens sit
in one numpy ``int32`` ring buffer and, as zlib finds its matches, one hash chain per anchor length
``n`` (:data:`ANCHORS`) links every n-gram to the previous one in its hash bucket: ``heads[a, bucket]``
is the latest end position, ``links[a, slot]`` how far back the one before it is. A look-up hashes
the context's last n tokens, walks at most ``max_walk`` recent entries of that chain, checks their
tokens (buckets collide) and extends each match backwards by direct comparison, longest anchor
first. Its cost depends on the anchors and the walk, not on the stream's length. Memory is 8 bytes
per token (token, owner) and 8 to 12 per token and anchor (link, bucket heads): 50 to 60 in all.

Positions are absolute (they only grow), so an entry whose tokens were evicted from the ring is
recognised as stale by its position alone (older than :attr:`TokenIndex.start`), however its slot
was reused since. Documents (the outputs of finished requests) are separated by :data:`SEPARATOR`,
which no n-gram and no continuation crosses, and each position records its document's owner (a
cache scope): the owner is mixed into the bucket, so owners' chains rarely mix, and checked on
every match, so one owner's tokens are never found for another, collisions included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cache

import numpy as np

ANCHORS: tuple[int, ...] = (1, 2, 4, 8, 16)
"""The n-gram lengths with a hash chain (powers of two: each hash doubles the one before). A match
of the context's tail is first found by the longest anchor it has, then extended backwards."""
SEPARATOR = -1
"""Between two documents in the ring (and in free or evicted slots): matches stop there."""
MAX_WALK = 32
"""Chain entries a look-up visits per anchor: the most recent occurrences are the ones it counts."""

_MASK = (1 << 64) - 1
_TOKEN_MIX = np.uint64(0x9E3779B97F4A7C15)
_BASE = 0xC2B2AE3D27D4EB4F  # the polynomial hash's base (odd)
_BASE_POWERS = {n: np.uint64(pow(_BASE, n, 1 << 64)) for n in (1, 2, 4, 8, 16, 32, 64)}
_BUCKET_MIX = np.uint64(0xFF51AFD7ED558CCD)
_OWNER_MIX = np.uint64(0x632BE59BD9B4E019)
_OWNER_OFFSET = np.uint64(0x8CB92BA72F3D8DD7)


def ngram_hashes(window: np.ndarray, anchors: tuple[int, ...] = ANCHORS) -> np.ndarray:
    """``out[j, a]``: a hash of ``window[j - n + 1 : j + 1]`` for anchor ``n = anchors[a]``
    (meaningless for ``j < n - 1``). A polynomial hash built by doubling,
    ``h_2n(j) = h_n(j - n) * B^n + h_n(j)``: log2(max anchor) vector operations for any window."""
    h = (window.astype(np.int64).astype(np.uint64) + np.uint64(1)) * _TOKEN_MIX
    out = {1: h}
    n = 1
    while n < max(anchors):
        shifted = np.zeros_like(h)
        shifted[n:] = h[:-n]
        h = shifted * _BASE_POWERS[n] + h
        n *= 2
        out[n] = h
    return np.stack([out[a] for a in anchors], axis=1)


@cache
def _tail_powers(size: int, anchors: tuple[int, ...]) -> np.ndarray:
    """[A, size]: ``B^(size - 1 - j)`` where token j is among an anchor's last n, else 0."""
    out = np.zeros((len(anchors), size), dtype=np.uint64)
    for a, n in enumerate(anchors):
        for j in range(max(0, size - n), size):
            out[a, j] = pow(_BASE, size - 1 - j, 1 << 64)
    return out


def tail_hashes(tail: np.ndarray, anchors: tuple[int, ...] = ANCHORS) -> np.ndarray:
    """[A]: the hash of ``tail``'s last n tokens for each anchor n (:func:`ngram_hashes`' last
    row), as one product: a look-up's hashes in microseconds."""
    mixed = (tail.astype(np.int64).astype(np.uint64) + np.uint64(1)) * _TOKEN_MIX
    return _tail_powers(len(tail), anchors) @ mixed


def owner_mix(owner: int) -> np.uint64:
    """What an owner adds to a bucket: different owners' equal n-grams land in different chains."""
    if not owner:
        return np.uint64(0)
    return np.uint64((owner * int(_OWNER_MIX) + int(_OWNER_OFFSET)) & _MASK)


@dataclass(frozen=True)
class Match:
    """Earlier occurrences of the context's tail, most recent first."""

    ends: np.ndarray
    """[N] int64: the absolute position right after each occurrence (its continuation starts there)."""
    lengths: np.ndarray
    """[N] int64: how many of the context's last tokens each occurrence matches (at least ``anchor``,
    at most the tail's length)."""
    anchor: int
    """The anchor whose chain found them."""

    @property
    def longest(self) -> int:
        return int(self.lengths.max())


class TokenIndex:
    """A token stream with hash chains (module docstring).

    Without a ``budget`` it grows to hold every token (one sequence's prompt and output, appended as
    they come, :meth:`append`); with one it is a ring of at most ``budget`` positions that holds
    whole documents (:meth:`add_document`), evicting the oldest to make room.
    An occurrence ending at ``e`` (the n-gram ``[e - n, e)``) is indexed once its continuation
    ``e`` exists and is not a separator, so the context's own tail never matches itself.
    """

    def __init__(self, budget: int | None = None, capacity: int = 256, anchors: tuple[int, ...] = ANCHORS):
        if budget is not None and budget < 2:
            raise ValueError(f"a budget of at least 2 tokens is needed, got {budget}")
        self.budget = budget
        self.anchors = anchors
        self.start = 0
        """The oldest live absolute position: anything before it is stale."""
        self.length = 0
        """The next absolute position (tokens ever appended, separators included)."""
        self.docs: deque[tuple[int, int]] = deque()
        """(first position, owner) of each live document, oldest first (budgeted rings only)."""
        self._allocate(min(capacity, budget) if budget is not None else capacity)

    # ------------------------------------------------------------------------------ storage

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)
        self.owners = np.zeros(capacity, dtype=np.int32)
        self.bits = max(8, capacity.bit_length() - 1)  # 2^bits buckets: between capacity / 2 and capacity
        self.heads = np.full((len(self.anchors), 1 << self.bits), -1, dtype=np.int64)
        """Per anchor and bucket, the latest end position in it (-1: none yet)."""
        self.links = np.zeros((len(self.anchors), capacity), dtype=np.int32)
        """Per anchor and slot of an end position, how far back the previous end in its bucket is
        (0: none)."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (tokens, owners, chains)."""
        return self.tokens.nbytes + self.owners.nbytes + self.heads.nbytes + self.links.nbytes

    @property
    def live(self) -> int:
        """Positions held (separators included)."""
        return self.length - self.start

    def _grow(self, needed: int) -> None:
        """Re-lay the live positions in a larger ring (doubling, up to the budget) and re-index
        them in one pass: O(live), amortised O(1) per appended token."""
        capacity = max(needed, 2 * self.capacity)
        if self.budget is not None:
            capacity = min(capacity, self.budget)
        positions = np.arange(self.start, self.length, dtype=np.int64)
        tokens = self.tokens[positions % self.capacity]
        owners = self.owners[positions % self.capacity]
        self._allocate(capacity)
        self.tokens[positions % capacity] = tokens
        self.owners[positions % capacity] = owners
        self._index(self.start, self.length)

    def append(self, tokens: np.ndarray, owner: int = 0) -> None:
        """Add ``tokens`` at the end (growing the ring if it has no budget) and index the
        occurrences that now have a continuation."""
        m = len(tokens)
        if m == 0:
            return
        if self.live + m > self.capacity:
            if self.budget is not None and self.live + m > self.budget:
                raise ValueError("no room in the ring: make_room first")
            self._grow(self.live + m)
        slots = np.arange(self.length, self.length + m, dtype=np.int64) % self.capacity
        self.tokens[slots] = tokens
        self.owners[slots] = owner
        before = self.length
        self.length += m
        self._index(before, self.length)

    def make_room(self, size: int) -> list[tuple[int, int]]:
        """Evict the oldest documents until ``size`` more positions fit the budget; returns each
        evicted document's (owner, positions)."""
        assert self.budget is not None, "only a budgeted ring evicts"
        evicted = []
        while self.docs and self.length + size - self.start > self.budget:
            first, owner = self.docs.popleft()
            after = self.docs[0][0] if self.docs else self.length
            evicted.append((owner, after - first))
            self.start = after
        return evicted

    def add_document(self, tokens: np.ndarray, owner: int) -> int:
        """Append one document and its separator (the document's last ``budget - 1`` tokens, where
        it is longer); the caller has made room (:meth:`make_room`). Returns the positions used."""
        assert self.budget is not None, "documents go to a budgeted ring"
        doc = np.asarray(tokens, dtype=np.int32)[-(self.budget - 1) :]
        if self.length + len(doc) + 1 - self.start > self.budget:
            raise ValueError("no room in the ring: make_room first")
        self.docs.append((self.length, owner))
        self.append(np.append(doc, np.int32(SEPARATOR)), owner)
        return len(doc) + 1

    # ------------------------------------------------------------------------------ indexing

    def _index(self, lo: int, hi: int) -> None:
        """Link the occurrences ending at ``e`` in ``[lo, hi)`` into each anchor's chain, oldest
        first, all anchors in one pass."""
        reach = max(self.anchors)
        first = max(self.start, lo - reach)
        positions = np.arange(first, hi, dtype=np.int64)
        window = self.tokens[positions % self.capacity].astype(np.int64)
        ends = np.arange(max(lo, first + 1), hi, dtype=np.int64)
        if len(ends) == 0:
            return
        last = ends - 1 - first  # window index of each occurrence's last token
        separators = np.concatenate(([0], np.cumsum(window == SEPARATOR)))
        continued = window[ends - first] != SEPARATOR  # the token at e: e < hi, so in the window
        begin = last[:, None] - np.asarray(self.anchors)[None, :] + 1  # [E, A]
        clean = separators[last + 1][:, None] - separators[np.maximum(begin, 0)] == 0
        which, anchor = np.nonzero(continued[:, None] & (begin >= 0) & clean)  # by end, then anchor
        if len(which) == 0:
            return
        hashes = ngram_hashes(window, self.anchors)[last[which], anchor]
        owners = self.owners[(ends[which] - 1) % self.capacity]
        self._link(anchor, self._buckets(hashes, owners), ends[which])

    def _buckets(self, hashes: np.ndarray, owners: np.ndarray | int) -> np.ndarray:
        """Each hash's bucket, its owner mixed in."""
        if isinstance(owners, int):
            mixed = hashes ^ owner_mix(owners)
        else:
            mix = owners.astype(np.uint64) * _OWNER_MIX + _OWNER_OFFSET
            mixed = hashes ^ np.where(owners != 0, mix, np.uint64(0))
        return ((mixed * _BUCKET_MIX) >> np.uint64(64 - self.bits)).astype(np.int64)

    def _link(self, anchor: np.ndarray, buckets: np.ndarray, ends: np.ndarray) -> None:
        """Push ``ends`` (ascending per anchor) onto their anchor's bucket chains, as one push at a
        time would."""
        heads = self.heads.reshape(-1)
        keys = anchor * (1 << self.bits) + buckets
        order = np.argsort(keys, kind="stable")
        k, e, a = keys[order], ends[order], anchor[order]
        new_key = np.ones(len(k), dtype=bool)
        new_key[1:] = k[1:] != k[:-1]
        before = np.empty(len(e), dtype=np.int64)
        before[1:] = e[:-1]
        before[new_key] = heads[k[new_key]]
        self.links[a, e % self.capacity] = np.where(before >= self.start, e - before, 0).astype(np.int32)
        last = np.ones(len(k), dtype=bool)
        last[:-1] = k[1:] != k[:-1]
        heads[k[last]] = e[last]

    # ------------------------------------------------------------------------------ look-up

    def find(
        self, tail: np.ndarray, owner: int = 0, max_walk: int = MAX_WALK, hashes: np.ndarray | None = None
    ) -> Match | None:
        """The recent occurrences of the longest anchor-length tail of ``tail`` (the context's last
        tokens) that occurs at all, each with its full match length; None where none does.
        ``hashes``: :func:`tail_hashes` of ``tail``, where the caller has them already."""
        size = len(tail)
        if size == 0 or self.live == 0:
            return None
        if hashes is None:
            hashes = tail_hashes(tail, self.anchors)
        usable = [a for a, n in enumerate(self.anchors) if n <= size]
        buckets = self._buckets(hashes[usable], owner)
        latest = self.heads[usable, buckets].tolist()
        tail64 = tail.astype(np.int64)
        back = np.arange(size, 0, -1, dtype=np.int64)  # distance before the end of each tail token
        for a, head in sorted(zip(usable, latest, strict=True), reverse=True):  # longest anchor first
            n = self.anchors[a]
            found = self._walk(a, head, max_walk, int(tail[-1]), int(tail[-n]), owner)
            if not found:
                continue
            ends = np.array(found, dtype=np.int64)
            positions = ends[:, None] - back[None, :]  # [N, size]: the tokens before each end
            stored = self.tokens[positions % self.capacity].astype(np.int64)
            stored[positions < self.start] = SEPARATOR
            same = (stored == tail64[None, :])[:, ::-1]
            lengths = np.where(same.all(axis=1), size, np.argmin(same, axis=1))
            ok = lengths >= n
            if ok.any():
                return Match(ends[ok], lengths[ok].astype(np.int64), n)
        return None

    def _walk(
        self, anchor: int, position: int, max_walk: int, last: int, first: int, owner: int
    ) -> list[int]:
        """The live end positions among the ``max_walk`` most recent of a chain from ``position``
        whose occurrence has the owner and the tail's last and first tokens (the rest of the tokens
        the caller checks at once): most bucket collisions are dropped here, token by token."""
        out: list[int] = []
        links = self.links[anchor]
        tokens, owners, capacity, span = self.tokens, self.owners, self.capacity, self.anchors[anchor]
        for _ in range(max_walk):
            if position < self.start:
                break
            slot = (position - 1) % capacity
            if (
                tokens[slot] == last
                and tokens[(position - span) % capacity] == first
                and owners[slot] == owner
            ):
                out.append(position)
            step = int(links[position % capacity])
            if step == 0:
                break
            position -= step
        return out

    def continuations(self, ends: np.ndarray, depth: int) -> np.ndarray:
        """[N, depth]: the tokens from each end on, :data:`SEPARATOR` from the first that is not
        there (the stream's or the document's end)."""
        positions = ends[:, None] + np.arange(depth, dtype=np.int64)[None, :]
        out = self.tokens[positions % self.capacity].astype(np.int64)
        out[positions >= self.length] = SEPARATOR
        out[np.cumsum(out == SEPARATOR, axis=1) > 0] = SEPARATOR
        return out


class OutputCache:
    """Finished requests' outputs, per cache scope, in one ring with one budget (oldest evicted
    first, whatever their scope); a scope finds only its own outputs."""

    def __init__(self, budget: int):
        self.index = TokenIndex(budget=budget)
        self.scopes: dict[str, int] = {}
        """Scope name to the owner id its positions carry (ids start at 1; 0 is nobody's)."""
        self.held: dict[int, int] = {}
        """Positions each owner id holds; an id that holds none is forgotten with its scope."""
        self._names: dict[int, str] = {}
        self._next_id = 1

    def add(self, scope: str, tokens: np.ndarray) -> None:
        """Keep ``tokens`` (one request's output) for ``scope``'s later requests."""
        if len(tokens) == 0:
            return
        assert self.index.budget is not None
        for owner, positions in self.index.make_room(min(len(tokens), self.index.budget - 1) + 1):
            self.held[owner] -= positions
            if self.held[owner] <= 0:
                del self.held[owner]
                del self.scopes[self._names.pop(owner)]
        owner = self.scopes.get(scope)
        if owner is None:
            owner = self.scopes[scope] = self._next_id
            self._names[owner] = scope
            self._next_id += 1
        self.held[owner] = self.held.get(owner, 0) + self.index.add_document(tokens, owner)

    def find(
        self, scope: str, tail: np.ndarray, max_walk: int = MAX_WALK, hashes: np.ndarray | None = None
    ) -> Match | None:
        """``scope``'s outputs' occurrences of the tail (:meth:`TokenIndex.find`)."""
        owner = self.scopes.get(scope)
        return None if owner is None else self.index.find(tail, owner, max_walk, hashes)
