"""The benchmark run: load once, warm up, time every contender on every prompt, check losslessness.

Methodology (Spec-Bench's): greedy decoding, batch 1, a few untimed warm-up generations per
contender before any timing, wall time of each whole generation (prefill included), and speedups
against plain decoding of the same target on the same prompts in the same run.

The target (and draft) are loaded once; every verispec method is an engine over those same weights,
and the transformers baselines call ``generate`` on them too. Contenders run interleaved, prompt by
prompt (every contender on prompt 1, then on prompt 2, ...), so a slow phase of a shared machine
hits all of them alike instead of whichever method happened to run then.

Multi-turn prompts: each contender answers turn 1, its own answer is appended as the assistant
message, then it answers turn 2; both turns are timed. The lossless check compares the tokens of all
turns with the reference's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

import torch
from tqdm import tqdm

from verispec.bench import environment
from verispec.bench.aggregate import Summary, summarize
from verispec.bench.contenders import Contender, Skipped, engine_contenders
from verispec.bench.datasets import BenchPrompt, load_dataset
from verispec.bench.hf_baselines import HF_BASELINES, hf_contender
from verispec.bench.llamacpp_baselines import llamacpp_contender
from verispec.bench.records import PromptRecord, Turn
from verispec.bench.settings import WARMUP_PROMPT, BenchSettings
from verispec.config import SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.models import load_model
from verispec.models.hf import HFCausalLM


@dataclass
class BenchRun:
    """Everything a run produced; :mod:`verispec.bench.report` turns it into files and tables."""

    settings: BenchSettings
    command: str
    records: list[PromptRecord]
    summaries: list[Summary]
    contenders: dict[str, dict[str, object]]
    skipped: list[Skipped]
    models: dict[str, Any]
    environment: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0


def select_prompts(settings: BenchSettings) -> list[BenchPrompt]:
    """The evaluation prompts, deterministically (file order; no shuffling, no picking)."""
    prompts: list[BenchPrompt] = []
    for dataset, categories in settings.categories_by_dataset().items():
        prompts += load_dataset(
            dataset,  # type: ignore[arg-type]
            data_dir=settings.data_dir,
            limit_per_category=settings.limit_per_category,
            categories=categories,
        )
    if not prompts:
        raise VerispecError("no prompts selected; check --dataset, --categories and --limit")
    return prompts


def run_bench(settings: BenchSettings, command: str = "", progress: bool = True) -> BenchRun:
    """Run the whole benchmark described by ``settings``."""
    started = time.perf_counter()
    machine = environment.machine()  # before loading: the load average says how busy others keep it
    prompts = select_prompts(settings)  # before loading: a bad --data-dir fails in a second
    target = load_model(settings.target, settings.load)
    needs_draft = "draft" in settings.methods or "hf-assisted" in settings.baselines
    draft = load_model(settings.draft, settings.load) if needs_draft and settings.draft else None
    contenders, skipped = build_contenders(settings, target, draft)
    prompter = Prompter(SpecEngine(target, None, SpecConfig(), tokenizer=target.tokenizer))
    prompter.check(prompts)

    for contender in contenders:
        for _ in range(settings.warmup):
            run_prompt(contender, prompter, _warmup_prompt(prompter), settings.max_new_tokens)
    records = measure(contenders, prompts, prompter, settings.max_new_tokens, progress)
    check_lossless(records, contenders)
    return BenchRun(
        settings=settings,
        command=command,
        records=records,
        summaries=summarize(records),
        contenders={c.name: c.description for c in contenders},
        skipped=skipped,
        models=_models(target, draft),
        environment={
            "machine": {
                **machine,
                "torch_threads": torch.get_num_threads(),
                "load_average_end": environment.load_average(),
            },
            "versions": environment.versions(),
            "git_commit": environment.git_commit(),
        },
        wall_seconds=time.perf_counter() - started,
    )


def build_contenders(
    settings: BenchSettings, target: HFCausalLM, draft: HFCausalLM | None
) -> tuple[list[Contender], list[Skipped]]:
    """verispec's methods (plain first), then every requested baseline that can run here."""
    contenders: list[Contender] = list(engine_contenders(settings, target, draft))
    skipped: list[Skipped] = []
    for name in settings.baselines:
        if name in HF_BASELINES:
            built = hf_contender(name, settings, target, draft)
        else:
            built = llamacpp_contender(name, settings, target)
        if isinstance(built, Skipped):
            skipped.append(built)
        else:
            contenders.append(built)
    return contenders, skipped


class Prompter:
    """Turns a prompt's turns into token ids the same way for every contender (the target's tokenizer).

    It borrows a plain engine's chat template and encoder, so prompts are exactly those that
    ``verispec generate`` would send.
    """

    def __init__(self, engine: SpecEngine) -> None:
        if engine.tokenizer is None:
            raise VerispecError(
                f"{engine.target.name} has no tokenizer; the benchmark needs one for its text prompts"
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def check(self, prompts: list[BenchPrompt]) -> None:
        """Fail before any timing if a chat prompt meets a model without a chat template."""
        if any(p.chat for p in prompts) and not getattr(self.tokenizer, "chat_template", None):
            raise VerispecError(
                f"{self.engine.target.name} has no chat template, so it can't run chat prompts; "
                "use --dataset humaneval (raw completion)"
            )

    @property
    def chat(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def ids(self, history: list[dict[str, str]], chat: bool) -> list[int]:
        if chat:
            return self.engine.apply_chat_template(history)
        return self.engine.encode("".join(message["content"] for message in history))

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def run_prompt(
    contender: Contender, prompter: Prompter, prompt: BenchPrompt, max_new_tokens: int
) -> PromptRecord:
    """Every turn of ``prompt``, each answered after the contender's own previous answers."""
    history: list[dict[str, str]] = []
    turns: list[Turn] = []
    for user in prompt.turns:
        history.append({"role": "user", "content": user})
        turn = contender.generate(prompter.ids(history, prompt.chat), max_new_tokens)
        # The answer's text comes from its token ids alone, so equal outputs give equal next turns.
        turn.text = prompter.text(turn.token_ids)
        history.append({"role": "assistant", "content": turn.text})
        turns.append(turn)
    return PromptRecord(
        method=contender.name,
        dataset=prompt.dataset,
        category=prompt.category,
        prompt_id=prompt.id,
        turns=turns,
    )


def measure(
    contenders: list[Contender],
    prompts: list[BenchPrompt],
    prompter: Prompter,
    max_new_tokens: int,
    progress: bool = True,
) -> list[PromptRecord]:
    """Time every contender on every prompt, interleaved prompt by prompt."""
    records: list[PromptRecord] = []
    speeds: dict[str, list[float]] = {c.name: [] for c in contenders}
    bar = tqdm(total=len(prompts) * len(contenders), desc="bench", unit="gen", disable=not progress)
    with bar:
        for i, prompt in enumerate(prompts, 1):
            for contender in contenders:
                record = run_prompt(contender, prompter, prompt, max_new_tokens)
                records.append(record)
                speeds[contender.name].append(record.tokens_per_second)
                bar.set_postfix_str(
                    f"{contender.name} prompt {i}/{len(prompts)} {fmean(speeds[contender.name]):.2f} tok/s",
                    refresh=False,
                )
                bar.update()
    return records


def check_lossless(records: list[PromptRecord], contenders: list[Contender]) -> None:
    """Compare each output with its reference's on the same prompt; mismatches stay in the records."""
    ran = {c.name for c in contenders}
    by_key = {(r.method, r.dataset, r.category, r.prompt_id): r for r in records}
    references = {c.name: next((ref for ref in c.references if ref in ran), None) for c in contenders}
    for record in records:
        reference = references.get(record.method)
        if reference is None:
            continue
        other = by_key.get((reference, record.dataset, record.category, record.prompt_id))
        if other is not None:
            record.check_against(other)


def _warmup_prompt(prompter: Prompter) -> BenchPrompt:
    return BenchPrompt(dataset="warmup", category="warmup", id="0", turns=[WARMUP_PROMPT], chat=prompter.chat)


def _models(target: HFCausalLM, draft: HFCausalLM | None) -> dict[str, Any]:
    def info(model: HFCausalLM) -> dict[str, Any]:
        params = sum(p.numel() for p in model.model.parameters())
        dtype = str(next(model.model.parameters()).dtype).removeprefix("torch.")
        return {
            "name": model.name,
            "parameters": params,
            "dtype": dtype,
            "load_seconds": round(model.load_seconds, 2),
        }

    return {"target": info(target), "draft": info(draft) if draft is not None else None}
