"""BenchSettings: everything that defines a benchmark run, validated before any model is loaded.

The settings are written verbatim into ``results.json``, so a run can be repeated from its results
file alone. Nothing here depends on the evaluation prompts: the warm-up prompt is fixed text, and
every knob (k, n-gram sizes, prompt-lookup length) is set by the user, never fitted to the data.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from verispec.bench.datasets import CATEGORIES, DATASETS
from verispec.config import METHODS, DepthPolicyName, ModelLoadConfig, NgramConfig, SpecConfig
from verispec.errors import VerispecError

PLAIN = "none"
"""The method name of plain decoding: the reference of every speedup and of the lossless check."""

BASELINES: tuple[str, ...] = ("hf", "hf-assisted", "hf-pld", "llamacpp", "llamacpp-pld")
"""Other tools a user could pick instead, run side by side on the same models and prompts."""

WARMUP_PROMPT = "Write a short poem about the sea, then explain its rhyme scheme."
"""Warm-up text, deliberately not taken from any evaluation set."""

SERVE_METHODS: tuple[str, ...] = METHODS
"""What ``bench serve`` speculates with (its plain policy is a server with ``--method none``): any
method ``verispec serve`` takes; the heads' methods need heads for the target, or the server says so."""

CACHE_SCOPES: tuple[str, ...] = ("shared", "private")
"""``shared``: each contender's requests share one cache scope (earlier prompts' KV and outputs may
help later ones, as one user's requests in a deployment); ``private``: none does."""

JSON_INSTRUCTION = "\n\nReply with one JSON object that follows this JSON schema:\n{schema}"
"""Ends each user turn in JSON mode (``--json-schema``), so the model is asked for what the grammar
will force: a served request with ``response_format`` says the same in its messages."""


@dataclass(frozen=True)
class BenchSettings:
    """One benchmark run: models, methods, prompts and generation limits.

    The fields named as a setting of :mod:`verispec.config` (``num_speculative_tokens``, ``depth``,
    ``heads``, ...) are that setting: ``verispec bench`` makes their flags from it
    (:func:`verispec.settings.add_flags`), and they take its default unless listed in
    :attr:`OWN_DEFAULTS`, whose docstrings say why.
    """

    OWN_DEFAULTS: ClassVar[tuple[str, ...]] = ("depth",)
    """Settings whose default differs from serving's on purpose."""

    target: str
    """Target model: registry name, Hugging Face folder or .gguf file."""
    draft: str | None = None
    """Draft model for the ``draft`` method and the ``hf-assisted`` baseline."""
    methods: tuple[str, ...] = (PLAIN, "ngram")
    """verispec methods; ``none`` (plain decoding) is always run first, as the reference."""
    baselines: tuple[str, ...] = ()
    """Baselines from :data:`BASELINES`; each is skipped, with a note, if its package or model is absent."""
    num_speculative_tokens: int = SpecConfig.num_speculative_tokens
    """k: draft tokens per step for the verispec methods."""
    depth: DepthPolicyName = "fixed"
    """fixed (bench's default, where serving's is adaptive): every method drafts k tokens (trees:
    their full node budget) every step, which measures the method itself rather than the policy;
    adaptive: the depth policy chooses per step, as served."""
    ngram: NgramConfig = field(default_factory=NgramConfig)
    """N-gram sizes of the ``ngram`` proposer."""
    heads: str | None = None
    """Heads folder for the Medusa and EAGLE methods, from ``verispec train`` (a ``<kind>/`` subfolder
    per kind, or one kind's folder; None: the target's shipped heads), so trained heads can be
    compared with the shipped ones on the same prompts."""
    tree_nodes: int | None = None
    """Most tree nodes per step for the Medusa and EAGLE methods (None: the heads' default)."""
    tree_width: int | None = None
    """Candidates per tree level for the Medusa and EAGLE methods (None: the heads' default)."""
    prompt_lookup_tokens: int = 10
    """Draft length of the prompt-lookup baselines (transformers and llama.cpp)."""
    datasets: tuple[str, ...] = ("humaneval",)
    categories: tuple[str, ...] | None = None
    """Keep only these categories (plain or ``dataset/category``); datasets none applies to run whole."""
    limit_per_category: int | None = None
    """First N prompts of each category, in file order (or in ``seed``'s shuffled order)."""
    seed: int | None = None
    """Shuffle each dataset's rows with this seed before taking --limit per category."""
    data_dir: Path | None = None
    """Folder with spec_bench/, mt_bench/ and humaneval/ (default: $VERISPEC_DATA_DIR, else packaged)."""
    max_new_tokens: int = 128
    """New tokens per turn."""
    warmup: int = 1
    """Untimed generations per method before timing starts."""
    json_schema: dict[str, Any] | None = None
    """JSON mode: every answer is constrained to this JSON schema, as a served ``response_format``
    constrains it, and each user turn ends with :data:`JSON_INSTRUCTION` naming it (chat prompts
    only). Proposers draft inside the grammar; the lossless check compares with plain decoding under
    the same grammar. Baselines are skipped: none decodes under a grammar here."""
    cache_scope: str = "shared"
    """``shared``: every request of a contender carries the scope ``bench-<contender>``, so a later
    prompt or turn may reuse what earlier ones cached (prompt KV, outputs to draft from), never
    another contender's; ``private``: no scope, nothing reused across requests (the cost without
    cross-request reuse)."""
    load: ModelLoadConfig = field(default_factory=ModelLoadConfig)

    def __post_init__(self) -> None:
        methods = tuple(dict.fromkeys((PLAIN, *self.methods)))  # plain first, no duplicates
        object.__setattr__(self, "methods", methods)
        unknown = [m for m in methods if m != PLAIN and m not in METHODS]
        if unknown:
            raise VerispecError(
                f"unknown method {', '.join(unknown)}; choose from {PLAIN}, {', '.join(METHODS)}"
            )
        if "draft" in methods and self.draft is None:
            raise VerispecError("method 'draft' needs a draft model (--draft NAME|FOLDER|FILE.gguf)")
        bad = [b for b in self.baselines if b not in BASELINES]
        if bad:
            raise VerispecError(f"unknown baseline {', '.join(bad)}; choose from {', '.join(BASELINES)}")
        bad = [d for d in self.datasets if d not in DATASETS]
        if bad or not self.datasets:
            raise VerispecError(
                f"unknown dataset {', '.join(bad) or '(none)'}; choose from {', '.join(DATASETS)}"
            )
        SpecConfig(  # serving's checks of the same settings (a ConfigError naming the setting)
            num_speculative_tokens=self.num_speculative_tokens,
            ngram=self.ngram,
            depth=self.depth,
            tree_nodes=self.tree_nodes,
            tree_width=self.tree_width,
        )
        for value, flag, low in (
            (self.max_new_tokens, "--max-new-tokens", 1),
            (self.warmup, "--warmup", 0),
            (self.prompt_lookup_tokens, "--prompt-lookup-tokens", 1),
            (self.limit_per_category, "--limit", 1),
        ):
            if value is not None and value < low:
                raise VerispecError(f"{flag} must be >= {low}, got {value}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            # The schema itself is compiled against the target's tokenizer, so a wrong one fails the
            # warm-up generation with llguidance's message (before any timing).
            raise VerispecError("--json-schema must be a JSON object (a schema)")
        if self.cache_scope not in CACHE_SCOPES:
            raise VerispecError(
                f"--cache-scope must be one of {', '.join(CACHE_SCOPES)}, got {self.cache_scope!r}"
            )
        if self.heads is not None and not Path(self.heads).expanduser().exists():
            raise VerispecError(f"--heads {self.heads}: no such folder")
        self.categories_by_dataset()  # validates the category names

    def categories_by_dataset(self) -> dict[str, list[str] | None]:
        """Each dataset's category filter (None = every category) resolved from :attr:`categories`."""
        if self.categories is None:
            return dict.fromkeys(self.datasets)
        chosen: dict[str, list[str]] = {d: [] for d in self.datasets}
        for name in self.categories:
            dataset, _, category = name.rpartition("/")
            homes = [d for d in self.datasets if (not dataset or d == dataset) and category in CATEGORIES[d]]
            if not homes:
                valid = sorted({c for d in self.datasets for c in CATEGORIES[d]})
                raise VerispecError(
                    f"category {name!r} is in none of the datasets {', '.join(self.datasets)}; "
                    f"valid categories: {', '.join(valid)}"
                )
            for d in homes:
                chosen[d].append(category)
        return {d: (cats or None) for d, cats in chosen.items()}

    def scope_of(self, contender: str) -> str | None:
        """The cache scope of ``contender``'s requests (None: private)."""
        return f"bench-{contender}" if self.cache_scope == "shared" else None

    def json_instruction(self) -> str:
        """What JSON mode appends to each user turn ('' without ``json_schema``)."""
        if self.json_schema is None:
            return ""
        return JSON_INSTRUCTION.format(schema=json.dumps(self.json_schema, separators=(",", ":")))

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["data_dir"] = str(self.data_dir) if self.data_dir is not None else None
        out["categories_by_dataset"] = self.categories_by_dataset()
        out["warmup_prompt"] = WARMUP_PROMPT
        out["decoding"] = "greedy, batch 1"
        return out
