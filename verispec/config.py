"""Configuration: nested, frozen dataclasses, each validated when it is built.

The CLI flags and (later) the server's request schema are derived from these fields, so each field
carries its meaning in a docstring-style comment and its constraints in ``__post_init__``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from verispec.errors import VerispecError

Method = Literal["draft", "ngram", "medusa", "eagle", "medusa+ngram", "eagle+ngram"]
"""Speculation methods with a registered proposer; ``None`` in :class:`SpecConfig` means plain decoding."""

METHODS: tuple[str, ...] = ("draft", "ngram", "medusa", "eagle", "medusa+ngram", "eagle+ngram")

AUTO = "auto"
"""The method asked for when none is named: :func:`verispec.api.default_method` picks one per target."""
PLAIN = "none"
"""The method name of plain decoding (no proposer)."""
MethodChoice = Method | Literal["auto", "none"]
"""What a caller may ask for: a method, ``"none"`` (plain decoding) or ``"auto"`` (none named)."""

Acceptance = Literal["exact", "typical"]
ACCEPTANCES: tuple[str, ...] = ("exact", "typical")

DepthPolicyName = Literal["adaptive", "fixed"]

MAX_SPECULATIVE_TOKENS = 64
"""Upper bound on k: beyond this a draft is all but certain to be rejected and only wastes compute."""
MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask log-probabilities for (OpenAI's ``top_logprobs`` limit)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a token; one transform for the draft, the target and the bonus token."""

    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it before the softmax."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1.0 disables. In (0, 1]."""
    seed: int | None = None
    """Seed of the random generator used for drafting and verification; None draws a fresh one."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise VerispecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise VerispecError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise VerispecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class NgramConfig:
    """Prompt lookup: propose the continuation of the most recent earlier match of the context's tail."""

    max_ngram: int = 4
    """Longest tail (in tokens) to match; tried first."""
    min_ngram: int = 1
    """Shortest tail to match before giving up for this step."""

    def __post_init__(self) -> None:
        if not (1 <= self.min_ngram <= self.max_ngram):
            raise VerispecError(
                f"need 1 <= min_ngram <= max_ngram, got min={self.min_ngram} max={self.max_ngram}"
            )


@dataclass(frozen=True)
class DraftModelConfig:
    """A separate, smaller draft model sharing the target's tokenizer."""

    model: str | None = None
    """Registry name, local Hugging Face folder or .gguf path of the draft model."""
    p_min: float = 0.0
    """Stop drafting this step once the draft's most likely token has probability below p_min
    (llama.cpp's --draft-p-min). 0 always drafts k tokens. The decision uses only the draft's own
    distribution, known before verification, so the output distribution stays exact."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.p_min < 1.0):
            raise VerispecError(f"draft p_min must be in [0, 1), got {self.p_min}")


@dataclass(frozen=True)
class SpecConfig:
    """What to speculate with and how deep."""

    method: Method | None = None
    """Proposer name from the registry, or None for plain decoding."""
    num_speculative_tokens: int = 5
    """k: draft tokens proposed per step (the maximum, once a depth policy exists)."""
    ngram: NgramConfig = field(default_factory=NgramConfig)
    draft: DraftModelConfig = field(default_factory=DraftModelConfig)
    depth: DepthPolicyName = "adaptive"
    """'adaptive': k per sequence and step from measured costs and the sequence's acceptance, up to
    num_speculative_tokens (see verispec.policy); 'fixed': always num_speculative_tokens."""
    disable_by_batch_size: int | None = None
    """Speculate only while fewer than this many sequences decode together (vLLM's
    --speculative-disable-by-batch-size); None never disables."""
    heads: str | None = None
    """Folder of trained heads for ``medusa``/``eagle`` (and ``medusa+ngram``/``eagle+ngram``, see
    verispec.heads.io); None takes the heads shipped for the target, if any."""
    tree_nodes: int | None = None
    """Most draft-tree nodes per step for ``medusa``/``eagle``; None takes the heads' default."""
    tree_width: int | None = None
    """Candidates per tree level (top-k of a head) for ``medusa``/``eagle``; None: the heads' default."""
    acceptance: Acceptance = "exact"
    """'exact': the output follows the target's distribution (greedy: equals plain decoding).
    'typical': Medusa's typical acceptance, LOSSY: at temperature > 0 a draft token is kept when the
    target finds it plausible enough, so the output no longer follows the target's distribution
    (see verispec.verify.typical). Greedy decoding is exact either way."""

    def describe(self, *, by_default: bool = False) -> str:
        """The method and depth in a few words, for a summary or start-up line (``by_default``: the
        method was not named but chosen for the target)."""
        if self.method is None:
            return f"method {PLAIN} (plain decoding)"
        chosen = " (default)" if by_default else ""
        k = self.num_speculative_tokens
        depth = f"adaptive depth up to k={k}" if self.depth == "adaptive" else f"fixed k={k}"
        return f"method {self.method}{chosen}, {depth}"

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCES:
            raise VerispecError(f"acceptance must be exact or typical, got {self.acceptance!r}")
        for name in ("tree_nodes", "tree_width"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise VerispecError(f"{name} must be >= 1, got {value}")
        if self.depth not in ("adaptive", "fixed"):
            raise VerispecError(f"depth policy must be adaptive or fixed, got {self.depth!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise VerispecError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.method is not None and self.method not in METHODS:
            raise VerispecError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)} or none")
        if not (1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise VerispecError(
                f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )


@dataclass(frozen=True)
class ModelLoadConfig:
    """Where and how to run a model."""

    device: str = "cpu"
    """'cpu', 'cuda' or 'cuda:N'."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype; GGUF weights are de-quantized into it."""
    threads: int | None = None
    """CPU threads for PyTorch; None keeps PyTorch's default."""
    quantization: Literal["auto", "none", "int8", "int4", "gguf"] = "auto"
    """Weight quantization at load: 'auto' = a GGUF model's own blocks on CPU where the GGUF kernel
    has a vector build, else int8 on CPU (prepacked fbgemm kernels), none on CUDA;
    'int4' = 4-bit weights with verispec's own kernel (AVX-512 VNNI or AVX2; LM head int8);
    'gguf' = a GGUF model's own blocks, as the file stores them (see verispec.models.gguf_native)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise VerispecError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "int4", "gguf"):
            raise VerispecError(
                f"quantization must be auto, none, int8, int4 or gguf, got {self.quantization!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise VerispecError(f"threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How many sequences decode together and how many may wait behind them."""

    max_batch_size: int = 8
    """Sequences decoding together; more requests wait in the queue."""
    max_waiting: int = 64
    """Requests allowed to wait behind a full batch; beyond it a request is refused (HTTP 429 with
    Retry-After). Requests that free batch slots will take at the next step do not count."""
    prefill_chunk: int = 512
    """Prompt tokens fed per step: a long prompt is prefilled over several steps, so the running
    sequences keep producing tokens meanwhile."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_waiting", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise VerispecError(f"{name} must be >= 1, got {getattr(self, name)}")
