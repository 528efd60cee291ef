"""Hugging Face transformers ``generate`` as a baseline: plain, assisted (draft model), prompt lookup.

They run on the very weights verispec's engines use (``HFCausalLM.model``), so the comparison is
of decoding loops, not of models or kernels. Greedy is forced explicitly (the model's own generation
config may ask for sampling); everything else stays at the library's defaults, because those are
what a user picking transformers would get, and the report lists them.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from verispec.bench.contenders import Contender, Skipped
from verispec.bench.records import Turn
from verispec.bench.settings import PLAIN, BenchSettings
from verispec.models.hf import HFCausalLM

HF_BASELINES = ("hf", "hf-assisted", "hf-pld")


class HFGenerateContender:
    """``model.generate`` on one prompt at a time, greedy, timed around the call."""

    def __init__(
        self, name: str, target: HFCausalLM, references: tuple[str, ...], extra: dict[str, Any] | None = None
    ) -> None:
        self.name = name
        self.target = target
        self.references = references
        self.assistant = (extra or {}).get("assistant_model")
        self.config = copy.deepcopy(target.model.generation_config)
        eos = sorted(target.eos_token_ids)
        self.config.update(
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            eos_token_id=eos or None,
            pad_token_id=self.config.pad_token_id
            if self.config.pad_token_id is not None
            else (eos or [0])[0],
        )
        if "prompt_lookup_num_tokens" in (extra or {}):
            self.config.prompt_lookup_num_tokens = extra["prompt_lookup_num_tokens"]  # type: ignore[index]
        self.description: dict[str, object] = {"backend": "transformers generate", "greedy": True}
        if self.config.prompt_lookup_num_tokens:
            self.description["prompt_lookup_num_tokens"] = self.config.prompt_lookup_num_tokens
            self.description["max_matching_ngram_size"] = (
                self.config.max_matching_ngram_size or 2
            )  # its default
        if self.assistant is not None:
            self.description["assistant_model"] = (extra or {}).get("assistant_name")
            for key in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            ):
                self.description[key] = _effective(self.assistant.generation_config, key)

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Turn:
        config = copy.deepcopy(self.config)
        config.max_new_tokens = max_new_tokens
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)  # [1, P]
        kwargs: dict[str, Any] = {"generation_config": config, "attention_mask": torch.ones_like(input_ids)}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.target.model.generate(input_ids, **kwargs)  # [1, P + new]
        new_ids = out[0, len(prompt_ids) :].tolist()  # inside the timing: on a GPU this waits for the result
        seconds = time.perf_counter() - started
        return Turn(prompt_tokens=len(prompt_ids), token_ids=new_ids, seconds=seconds)


def _effective(config: Any, key: str) -> object:
    """A generation setting as transformers will use it: the config's value, else its global default."""
    value = getattr(config, key, None)
    if value is None and hasattr(config, "_get_default_generation_params"):
        value = config._get_default_generation_params().get(key)
    return value


def hf_contender(
    name: str, settings: BenchSettings, target: HFCausalLM, draft: HFCausalLM | None
) -> Contender | Skipped:
    """The transformers baseline ``name`` (one of :data:`HF_BASELINES`), or why it can't run."""
    if name == "hf":
        return HFGenerateContender(name, target, references=(PLAIN,))
    if name == "hf-pld":
        extra = {"prompt_lookup_num_tokens": settings.prompt_lookup_tokens}
        return HFGenerateContender(name, target, references=("hf", PLAIN), extra=extra)
    if name == "hf-assisted":
        if draft is None:
            return Skipped(name, "needs a draft model (--draft)")
        extra = {"assistant_model": draft.model, "assistant_name": draft.name}
        return HFGenerateContender(name, target, references=("hf", PLAIN), extra=extra)
    raise ValueError(f"not a transformers baseline: {name}")
