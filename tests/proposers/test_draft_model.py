"""The draft-model proposer: how it feeds a prompt it has not seen."""

from __future__ import annotations

from tests.test_engine import make_engine


def test_a_long_prompt_reaches_the_draft_in_one_pass_keeping_no_logits(tiny_target, tiny_draft, monkeypatch):
    """The draft's first proposal feeds the whole prompt: all but its last token as a prefill (no
    logits, so the int4 path runs its many-row kernel), then the last token with the drafting.
    The output still equals plain decoding, and drafts were proposed and accepted."""
    prompt = [(5 * i + 2) % 90 for i in range(45)]
    calls: list[tuple[list[int], list[int]]] = []
    forward_batch = tiny_draft.forward_batch

    def spy(caches, tokens, *, logits_to_keep, **kwargs):
        calls.append(([len(t) for t in tokens], list(logits_to_keep)))
        return forward_batch(caches, tokens, logits_to_keep=logits_to_keep, **kwargs)

    monkeypatch.setattr(tiny_draft, "forward_batch", spy)
    want = make_engine(tiny_target, None, None).generate(prompt, max_new_tokens=30)
    got = make_engine(tiny_target, tiny_draft, "draft", k=4).generate(prompt, max_new_tokens=30)
    assert got.token_ids == want.token_ids
    assert got.stats.num_drafted > 0 and got.stats.num_accepted > 0
    assert calls[0] == ([len(prompt) - 1], [0])
    assert calls[1] == ([1], [1])
    assert all(max(lengths) <= 16 and all(keep) for lengths, keep in calls[1:])
