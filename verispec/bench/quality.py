"""What the int8 fast path costs in quality, measured against the same model in float32.

Speculation on the int8 path is exact with respect to the int8 model; what changes is the model
itself. Two numbers say by how much, both teacher-forced (one forward per text, no generation, so
they are cheap and deterministic):

- greedy agreement: the share of positions where the int8 model's most likely next token equals the
  float32 model's, over HumanEval prompts followed by their reference solutions;
- perplexity of both models on a held-out text that no model here was tuned on: the source of a
  Python standard-library module (code, like the main use case).
"""

from __future__ import annotations

import inspect
import math
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.bench.datasets import load_dataset
from verispec.config import ModelLoadConfig
from verispec.models import load_model
from verispec.models.hf import HFCausalLM

HELD_OUT_MODULE = textwrap
"""Held-out text for perplexity: this stdlib module's source (PSF license), cut to ``max_tokens``."""


@dataclass
class QualityReport:
    target: str
    quantization: str
    agreement: float
    """Share of positions where both models' argmax agree (HumanEval prompt + solution)."""
    agreement_positions: int
    prompts: int
    perplexity_float32: float
    perplexity_quantized: float
    perplexity_tokens: int

    @property
    def perplexity_change(self) -> float:
        return self.perplexity_quantized / self.perplexity_float32 - 1.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "perplexity_change": self.perplexity_change}

    def summary(self) -> str:
        return (
            f"{self.target} {self.quantization} vs float32: greedy agreement {self.agreement:.2%} over "
            f"{self.agreement_positions} positions of {self.prompts} HumanEval prompts+solutions; "
            f"perplexity on {self.perplexity_tokens} held-out tokens {self.perplexity_float32:.3f} -> "
            f"{self.perplexity_quantized:.3f} ({self.perplexity_change:+.2%})"
        )


def all_logits(model: HFCausalLM, ids: list[int]) -> torch.Tensor:
    """[S, V] logits at every position of ``ids`` in one forward."""
    return model.forward(torch.tensor([ids]), model.new_cache(), logits_to_keep=0).logits[0]


def negative_log_likelihood(logits: torch.Tensor, ids: list[int]) -> float:
    """Summed NLL of ids[1:] given the logits at positions [:-1]."""
    targets = torch.tensor(ids[1:])
    return float(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum"))


def measure_quality(
    target: str,
    quantization: str = "int8",
    limit: int = 20,
    max_tokens: int = 1024,
    threads: int | None = None,
    data_dir: Path | None = None,
) -> QualityReport:
    """Load ``target`` in float32 and quantized, and compare them on the same texts."""
    reference = load_model(target, ModelLoadConfig(quantization="none", threads=threads))
    quantized = load_model(target, ModelLoadConfig(quantization=quantization, threads=threads))  # type: ignore[arg-type]
    tok = reference.tokenizer
    if tok is None:
        raise ValueError(f"{target} has no tokenizer; quality needs text")
    agree = positions = 0
    prompts = load_dataset("humaneval", data_dir=data_dir, limit=limit)
    solutions = _humaneval_solutions(data_dir)
    for prompt in prompts:
        ids = tok.encode(prompt.turns[0] + solutions.get(prompt.id, ""))[:max_tokens]
        ref_top = all_logits(reference, ids).argmax(-1)
        q_top = all_logits(quantized, ids).argmax(-1)
        agree += int((ref_top == q_top).sum())
        positions += len(ids)
    held = tok.encode(inspect.getsource(HELD_OUT_MODULE))[:max_tokens]
    nll_ref = negative_log_likelihood(all_logits(reference, held), held)
    nll_q = negative_log_likelihood(all_logits(quantized, held), held)
    count = len(held) - 1
    return QualityReport(
        target=target,
        quantization=quantization,
        agreement=agree / positions,
        agreement_positions=positions,
        prompts=len(prompts),
        perplexity_float32=math.exp(nll_ref / count),
        perplexity_quantized=math.exp(nll_q / count),
        perplexity_tokens=count,
    )


def _humaneval_solutions(data_dir: Path | None) -> dict[str, str]:
    """Reference solutions by task id, read from the same file as the prompts."""
    import gzip
    import json

    from verispec.bench.datasets import default_data_dir

    path = (data_dir or default_data_dir()) / "humaneval" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {row["task_id"]: row.get("canonical_solution", "") for row in rows}
