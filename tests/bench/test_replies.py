"""Served replies compared across policies and runs: the digests a results.json keeps, and the counts."""

from __future__ import annotations

from typing import Any

from verispec.bench.load import RequestResult
from verispec.bench.replies import ReplyCheck, across_policies, against, digest, replies


def request(prompt: str, turn: int, text: str, ok: bool = True, disconnected: bool = False) -> dict[str, Any]:
    result = RequestResult(prompt_id=prompt, category="c", turn=turn, ok=ok, disconnected=disconnected)
    result.text = text
    return result.to_dict()


def run(policies: dict[str, list[dict[str, Any]]], users: int = 1) -> dict[str, Any]:
    """A results dict with one level per policy."""
    return {
        "settings": {"policies": list(policies)},
        "levels": [{"policy": p, "concurrency": users, "requests": reqs} for p, reqs in policies.items()],
    }


def test_a_finished_reply_keeps_a_digest_of_its_text_and_nothing_else() -> None:
    kept = request("a", 1, "def f(): pass")
    assert kept["reply_digest"] == digest("def f(): pass") != digest("def f(): pass ")
    assert "text" not in kept
    assert request("a", 1, "partial", ok=False)["reply_digest"] is None
    assert request("a", 1, "partial", disconnected=True)["reply_digest"] is None


def test_every_policy_is_held_against_the_first_and_a_differing_turn_is_counted() -> None:
    plain = [request("a", 1, "x"), request("a", 2, "y"), request("b", 1, "z")]
    fixed = [request("a", 1, "x"), request("a", 2, "y"), request("b", 1, "z")]
    adaptive = [request("a", 1, "x"), request("a", 2, "Y"), request("b", 1, "z", ok=False)]
    checks = across_policies(run({"plain": plain, "fixed": fixed, "adaptive": adaptive}))
    assert [c.label for c in checks] == ["fixed vs plain", "adaptive vs plain"]
    assert checks[0] == ReplyCheck("fixed vs plain", 3, 3) and checks[0].identical
    assert (
        checks[1] == ReplyCheck("adaptive vs plain", 2, 1) and not checks[1].identical
    )  # b failed: left out
    assert "1 differ" in checks[1].line()


def test_another_run_is_compared_policy_by_policy_on_the_replies_both_have() -> None:
    shared = run({"plain": [request("a", 1, "x"), request("a", 2, "y")]}, users=8)
    private = run(
        {"plain": [request("a", 1, "x"), request("a", 2, "y")], "adaptive": [request("a", 1, "x")]}, 8
    )
    (check,) = against(shared, private, "private")
    assert check == ReplyCheck("plain vs plain of private", 2, 2) and check.identical
    assert replies(private)["adaptive"] == {(8, "a", 1): frozenset({digest("x")})}
    none = ReplyCheck("other prompts", 0, 0)
    assert not none.identical and none.line() == "other prompts: no replies in common"
