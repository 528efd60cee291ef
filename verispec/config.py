"""Configuration: nested, frozen dataclasses, each validated when it is built; the one definition of
every setting.

A field is a setting: its type (a ``Literal`` lists its choices), its default, its bounds
(:func:`bounded`) and, in the docstring under it, what it means. :mod:`verispec.settings` reads them
to make the command-line flags and the server's per-request fields, and checks ``verispec.load``'s
keywords against them, so none of those re-types a default or a bound. A refused value raises
:class:`~verispec.errors.ConfigError` with the setting's public name (:data:`NAMES`), which the CLI
turns into its flag and the server into its request field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from numbers import Integral, Real
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from verispec.errors import ConfigError

T = TypeVar("T")

Method = Literal[
    "draft",
    "ngram",
    "suffix",
    "medusa",
    "eagle",
    "eagle3",
    "medusa+ngram",
    "eagle+ngram",
    "eagle3+ngram",
    "medusa+suffix",
    "eagle+suffix",
    "eagle3+suffix",
]
"""Speculation methods with a registered proposer; ``None`` in :class:`SpecConfig` means plain decoding."""

METHODS: tuple[str, ...] = get_args(Method)

AUTO = "auto"
"""The method asked for when none is named: :func:`verispec.api.default_method` picks one per target."""
PLAIN = "none"
"""The method name of plain decoding (no proposer)."""
MethodChoice = Method | Literal["auto", "none"]
"""What a caller may ask for: a method, ``"none"`` (plain decoding) or ``"auto"`` (none named)."""

Acceptance = Literal["exact", "typical"]
ACCEPTANCES: tuple[str, ...] = get_args(Acceptance)

DepthPolicyName = Literal["adaptive", "fixed"]
DType = Literal["float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "int8", "int4", "gguf"]

MAX_SPECULATIVE_TOKENS = 64
"""Upper bound on k: beyond this a draft is all but certain to be rejected and only wastes compute."""
MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask log-probabilities for (OpenAI's ``top_logprobs`` limit)."""


@dataclass(frozen=True)
class Name:
    """What a field is called outside its dataclass."""

    public: str
    """``verispec.load``'s keyword, the flag's argparse ``dest`` and :attr:`ConfigError.field`."""
    flags: tuple[str, ...] = ()
    """The command-line spellings; empty: ``--`` and the public name with dashes."""


NAMES: dict[str, Name] = {
    "SpecConfig.num_speculative_tokens": Name("num_speculative_tokens", ("-k", "--num-speculative-tokens")),
    "SpecConfig.depth": Name("depth", ("--depth-policy",)),
    "SpecConfig.disable_by_batch_size": Name(
        "disable_by_batch_size", ("--speculative-disable-by-batch-size",)
    ),
    "NgramConfig.max_ngram": Name("ngram_max"),
    "NgramConfig.min_ngram": Name("ngram_min"),
    "SuffixConfig.max_pattern": Name("suffix_max_pattern"),
    "SuffixConfig.min_prob": Name("suffix_min_prob"),
    "SuffixConfig.spec_factor": Name("suffix_spec_factor"),
    "SuffixConfig.cache_tokens": Name("suffix_cache_tokens"),
    "DraftModelConfig.model": Name("draft"),
    "DraftModelConfig.p_min": Name("draft_p_min"),
}
"""The one table of names: ``Class.field`` to its public name and flags, for every field whose
public name or flag is not simply its own (nested fields get a prefix, as ``ngram.max_ngram`` is
``ngram_max`` and ``--ngram-max``; vLLM's and llama.cpp's spellings are kept where users know them)."""


def name_of(owner: type, field_name: str) -> Name:
    """The public name and flags of ``owner``'s field ``field_name``."""
    found = NAMES.get(f"{owner.__name__}.{field_name}")
    return found if found is not None else Name(field_name)


@dataclass(frozen=True)
class Bounds:
    """Inclusive (``ge``, ``le``) and exclusive (``gt``, ``lt``) limits of a number."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, value: float) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self) -> str:
        """``>= 1``, ``between 1 and 64``, ``in (0, 1]``: the words of a refusal and of a flag's help."""
        low, high = self.ge if self.ge is not None else self.gt, self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            if self.ge is not None and self.le is not None:
                return f"between {low:g} and {high:g}"
            opened, closed = "[" if self.ge is not None else "(", "]" if self.le is not None else ")"
            return f"in {opened}{low:g}, {high:g}{closed}"
        if low is not None:
            return f"{'>=' if self.ge is not None else '>'} {low:g}"
        if high is not None:
            return f"{'<=' if self.le is not None else '<'} {high:g}"
        return "any number"

    def constraints(self) -> dict[str, float]:
        """The limits that are set, as keyword arguments (pydantic's ``Field`` takes the same names)."""
        limits = (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt))
        return {name: value for name, value in limits if value is not None}


def bounded(
    default: T,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> T:
    """A field with ``default`` whose value must lie within the bounds (None: no limit on that side;
    a None value, where the type allows it, always passes)."""
    return field(default=default, metadata={"bounds": Bounds(ge=ge, gt=gt, le=le, lt=lt)})  # type: ignore[return-value]


@dataclass(frozen=True)
class FieldType:
    """A field's type as a setting sees it: one scalar kind, its choices and whether None is allowed."""

    kind: type
    """int, float, str or bool."""
    optional: bool
    choices: tuple[Any, ...] | None = None


@cache
def field_types(cls: type) -> dict[str, FieldType | type]:
    """``cls``'s scalar fields as :class:`FieldType`, and its nested config dataclasses as classes."""
    out: dict[str, FieldType | type] = {}
    hints = get_type_hints(cls)
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            out[f.name] = hint  # type: ignore[assignment]
            continue
        members = get_args(hint) if get_origin(hint) in (Union, type(int | None)) else (hint,)
        optional = type(None) in members
        (rest,) = [m for m in members if m is not type(None)]
        if get_origin(rest) is Literal:
            choices = get_args(rest)
            out[f.name] = FieldType(type(choices[0]), optional, choices)
        else:
            out[f.name] = FieldType(rest, optional)
    return out


def check_fields(config: Any) -> None:
    """Refuse a field of ``config`` that is of the wrong kind, not among its choices or out of its
    bounds, with a :class:`ConfigError` that carries the field's public name."""
    cls = type(config)
    for f in fields(cls):
        kind = field_types(cls)[f.name]
        if not isinstance(kind, FieldType):
            continue
        value = getattr(config, f.name)
        name = name_of(cls, f.name).public
        if value is None:
            if not kind.optional:
                raise ConfigError(name, "must be set")
            continue
        if kind.choices is not None:
            if value not in kind.choices:
                listed = ", ".join(map(str, kind.choices)) + (" or None" if kind.optional else "")
                raise ConfigError(name, f"must be one of {listed}, got {value!r}")
            continue
        if kind.kind is int and (isinstance(value, bool) or not isinstance(value, Integral)):
            raise ConfigError(name, f"must be an integer, got {value!r}")
        if kind.kind is float and (isinstance(value, bool) or not isinstance(value, Real)):
            raise ConfigError(name, f"must be a number, got {value!r}")
        bounds = f.metadata.get("bounds")
        if bounds is not None and not (math.isfinite(value) and bounds.holds(value)):
            raise ConfigError(name, f"must be {bounds.describe()}, got {value}")


class _Checked:
    """Base of the config dataclasses: every field is checked against its type and bounds when built."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SamplingConfig(_Checked):
    """How logits become a token; one transform for the draft, the target and the bonus token."""

    temperature: float = bounded(0.0, ge=0)
    """Logits are divided by it before the softmax; 0 decodes greedily (the most likely token)."""
    top_k: int = bounded(0, ge=0)
    """Sample only among the k most likely tokens; 0 keeps them all."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Sample only among the most likely tokens whose probabilities add up to top_p; 1 keeps them all."""
    seed: int | None = None
    """Seed of the random generator used for drafting and verification; None draws a fresh one."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class NgramConfig(_Checked):
    """Prompt lookup: propose the continuation of the most recent earlier match of the context's tail."""

    max_ngram: int = bounded(4, ge=1)
    """Longest tail of the context, in tokens, that prompt lookup matches; tried first."""
    min_ngram: int = bounded(1, ge=1)
    """Shortest tail of the context that prompt lookup matches before giving up for this step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_ngram > self.max_ngram:
            raise ConfigError(
                name_of(NgramConfig, "min_ngram").public,
                f"must be at most ngram_max ({self.max_ngram}), got {self.min_ngram}",
            )


@dataclass(frozen=True)
class SuffixConfig(_Checked):
    """Suffix decoding: a tree of what followed the context's tail in this request and in earlier
    outputs of its cache scope (see :mod:`verispec.proposers.suffix`)."""

    max_pattern: int = bounded(24, ge=1, le=256)
    """Longest tail of the context, in tokens, that suffix decoding matches (longer is more specific)."""
    min_prob: float = bounded(0.1, gt=0, le=1)
    """Draft a tree node only if at least this share of the matched occurrences continue with its path."""
    spec_factor: float = bounded(1.0, gt=0)
    """Most draft tokens per matched token: a match of m tokens proposes at most ceil(factor * m)
    (a short match is weak evidence), and never more than k deep."""
    cache_tokens: int = bounded(1_000_000, ge=2)
    """Tokens of earlier requests' outputs kept for suffix decoding, all cache scopes together (50 to
    60 bytes each); the oldest outputs are dropped first. Requests without a cache scope use none."""


@dataclass(frozen=True)
class DraftModelConfig(_Checked):
    """A separate, smaller draft model sharing the target's tokenizer."""

    model: str | None = None
    """The draft model for method draft, with the target's vocabulary: a registry name, a Hugging
    Face folder or a .gguf file."""
    p_min: float = bounded(0.0, ge=0, lt=1)
    """Stop drafting this step once the draft's most likely token is less likely than this
    (llama.cpp's --draft-p-min); 0 always drafts k tokens. It looks only at the draft's own
    distribution, known before verification, so the output stays exact."""


@dataclass(frozen=True)
class SpecConfig(_Checked):
    """What to speculate with and how deep."""

    method: Method | None = None
    """How to draft: draft (a draft model), ngram (prompt lookup), suffix (suffix decoding: this
    request's text and its cache scope's earlier outputs), medusa or eagle (trained heads), eagle3
    (an EAGLE-3 drafter in the speculators or research format, ``heads`` its folder), heads plus
    prompt lookup (medusa+ngram, eagle+ngram, eagle3+ngram) or heads plus suffix decoding
    (medusa+suffix, eagle+suffix, eagle3+suffix); None decodes plainly (``none`` on the command line
    and in ``verispec.load``). Asking for ``auto`` lets
    :func:`verispec.api.default_method` pick for the target: draft with a draft model, else
    eagle+suffix where EAGLE heads are shipped or given, else suffix."""
    num_speculative_tokens: int = bounded(5, ge=1, le=MAX_SPECULATIVE_TOKENS)
    """k: the most draft tokens proposed per sequence and step."""
    ngram: NgramConfig = field(default_factory=NgramConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    draft: DraftModelConfig = field(default_factory=DraftModelConfig)
    depth: DepthPolicyName = "adaptive"
    """adaptive: k per sequence and step, up to num_speculative_tokens, from measured costs and the
    sequence's acceptance (see :mod:`verispec.policy`); fixed: always num_speculative_tokens."""
    disable_by_batch_size: int | None = bounded(None, ge=1)
    """Speculate only while fewer than this many sequences decode together (vLLM's
    --speculative-disable-by-batch-size); None never turns speculation off."""
    costs: str | None = None
    """Cost curves of the adaptive depth policy: the forward.json of ``verispec bench forward``;
    None measures them at start-up (cached per model and thread count)."""
    heads: str | None = None
    """Folder of trained heads for medusa and eagle (and their +ngram methods; from ``verispec
    train``, see :mod:`verispec.heads.io`); None takes the heads shipped for the target, if any."""
    tree_nodes: int | None = bounded(None, ge=1)
    """medusa and eagle: the most draft-tree nodes per step; None takes the heads' own budget."""
    tree_width: int | None = bounded(None, ge=1)
    """medusa and eagle: candidates per tree level (a head's top-k); None takes the heads' own."""
    acceptance: Acceptance = "exact"
    """exact: the output follows the target's distribution (greedy: equals plain decoding).
    typical: Medusa's typical acceptance, LOSSY at temperature > 0: a draft token is kept when the
    target finds it plausible enough, so the output no longer follows the target's distribution
    (see :mod:`verispec.verify.typical`). Greedy decoding is exact either way."""

    def describe(self, *, by_default: bool = False) -> str:
        """The method and depth in a few words, for a summary or start-up line (``by_default``: the
        method was not named but chosen for the target)."""
        if self.method is None:
            return f"method {PLAIN} (plain decoding)"
        chosen = " (default)" if by_default else ""
        k = self.num_speculative_tokens
        depth = f"adaptive depth up to k={k}" if self.depth == "adaptive" else f"fixed k={k}"
        return f"method {self.method}{chosen}, {depth}"


@dataclass(frozen=True)
class ModelLoadConfig(_Checked):
    """Where and how to run a model."""

    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    dtype: DType = "float32"
    """Compute dtype; GGUF weights are de-quantized into it."""
    threads: int | None = bounded(None, ge=1)
    """CPU threads for PyTorch; None keeps PyTorch's default."""
    quantization: Quantization = "auto"
    """Weights at load. auto: a GGUF file's own blocks on CPUs with AVX2 or AVX-512 VNNI (gguf),
    else int8 for float32 on CPU, none on CUDA; gguf: the file's blocks as llama.cpp runs them (see
    :mod:`verispec.models.gguf_native`); int8, int4: the model re-quantized to 8 or 4 bits (x86 with
    AVX2 or AVX-512 VNNI; int4 keeps the LM head int8); none: float weights."""


@dataclass(frozen=True)
class SchedulerConfig(_Checked):
    """How many sequences decode together and how many may wait behind them."""

    max_batch_size: int = bounded(8, ge=1)
    """Sequences decoding together; more requests wait in the queue."""
    max_waiting: int = bounded(64, ge=1)
    """Requests allowed to wait behind a full batch; beyond it a request is refused (HTTP 429 with
    Retry-After). Requests that free batch slots will take at the next step do not count."""
    prefix_cache_gb: float = bounded(2.0, ge=0)
    """Memory for the prefix cache, in GB (1e9 bytes): the keys and values of earlier requests that a
    later request starting with the same tokens, in the same cache scope, reuses instead of
    recomputing (a chat's earlier turns, a shared system prompt); least recently used blocks go
    first. 0 turns it off. Kept only where reuse is exact (GGUF and int8 weights on CPU)."""
    prefill_chunk: int = bounded(512, ge=1)
    """Prompt tokens fed per step: a long prompt is prefilled over several steps, so the running
    sequences keep producing tokens meanwhile."""
    prefill_sequences: int | None = bounded(None, ge=1)
    """Sequences whose prompt chunks share a step's prefill forward, first come first. None: one on
    CPU, where a forward costs in proportion to its tokens, so prompts batched together all wait for
    the last one's prefill, while one a step the first waits for its own alone; on CUDA as many as
    the step's token budget holds, where extra rows cost little until the arithmetic units fill."""
