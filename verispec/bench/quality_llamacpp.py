"""verispec's model against llama.cpp on the same GGUF file: does it pick the tokens llama.cpp picks?

``verispec bench quality`` (:mod:`verispec.bench.quality`) measures what verispec's own
quantization costs against float32 of the same weights. A user choosing between verispec and
llama.cpp asks something else: given the GGUF file they already run in llama.cpp, how close is what
verispec computes from it? By default verispec runs the file's own blocks with its own kernels
(``gguf``: the same weights, activations quantized as llama.cpp's are but summed in another order),
or re-quantized (int8, int4) or float weights; llama.cpp runs the blocks as shipped. So the two
differ a little or more, and this measures by how much, in the units a user feels:

1. llama.cpp (llama-cpp-python, in a process of its own as for the speed baselines,
   :class:`~verispec.bench.llamacpp_baselines.LlamaCppWorker`) writes a greedy reply to each
   prompt, from an empty KV cache, stopping at an EOS token or ``max_new_tokens``;
2. llama.cpp teacher-forces prompt + reply and says, for every reply token, its negative
   log-likelihood and its own top token there;
3. verispec's model (loaded as ``verispec serve`` would, with the chosen quantization)
   teacher-forces the same ids: its top token and negative log-likelihood at the same positions.

Reported: **agreement**, the share of reply positions where verispec's most likely token is the
token llama.cpp chose, and the **perplexity** of the replies under each. The replies are llama.cpp's
own greedy choices, so its perplexity of them is low by construction; the gap between the two, not
either value alone, is what says how far verispec's model is from llama.cpp's. Also reported:
llama.cpp's *self*-agreement, its teacher-forced top token against the token it generated at the
same position. It is not 1 by definition: llama.cpp's pass over many rows at once rounds differently
from its one-row decoding steps, which flips near-ties (logit gaps of a few hundredths), so it is the
floor of noise under which a difference between the two tools means nothing.

Both sides see exactly the same token ids: verispec's tokenizer makes the prompt (the chat
template applied for chat prompts, as the speed benchmark does) and llama.cpp's reply is taken as
ids. llama.cpp's own tokenizer is asked for the same prompt text, and every prompt where the two
tokenizers disagree is reported (their ids still go to both models, so the comparison stays exact).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from verispec.bench.datasets import CATEGORIES, BenchPrompt, load_dataset
from verispec.bench.llamacpp_baselines import LLAMACPP_MISSING, LlamaCppWorker, gguf_source
from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM

DEFAULT_DATASETS = ("humaneval", "spec_bench")
"""Code completion and Spec-Bench's chat tasks: the prompts the speed benchmark runs."""
DEFAULT_MAX_NEW_TOKENS = 96
CONTEXT_STEP = 256
"""llama.cpp's context is the longest prompt plus reply, rounded up to this: its logits array holds
a row of vocabulary size per position (600 MB per 1024 positions for a 152k vocabulary)."""
N_BATCH = 512


class Tokenizer(Protocol):
    """What is used of verispec's (Hugging Face) tokenizer."""

    chat_template: Any

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any: ...


class Reference(Protocol):
    """llama.cpp's side: :class:`ScoringWorker`, or a fake in tests."""

    def tokenize(self, text: str, add_special: bool) -> list[int]: ...

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int]
    ) -> tuple[list[int], float]: ...

    def score(self, prompt_ids: list[int], reply_ids: list[int]) -> tuple[list[float], list[int]]: ...


class ScoringWorker(LlamaCppWorker):
    """A :class:`LlamaCppWorker` that also tokenizes and teacher-forces (the worker's request kinds)."""

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        reply = self._request({"kind": "tokenize", "text": text, "add_special": add_special})
        return [int(t) for t in reply["ids"]]

    def score(self, prompt_ids: list[int], reply_ids: list[int]) -> tuple[list[float], list[int]]:
        reply = self._request({"kind": "score", "prompt_ids": prompt_ids, "reply_ids": reply_ids})
        return [float(x) for x in reply["nll"]], [int(t) for t in reply["top"]]

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request; a crash ends this process (the next request starts another)."""
        if self.proc is None:
            self.start()
        reply = self._ask(message)
        if "error" in reply:
            raise VerispecError(f"llama.cpp refused the {message['kind']} request: {reply['error']}")
        return reply


# --- arithmetic -----------------------------------------------------------------------------------


def token_scores(logits: torch.Tensor, reply: Sequence[int]) -> tuple[list[int], list[float]]:
    """The top token and the negative log-likelihood of ``reply[i]`` at each row ``i`` of ``logits``.

    ``logits`` is ``[len(reply), V]``, row i predicting reply token i. The log-softmax is taken in
    float64, as the llama.cpp worker does, so a difference between the two sides is the models'.
    """
    if logits.shape[0] != len(reply):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(reply)} reply tokens")
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = -logp[torch.arange(len(reply)), torch.as_tensor(list(reply), dtype=torch.long)]
    return [int(t) for t in logits.argmax(-1)], [float(x) for x in nll]


def agreeing(top: Sequence[int], reply: Sequence[int]) -> int:
    """Positions where ``top`` is the reply's token."""
    if len(top) != len(reply):
        raise ValueError(f"{len(top)} top tokens for {len(reply)} reply tokens")
    return sum(1 for a, b in zip(top, reply, strict=True) if a == b)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two id sequences differ (a shorter one differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def perplexity(nll: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood per token."""
    if not nll:
        raise ValueError("perplexity of no tokens")
    return math.exp(math.fsum(nll) / len(nll))


def teacher_force(model: HFCausalLM, prompt_ids: Sequence[int], reply: Sequence[int]) -> torch.Tensor:
    """verispec's ``[len(reply), V]`` logits, row i predicting ``reply[i]`` after the prompt and
    ``reply[:i]``.

    The prompt but its last token goes in as a prefill that keeps no logits, then the rest in one
    pass that keeps all of them: the shape of verispec's own work (a prompt, then rows to verify),
    so on the int4 path each part runs the kernel it runs when serving, and no logits are made for
    the prompt, whose rows nobody scores.
    """
    if not prompt_ids or not reply:
        raise ValueError("teacher forcing needs a prompt and a reply of at least one token each")
    cache = model.new_cache()
    if len(prompt_ids) > 1:
        model.forward_batch([cache], [list(prompt_ids[:-1])], logits_to_keep=[0])
    span = [prompt_ids[-1], *reply[:-1]]
    return model.forward(torch.tensor([span]), cache, logits_to_keep=len(span)).logits[0]


# --- prompts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptIds:
    """A prompt as both models get it, and the text llama.cpp's tokenizer is checked on."""

    prompt: BenchPrompt
    ids: list[int]
    text: str
    add_special: bool
    """Whether the ids include the tokens a tokenizer adds around a text (raw prompts: yes; a chat
    template writes its own)."""


def quality_prompts(datasets: Sequence[str], limit: int, data_dir: Path | None = None) -> list[BenchPrompt]:
    """Up to ``limit`` prompts of each dataset, spread over its categories.

    The first rows of each category in file order, ``ceil(limit / categories)`` of each until
    ``limit``: Spec-Bench lists its six tasks one after the other, so its first ``limit`` rows
    would all be multi-turn chat, while this takes one of each task once ``limit`` is 6.
    """
    if limit < 1:
        raise VerispecError(f"--limit must be >= 1, got {limit}")
    prompts: list[BenchPrompt] = []
    for name in datasets:
        per_category = math.ceil(limit / len(CATEGORIES.get(name, ("any",))))
        prompts += load_dataset(
            name,  # type: ignore[arg-type]  # load_dataset names the valid ones if it is not
            data_dir=data_dir,
            limit_per_category=per_category,
            limit=limit,
        )
    return prompts


def prompt_ids(tokenizer: Tokenizer, prompt: BenchPrompt) -> PromptIds:
    """The first turn of ``prompt`` as verispec sends it: through the chat template for a chat
    prompt (as ``verispec generate`` and the speed benchmark do), raw otherwise."""
    text = prompt.turns[0]
    if not prompt.chat:
        return PromptIds(prompt, [int(i) for i in tokenizer.encode(text)], text, add_special=True)
    if not getattr(tokenizer, "chat_template", None):
        raise VerispecError(
            f"the model has no chat template, so it can't run {prompt.dataset}'s chat prompts; "
            "use --dataset humaneval (raw completion)"
        )
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return PromptIds(prompt, [int(i) for i in ids], str(rendered), add_special=False)


def context_size(prompts: Sequence[PromptIds], max_new_tokens: int, model_context: int) -> int:
    """llama.cpp's context: room for the longest prompt and its reply, within the model's own."""
    longest = max(len(p.ids) for p in prompts) + max_new_tokens
    return min(model_context, math.ceil(longest / CONTEXT_STEP) * CONTEXT_STEP)


# --- the comparison -------------------------------------------------------------------------------


@dataclass
class ReplyComparison:
    """One prompt: llama.cpp's reply and both models' view of each of its tokens."""

    dataset: str
    id: str
    prompt_tokens: int
    reply: list[int]
    verispec_top: list[int]
    verispec_nll: list[float]
    llamacpp_top: list[int]
    llamacpp_nll: list[float]
    tokenizer_difference: int | None
    """First prompt position where llama.cpp's tokenizer differs from verispec's (None: they agree)."""

    @property
    def agreeing(self) -> int:
        return agreeing(self.verispec_top, self.reply)

    @property
    def self_agreeing(self) -> int:
        return agreeing(self.llamacpp_top, self.reply)

    @property
    def first_disagreement(self) -> int | None:
        """The first reply position where verispec's top token is not llama.cpp's (None: none)."""
        return first_difference(self.verispec_top, self.reply)

    def to_dict(self) -> dict[str, object]:
        return {
            "dataset": self.dataset,
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "reply_tokens": len(self.reply),
            "agreement": self.agreeing / len(self.reply),
            "first_disagreement": self.first_disagreement,
            "llamacpp_self_agreement": self.self_agreeing / len(self.reply),
            "perplexity_verispec": perplexity(self.verispec_nll),
            "perplexity_llamacpp": perplexity(self.llamacpp_nll),
            "tokenizer_difference": self.tokenizer_difference,
        }


def compare_reply(
    model: HFCausalLM,
    reference: Reference,
    prompt: PromptIds,
    max_new_tokens: int,
    eos_ids: frozenset[int],
) -> ReplyComparison:
    """llama.cpp's greedy reply to one prompt, scored by both models over the same ids."""
    theirs = reference.tokenize(prompt.text, prompt.add_special)
    reply, _seconds = reference.generate(prompt.ids, max_new_tokens, eos_ids)
    if not reply:
        raise VerispecError("llama.cpp returned an empty reply")
    outside = [t for t in reply if not 0 <= t < model.vocab_size]
    if outside:
        raise VerispecError(
            f"llama.cpp's reply has token ids outside {model.name}'s vocabulary of {model.vocab_size}: "
            f"{outside[:5]}; is the GGUF the one the target was made from?"
        )
    llamacpp_nll, llamacpp_top = reference.score(prompt.ids, reply)
    verispec_top, verispec_nll = token_scores(teacher_force(model, prompt.ids, reply), reply)
    return ReplyComparison(
        dataset=prompt.prompt.dataset,
        id=prompt.prompt.id,
        prompt_tokens=len(prompt.ids),
        reply=reply,
        verispec_top=verispec_top,
        verispec_nll=verispec_nll,
        llamacpp_top=llamacpp_top,
        llamacpp_nll=llamacpp_nll,
        tokenizer_difference=first_difference(prompt.ids, theirs),
    )


@dataclass
class LlamaCppQualityReport:
    """verispec's model against llama.cpp's greedy replies on the same GGUF (module docstring)."""

    target: str
    quantization: str
    gguf: str
    llamacpp_version: str
    threads: int
    max_new_tokens: int
    datasets: list[str]
    replies: list[ReplyComparison]
    skipped: list[str] = field(default_factory=list)
    """``dataset/id: reason`` of every prompt that could not be compared."""

    @property
    def positions(self) -> int:
        return sum(len(r.reply) for r in self.replies)

    @property
    def agreement(self) -> float:
        return sum(r.agreeing for r in self.replies) / self.positions

    @property
    def llamacpp_self_agreement(self) -> float:
        return sum(r.self_agreeing for r in self.replies) / self.positions

    @property
    def perplexity_verispec(self) -> float:
        return perplexity([x for r in self.replies for x in r.verispec_nll])

    @property
    def perplexity_llamacpp(self) -> float:
        return perplexity([x for r in self.replies for x in r.llamacpp_nll])

    @property
    def perplexity_change(self) -> float:
        """verispec's perplexity of the replies relative to llama.cpp's (0: the same)."""
        return self.perplexity_verispec / self.perplexity_llamacpp - 1.0

    @property
    def tokenizer_mismatches(self) -> list[str]:
        return [f"{r.dataset}/{r.id}" for r in self.replies if r.tokenizer_difference is not None]

    def to_dict(self) -> dict[str, object]:
        return {
            "reference": "llamacpp",
            "target": self.target,
            "quantization": self.quantization,
            "gguf": self.gguf,
            "llamacpp_version": self.llamacpp_version,
            "threads": self.threads,
            "max_new_tokens": self.max_new_tokens,
            "datasets": self.datasets,
            "prompts": len(self.replies),
            "positions": self.positions,
            "agreement": self.agreement,
            "llamacpp_self_agreement": self.llamacpp_self_agreement,
            "perplexity_verispec": self.perplexity_verispec,
            "perplexity_llamacpp": self.perplexity_llamacpp,
            "perplexity_change": self.perplexity_change,
            "tokenizer_mismatches": self.tokenizer_mismatches,
            "skipped": self.skipped,
            "per_prompt": [r.to_dict() for r in self.replies],
        }

    def summary(self) -> str:
        lines = [
            f"{self.target} {self.quantization} vs llama.cpp {self.llamacpp_version} on "
            f"{Path(self.gguf).name}: greedy agreement {self.agreement:.2%} over {self.positions} "
            f"positions of llama.cpp's replies to {len(self.replies)} prompts "
            f"({', '.join(self.datasets)}; llama.cpp itself, teacher-forced, "
            f"{self.llamacpp_self_agreement:.2%}); reply perplexity llama.cpp "
            f"{self.perplexity_llamacpp:.3f}, verispec {self.perplexity_verispec:.3f} "
            f"({self.perplexity_change:+.2%})"
        ]
        mismatches = self.tokenizer_mismatches
        if mismatches:
            lines.append(
                f"TOKENIZERS DIFFER on {len(mismatches)} of {len(self.replies)} prompts "
                f"({', '.join(mismatches[:3])}{', ...' if len(mismatches) > 3 else ''}): llama.cpp "
                "tokenizes the prompt text differently; verispec's ids went to both models"
            )
        else:
            lines.append(f"tokenizers agree on all {len(self.replies)} prompts")
        lines += [f"skipped {line}" for line in self.skipped]
        return "\n".join(lines)


def compare_replies(
    model: HFCausalLM,
    reference: Reference,
    prompts: Sequence[PromptIds],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    context: int,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[ReplyComparison], list[str]]:
    """Every prompt that fits ``context`` compared; the others, and any a llama.cpp process failed
    on (it restarts for the next), listed as ``dataset/id: reason``. ``progress`` hears of each
    prompt as it starts (a long prompt on a big model takes a while on both sides)."""
    replies: list[ReplyComparison] = []
    skipped: list[str] = []
    for number, prompt in enumerate(prompts, 1):
        name = f"{prompt.prompt.dataset}/{prompt.prompt.id}"
        if progress is not None:
            progress(f"prompt {number}/{len(prompts)}: {name}, {len(prompt.ids)} tokens")
        if len(prompt.ids) + max_new_tokens > context:
            skipped.append(
                f"{name}: {len(prompt.ids)} prompt + {max_new_tokens} new tokens exceed the context of "
                f"{context}"
            )
            continue
        try:
            replies.append(compare_reply(model, reference, prompt, max_new_tokens, eos_ids))
        except VerispecError as exc:
            skipped.append(f"{name}: {exc}")
    return replies, skipped


def _to_stderr(line: str) -> None:
    print(f"verispec bench quality: {line}", file=sys.stderr, flush=True)


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def measure_against_llamacpp(
    target: str,
    quantization: str = "int8",
    datasets: Sequence[str] = DEFAULT_DATASETS,
    limit: int = 10,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    threads: int | None = None,
    data_dir: Path | None = None,
) -> LlamaCppQualityReport:
    """Load ``target`` in verispec and its GGUF in llama.cpp, and compare them on llama.cpp's replies."""
    from verispec.config import ModelLoadConfig
    from verispec.models import load_model

    if not llamacpp_installed():
        raise VerispecError(f"--reference llamacpp needs llama.cpp: {LLAMACPP_MISSING}")
    if max_new_tokens < 1:
        raise VerispecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    gguf = gguf_source(target)
    if gguf is None:
        raise VerispecError(
            f"no GGUF file for {target}: --reference llamacpp runs the GGUF the target comes from "
            "(a bundled model's name or a .gguf path)"
        )
    bench_prompts = quality_prompts(datasets, limit, data_dir)
    model = load_model(target, ModelLoadConfig(quantization=quantization, threads=threads))  # type: ignore[arg-type]
    if model.tokenizer is None:
        raise VerispecError(f"{target} has no tokenizer; quality needs text")
    prompts = [prompt_ids(model.tokenizer, p) for p in bench_prompts]
    context = context_size(prompts, max_new_tokens, model.max_context)
    n_threads = threads or torch.get_num_threads()  # the same threads as verispec's model
    worker = ScoringWorker(
        {
            "model_path": str(gguf),
            "n_ctx": context,
            "n_batch": min(context, N_BATCH),
            "n_threads": n_threads,
            "num_pred_tokens": None,
            "logits_all": True,
        }
    )
    worker.start()
    try:
        eos = frozenset(model.eos_token_ids | {worker.ready["eos"]})
        replies, skipped = compare_replies(
            model, worker, prompts, max_new_tokens, eos, context, progress=_to_stderr
        )
    finally:
        worker.stop()
    if not replies:
        raise VerispecError("no prompt could be compared:\n" + "\n".join(skipped))
    return LlamaCppQualityReport(
        target=target,
        quantization=quantization,
        gguf=str(gguf),
        llamacpp_version=importlib.metadata.version("llama-cpp-python"),
        threads=n_threads,
        max_new_tokens=max_new_tokens,
        datasets=list(datasets),
        replies=replies,
        skipped=skipped,
    )
