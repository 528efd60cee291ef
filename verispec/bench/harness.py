"""The benchmark run: load once, warm up, time every contender on every prompt, check losslessness.

Methodology (Spec-Bench's): greedy decoding, batch 1, a few untimed warm-up generations per
contender before any timing, wall time of each whole generation (prefill included), and speedups
against plain decoding of the same target on the same prompts in the same run.

The target (and draft) are loaded once; every verispec method is an engine over those same weights,
and the transformers baselines call ``generate`` on them too. Contenders run interleaved, prompt by
prompt (every contender on prompt 1, then on prompt 2, ...), so a slow phase of a shared machine
hits all of them alike instead of whichever method happened to run then.

Multi-turn prompts: each contender answers turn 1, its own answer is appended as the assistant
message (with what a workload adds after it, e.g. a tool's result), then it answers turn 2; every
turn is timed, with its time to first token (verispec's methods: from submitting the turn to its
first streamed token). The lossless check compares the tokens of all turns with the reference's.

Cross-request reuse: with ``--cache-scope shared`` (the default) every request of a contender
carries that contender's cache scope, so a later prompt or turn may reuse what earlier ones left (a
prefix KV cache, earlier outputs to draft from), as the requests of one user of a deployment do;
contenders never share a scope, and all of them see the same prompts in the same order. ``private``
sends no scope: nothing is reused across requests. Warm-up generations are always private, so
timing starts from an empty scope.

Long runs: every finished record is appended to ``<out>/records.jsonl`` at once, and ``resume``
skips the (method, prompt) pairs already there, so an interrupted run continues in a later process.
A generation that fails with a :class:`VerispecError` (a prompt longer than the context) is recorded
as failed, with its message, and reported; it does not end the run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from tqdm import tqdm

from verispec.bench import environment
from verispec.bench.aggregate import Summary, summarize
from verispec.bench.contenders import Contender, EngineContender, Skipped, engine_contenders
from verispec.bench.datasets import BenchPrompt, load_dataset
from verispec.bench.hf_baselines import HF_BASELINES, hf_contender
from verispec.bench.llamacpp_baselines import llamacpp_contender
from verispec.bench.records import RECORDS_FILE, PromptRecord, RecordLog, Turn
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
    resumed: int = 0
    """Records measured by an earlier, interrupted process and loaded from records.jsonl."""

    @property
    def failed(self) -> list[PromptRecord]:
        return [r for r in self.records if not r.ok]


def select_prompts(settings: BenchSettings) -> list[BenchPrompt]:
    """The evaluation prompts, deterministically (file order, or a seeded shuffle; no picking)."""
    prompts: list[BenchPrompt] = []
    for dataset, categories in settings.categories_by_dataset().items():
        prompts += load_dataset(
            dataset,  # type: ignore[arg-type]
            data_dir=settings.data_dir,
            limit_per_category=settings.limit_per_category,
            categories=categories,
            seed=settings.seed,
        )
    if not prompts:
        raise VerispecError("no prompts selected; check --dataset, --categories and --limit")
    return prompts


# Settings that only choose *which* generations to run: a resumed run may change them (a larger
# --limit, another category), since they do not change how any one generation is measured.
SELECTION_SETTINGS = frozenset(
    [
        "methods",
        "baselines",
        "datasets",
        "categories",
        "categories_by_dataset",
        "limit_per_category",
        "seed",
        "warmup",
    ]
)


def resume_settings(settings: BenchSettings) -> dict[str, Any]:
    """The settings that records.jsonl must share with a run that resumes it."""
    return {k: v for k, v in settings.to_dict().items() if k not in SELECTION_SETTINGS}


def run_bench(
    settings: BenchSettings,
    command: str = "",
    progress: bool = True,
    out_dir: Path | None = None,
    resume: bool = False,
) -> BenchRun:
    """Run the whole benchmark described by ``settings``.

    With ``out_dir``, every record is appended to ``out_dir/records.jsonl`` as soon as it is
    measured; with ``resume`` too, the records already there are kept and not measured again.
    """
    started = time.perf_counter()
    machine = environment.machine(busy=True)  # before loading: how busy others keep the machine
    prompts = select_prompts(settings)  # before loading: a bad --data-dir fails in a second
    raw = sorted({p.dataset for p in prompts if not p.chat})
    if settings.json_schema is not None and raw:  # JSON mode asks for JSON in the user turns
        raise VerispecError(
            f"--json-schema needs chat prompts, and {', '.join(raw)} is raw completion; "
            "use --dataset spec_bench or mt_bench"
        )
    log, previous = None, []
    if out_dir is not None:  # before loading too: so does a --resume with other settings
        log, previous = RecordLog.start(out_dir / RECORDS_FILE, resume_settings(settings), command, resume)
    try:
        target = load_model(settings.target, settings.load)
        needs_draft = "draft" in settings.methods or "hf-assisted" in settings.baselines
        draft = load_model(settings.draft, settings.load) if needs_draft and settings.draft else None
        contenders, skipped = build_contenders(settings, target, draft)
        prompter = Prompter(
            SpecEngine(target, None, SpecConfig(), tokenizer=target.tokenizer), settings.json_instruction()
        )
        prompter.check(prompts)

        wanted = {(c.name, p.dataset, p.category, p.id) for c in contenders for p in prompts}
        previous = [r for r in previous if r.key in wanted]  # records of this run's selection only
        done = {r.key for r in previous}
        todo = [
            c for c in contenders if any((c.name, p.dataset, p.category, p.id) not in done for p in prompts)
        ]
        warm_up(todo, prompter, settings)
        scopes = {c.name: settings.scope_of(c.name) for c in contenders}
        new = measure(contenders, prompts, prompter, settings.max_new_tokens, progress, log, done, scopes)
    finally:
        if log is not None:
            log.close()
    records = _in_run_order(previous + new, contenders, prompts)
    measured = [r for r in records if r.ok]
    check_lossless(measured, contenders)
    return BenchRun(
        settings=settings,
        command=command,
        records=records,
        summaries=summarize(measured),
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
        resumed=len(previous),
    )


def warm_up(contenders: list[Contender], prompter: Prompter, settings: BenchSettings) -> None:
    """Untimed generations of the fixed warm-up prompt, so timing starts on warm kernels; private
    (no cache scope), so they leave nothing a timed prompt could reuse."""
    for contender in contenders:
        for _ in range(settings.warmup):
            warm = run_prompt(contender, prompter, _warmup_prompt(prompter), settings.max_new_tokens)
            if not warm.ok:
                raise VerispecError(f"{contender.name} failed its warm-up generation: {warm.error}")


def build_contenders(
    settings: BenchSettings, target: HFCausalLM, draft: HFCausalLM | None
) -> tuple[list[Contender], list[Skipped]]:
    """verispec's methods (plain first), then every requested baseline that can run here."""
    contenders: list[Contender] = list(engine_contenders(settings, target, draft))
    skipped: list[Skipped] = []
    for name in settings.baselines:
        if settings.json_schema is not None:
            skipped.append(
                Skipped(name, "JSON mode (--json-schema): no grammar-constrained decoding for it here")
            )
            continue
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

    def __init__(self, engine: SpecEngine, instruction: str = "") -> None:
        if engine.tokenizer is None:
            raise VerispecError(
                f"{engine.target.name} has no tokenizer; the benchmark needs one for its text prompts"
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.instruction = instruction
        """Appended to every user turn (JSON mode's request for the schema; '' otherwise)."""

    def check(self, prompts: list[BenchPrompt]) -> None:
        """Fail before any timing if a chat prompt meets a model without a chat template."""
        if any(p.chat for p in prompts) and not getattr(self.tokenizer, "chat_template", None):
            raise VerispecError(
                f"{self.engine.target.name} has no chat template, so it can't run chat prompts; "
                "use --dataset humaneval (raw completion)"
            )

    def user(self, text: str) -> str:
        """A user turn as sent: ``text`` and the instruction, if any."""
        return text + self.instruction

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
    contender: Contender,
    prompter: Prompter,
    prompt: BenchPrompt,
    max_new_tokens: int,
    cache_scope: str | None = None,
) -> PromptRecord:
    """Every turn of ``prompt``, each answered after the contender's own previous answers, every
    request in ``cache_scope`` (None: private).

    A :class:`VerispecError` (the user's data or settings, e.g. a prompt longer than the context)
    ends this prompt only: the record keeps the turns done and the message, and the run goes on.
    """
    history: list[dict[str, str]] = []
    turns: list[Turn] = []
    error = None
    answer = None
    try:
        for index, user in enumerate(prompt.turns):
            history += prompt.before_turn(index, answer)
            history.append({"role": "user", "content": prompter.user(user)})
            ids = prompter.ids(history, prompt.chat)
            turn = generate_turn(contender, ids, max_new_tokens, cache_scope)
            # The answer's text comes from its token ids alone, so equal outputs give equal next turns.
            turn.text = answer = prompter.text(turn.token_ids)
            turns.append(turn)
    except VerispecError as exc:
        error = str(exc)
    return PromptRecord(
        method=contender.name,
        dataset=prompt.dataset,
        category=prompt.category,
        prompt_id=prompt.id,
        turns=turns,
        error=error,
    )


def generate_turn(
    contender: Contender, prompt_ids: list[int], max_new_tokens: int, cache_scope: str | None = None
) -> Turn:
    """One timed generation: verispec's methods in ``cache_scope`` (with their time to the first
    token); the other tools' contenders time the whole call only and have no scope."""
    if isinstance(contender, EngineContender):
        return contender.generate(prompt_ids, max_new_tokens, cache_scope)
    return contender.generate(prompt_ids, max_new_tokens)


def measure(
    contenders: list[Contender],
    prompts: list[BenchPrompt],
    prompter: Prompter,
    max_new_tokens: int,
    progress: bool = True,
    log: RecordLog | None = None,
    done: Container[tuple[str, str, str, str]] = (),
    scopes: Mapping[str, str | None] | None = None,
) -> list[PromptRecord]:
    """Time every contender on every prompt, interleaved prompt by prompt; skip the pairs in ``done``.
    ``scopes`` gives each contender's cache scope by name (none given: private).

    Each record goes to ``log`` as soon as it is measured. If the run stops early (an exception,
    Ctrl-C), a note says how much was saved and how to continue.
    """
    records: list[PromptRecord] = []
    speeds: dict[str, list[float]] = {c.name: [] for c in contenders}
    todo = [
        (i, prompt, contender)
        for i, prompt in enumerate(prompts, 1)
        for contender in contenders
        if (contender.name, prompt.dataset, prompt.category, prompt.id) not in done
    ]
    bar = tqdm(total=len(todo), desc="bench", unit="gen", disable=not progress)
    try:
        with bar:
            for i, prompt, contender in todo:
                scope = (scopes or {}).get(contender.name)
                record = run_prompt(contender, prompter, prompt, max_new_tokens, scope)
                records.append(record)
                if log is not None:
                    log.append(record)
                if record.ok:
                    speeds[contender.name].append(record.tokens_per_second)
                speed = f"{fmean(speeds[contender.name]):.2f} tok/s" if speeds[contender.name] else "failed"
                bar.set_postfix_str(f"{contender.name} prompt {i}/{len(prompts)} {speed}", refresh=False)
                bar.update()
    except BaseException:
        if log is not None:
            print(
                f"verispec: {len(done) + len(records)} generation(s) saved in {log.path}; "
                "run the same command with --resume to continue",
                file=sys.stderr,
            )
        raise
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


def _in_run_order(
    records: list[PromptRecord], contenders: list[Contender], prompts: list[BenchPrompt]
) -> list[PromptRecord]:
    """Records sorted as one uninterrupted run would have made them: by prompt, then by contender."""
    prompt_rank = {(p.dataset, p.category, p.id): i for i, p in enumerate(prompts)}
    contender_rank = {c.name: i for i, c in enumerate(contenders)}
    return sorted(
        records, key=lambda r: (prompt_rank[(r.dataset, r.category, r.prompt_id)], contender_rank[r.method])
    )


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
