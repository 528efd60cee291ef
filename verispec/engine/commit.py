"""Committing a step's tokens to a sequence, and the events (and log-probabilities) they become."""

from __future__ import annotations

import time

import torch

from verispec.engine.state import RequestOutput, SeqState, TokenLogprobs
from verispec.types import FinishReason, TokenEvent


def commit_tokens(
    seq: SeqState,
    tokens: list[int],
    num_accepted: int,
    eos_ids: frozenset[int],
    scored: list[TokenLogprobs] | None = None,
) -> RequestOutput:
    """Append the step's tokens one at a time (EOS, a stop token or string or the length limit can
    cut the step short) and emit their events (with ``scored``, their log-probabilities). The first
    ``num_accepted`` are accepted draft tokens. The output says whether the sequence finished; the
    caller frees it then."""
    output = RequestOutput(seq.request.request_id)
    if seq.steps == 0 and seq.request.prompt_logprobs is not None:
        output.prompt_logprobs = [None, *seq.prompt_scores]
    finish: FinishReason | None = None
    for i, token in enumerate(tokens):
        seq.token_ids.append(token)
        seq.stats.num_output_tokens += 1
        text = seq.detok.add(token) if seq.detok else ""
        if token in eos_ids:
            finish = "eos"
        elif token in seq.request.stop_token_ids or (seq.detok and seq.detok.stopped):
            finish = "stop"
        elif seq.num_generated >= seq.budget:
            finish = "length"
        if finish is not None and seq.detok:
            text += seq.detok.flush()
        if finish is None and seq.rules is not None and seq.rules.constraint is not None:
            seq.rules.constraint.advance(token)
        seq.stats.total_seconds = time.perf_counter() - seq.admitted_at
        output.events.append(
            TokenEvent(
                token_id=token,
                text=text,
                from_draft=i < num_accepted,
                logprob=scored[i][0] if scored else None,
                step=seq.steps,
                finish_reason=finish,
                stats=seq.stats if finish is not None else None,
                top_logprobs=scored[i][1] if scored else (),
            )
        )
        if finish is not None:
            break
    seq.steps += 1
    output.finished = finish is not None
    return output


def token_logprobs(logits: torch.Tensor, tokens: list[int], alternatives: int) -> list[TokenLogprobs]:
    """Each committed token's log-probability and the ``alternatives`` most likely tokens, from the
    target's logits at its position (``logits[i]`` predicted ``tokens[i]``).

    The raw distribution, before temperature, top-k and top-p (as vLLM reports by default): it
    describes the model, not the sampler, and is the same whether the token was drafted and accepted
    or decoded plainly, since the verify rows score exactly as plain decoding does.
    """
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if not alternatives:
        return [(lp, ()) for lp in chosen]
    top = rows.topk(alternatives, dim=-1)
    return [
        (lp, tuple(zip(ids, values, strict=True)))
        for lp, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist(), strict=True)
    ]
