"""Whether served replies came back as the same text: across a run's policies, and against another run.

Why: ``bench serve`` sends greedy requests, speculation is lossless and the prefix cache is exact, so
a conversation's turn must come back as the same text whatever the depth policy, the number of users
beside it or the cache scope. That makes a served benchmark a lossless check as well as a timing:
``results.json`` keeps a digest of each finished reply (not the text), and the report counts the
replies that match the first policy's (plain decoding, where it ran) and, with ``--compare-replies``,
another run's (the same prompts served with the other cache scope, say).

A reply is keyed by (policy, users, prompt, turn). Repeats of a level send the same conversations,
so a key may hold several digests; two keys match when they hold the same set. A turn after a reply
that differed is sent a different conversation and is counted as it comes back.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

Key = tuple[int, str, int]
"""(users, prompt id, turn): one reply within a policy."""


def digest(text: str) -> str:
    """A short digest of a reply's text: equal texts, equal digests; it does not keep the text."""
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def replies(results: dict[str, Any]) -> dict[str, dict[Key, frozenset[str]]]:
    """Policy -> key -> the digests of its finished replies, from a ``bench serve`` results dict."""
    found: dict[str, dict[Key, set[str]]] = defaultdict(lambda: defaultdict(set))
    for level in results["levels"]:
        for request in level["requests"]:
            if request.get("reply_digest"):
                key = (level["concurrency"], request["prompt_id"], request["turn"])
                found[level["policy"]][key].add(request["reply_digest"])
    return {policy: {k: frozenset(v) for k, v in keys.items()} for policy, keys in found.items()}


@dataclass(frozen=True)
class ReplyCheck:
    """How many replies two sets of requests had in common, and how many of them matched."""

    label: str
    compared: int
    same: int

    @property
    def identical(self) -> bool:
        return self.compared > 0 and self.same == self.compared

    def line(self) -> str:
        if not self.compared:
            return f"{self.label}: no replies in common"
        verdict = "identical" if self.identical else f"{self.compared - self.same} differ"
        return f"{self.label}: {self.same}/{self.compared} replies the same ({verdict})"

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "compared": self.compared, "same": self.same}


def check(label: str, ours: dict[Key, frozenset[str]], theirs: dict[Key, frozenset[str]]) -> ReplyCheck:
    """Compare the replies both sides have (a failed request on either side is left out)."""
    common = ours.keys() & theirs.keys()
    return ReplyCheck(label, len(common), sum(ours[k] == theirs[k] for k in common))


def across_policies(results: dict[str, Any]) -> list[ReplyCheck]:
    """Every policy's replies against the first policy's (plain decoding when it ran)."""
    by_policy = replies(results)
    order = [p for p in results["settings"]["policies"] if p in by_policy]
    if len(order) < 2:
        return []
    first = order[0]
    return [check(f"{policy} vs {first}", by_policy[policy], by_policy[first]) for policy in order[1:]]


def against(results: dict[str, Any], other: dict[str, Any], name: str) -> list[ReplyCheck]:
    """Each policy's replies against the same policy's in ``other`` (a run named ``name``)."""
    ours, theirs = replies(results), replies(other)
    return [
        check(f"{policy} vs {policy} of {name}", ours[policy], theirs[policy])
        for policy in ours
        if policy in theirs
    ]
