"""What a step costs: measured forward times that the adaptive depth policy trades acceptance against.

Three curves, measured on this machine with this model and these settings:

- target: seconds of one batched forward against the number of tokens in the batch (every
  sequence's pending token plus its drafts), split into rows as the engine splits them, plus a
  price per (query token x cached key): attention grows with the context, and on long prompts an
  extra draft token costs far more than the short-context curve says;
- draft: seconds of one draft-model step against the number of rows drafting in it (prompt
  lookup has no such cost);
- draft prefill: seconds of one draft-model pass over n tokens of one sequence, keeping no logits:
  what catching a draft model up on a prompt (or on tokens it sat out) costs. Pricing that with the
  one-token-rows curve overstated it about twice.

Measuring takes a few seconds for a 1.5B model, so a curve is cached on disk under the model's
identity and the thread count. The points are timed round-robin (every count once per repeat), so a
machine that is slow for a while after loading slows every point alike instead of the first ones
measured: measured in order, a 1.5B int4 step at 1 token read 49 ms against 40 ms in use, a
4-token verify looked like 1.33x a decode step instead of ~1.6x, and the policy over-speculated.

While serving, every step's real time corrects the prediction for its own token count (an EMA of
measured / predicted per count; counts not seen yet take their observed neighbours' corrections,
interpolated). That absorbs what the start-up measurement cannot see, such as longer contexts,
another process on the machine, or a verify step costing relatively more inside the engine than
alone (1.83x against 1.62x a decode step for 4 tokens on the AVX2 int4 path; docs/design.md#cost-curves).
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verispec.models.base import CausalLM

TARGET_TOKENS = (1, 2, 4, 8, 16, 17, 32, 33, 64, 128)
"""17 and 33: on AMX a token past a whole tile of 16 rows, or a pass of 32, adds a step to the cost
(the 1.5B int4: 73 ms at 16 tokens, 88 at 17) that a line from 16 to 32 would hide from the policy."""
DRAFT_ROWS = (1, 2, 4, 8, 16)
PREFILL_TOKENS = (1, 16, 128, 512)
_ROW_WIDTH = 8  # the target curve's batches are rows of up to this many tokens, as verify steps are
CATCH_UP_HORIZON = 16
"""Steps a draft model's catch-up cost is spread over when the request's remaining length is not
known (see :meth:`StepCostModel.draft_catch_up_seconds`)."""
_COSTS_VERSION = 4  # bumped when the cached curves change meaning or gain one: older files are measured again
_MAX_OWN_SCALE = 64
"""Token counts up to this keep their own correction; larger batches share the global one."""


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear seconds against a count, extrapolated along the last segment.

    Made non-decreasing on construction (each point becomes the least cost measured at that count
    or above): more tokens never cost less, and another process slowing one measurement down must
    not make a small batch look as dear as a large one, which would make speculation look free.
    """

    xs: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) < 2 or len(self.xs) != len(self.seconds) or list(self.xs) != sorted(set(self.xs)):
            raise ValueError(f"a cost curve needs >= 2 increasing points, got {self.xs} / {self.seconds}")
        running, monotone = float("inf"), []
        for y in reversed(self.seconds):
            running = min(running, float(y))
            monotone.append(running)
        object.__setattr__(self, "seconds", tuple(reversed(monotone)))

    def __call__(self, x: float) -> float:
        if x <= self.xs[0]:
            return self.seconds[0]
        i = min(bisect.bisect_left(self.xs, x), len(self.xs) - 1)
        x0, x1, y0, y1 = self.xs[i - 1], self.xs[i], self.seconds[i - 1], self.seconds[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(eq=False, repr=False)
class StepCostModel:
    """Predicted seconds of a step's target forward and draft steps, corrected by observed steps."""

    target: Curve
    draft: Curve | None = None
    per_key: float = 0.0
    """Seconds per query token per cached key it attends to (beyond the curve's short context)."""
    correction: float = 0.1
    draft_prefill: Curve | None = None
    """One draft pass over n tokens of one sequence (None: priced with ``draft`` instead)."""
    target_scale: float = field(default=1.0, init=False)
    """Measured / predicted over every observed step (the counts past :data:`_MAX_OWN_SCALE`)."""
    count_scales: dict[int, float] = field(default_factory=dict, init=False)
    """Measured / predicted per token count of observed steps, up to :data:`_MAX_OWN_SCALE`."""
    # from count_scales: the scale per count 1.._MAX_OWN_SCALE, and the corrected curve there
    # (non-decreasing)
    _scales: list[float] = field(default_factory=list, init=False)
    _seconds: list[float] = field(default_factory=list, init=False)
    draft_scale: float = field(default=1.0, init=False)

    def target_seconds(self, tokens: int, key_queries: float = 0.0) -> float:
        """A forward of ``tokens`` tokens whose queries attend to ``key_queries`` cached keys in all."""
        if not self._seconds:
            return (self.target(tokens) + self.per_key * key_queries) * self.target_scale
        i = min(max(int(tokens), 1), _MAX_OWN_SCALE) - 1
        if tokens <= _MAX_OWN_SCALE:
            return self._seconds[i] + self.per_key * key_queries * self._scales[i]
        return max(self._seconds[-1], self.target(tokens) * self.target_scale) + (
            self.per_key * key_queries * self.target_scale
        )

    def _refresh(self) -> None:
        """Tabulate the corrected curve: an observed count's own scale; between observed counts,
        their scales interpolated; outside them, the nearest one's. Then made non-decreasing: more
        tokens never cost less, and one count's noisy correction must not make it look cheap."""
        counts = sorted(self.count_scales)
        scales, seconds, running = [], [], 0.0
        for t in range(1, _MAX_OWN_SCALE + 1):
            j = bisect.bisect_left(counts, t)
            if j < len(counts) and counts[j] == t:
                scale = self.count_scales[t]
            elif j == 0:
                scale = self.count_scales[counts[0]]
            elif j == len(counts):
                scale = self.count_scales[counts[-1]]
            else:
                lo, hi = counts[j - 1], counts[j]
                w = (t - lo) / (hi - lo)
                scale = self.count_scales[lo] + w * (self.count_scales[hi] - self.count_scales[lo])
            running = max(running, self.target(t) * scale)
            scales.append(scale)
            seconds.append(running)
        self._scales, self._seconds = scales, seconds

    def draft_step_seconds(self, rows: int) -> float:
        """One draft-model step over ``rows`` sequences (0 when there is no draft model)."""
        if self.draft is None or rows <= 0:
            return 0.0
        return self.draft(rows) * self.draft_scale

    def draft_catch_up_seconds(self, backlog: int, horizon: float = CATCH_UP_HORIZON) -> float:
        """Extra time for a draft model to feed ``backlog`` committed tokens it has not seen, beyond
        the one or two any first draft step feeds anyway, per step of the ``horizon`` it pays for.

        A one-time cost: once caught up, the sequence can speculate on every step it has left, so
        the cost is spread over those (charging it all to one step would keep a draft model from
        ever starting on a long prompt; spreading it over a fixed 16 steps let it start on requests
        with too few tokens left to win it back).
        """
        if self.draft is None or backlog <= 2:
            return 0.0
        if self.draft_prefill is not None:
            once = self.draft_prefill(backlog) - self.draft_prefill(2)
        else:
            once = self.draft(backlog) - self.draft(2)
        return once * self.draft_scale / max(1.0, horizon)

    def observe_target(self, tokens: int, seconds: float, key_queries: float = 0.0) -> None:
        """Correct the predictions by one step's measured forward: its own count's and the global."""
        predicted = self.target(tokens) + self.per_key * key_queries
        if predicted <= 0:
            return
        ratio = seconds / predicted
        if tokens <= _MAX_OWN_SCALE:
            own = self.count_scales.get(tokens, self.target_scale)
            self.count_scales[tokens] = own + self.correction * (ratio - own)
            self._refresh()
        self.target_scale += self.correction * (ratio - self.target_scale)

    def observe_draft(self, rows_per_step: Sequence[int], seconds: float) -> None:
        predicted = sum(self.draft(r) for r in rows_per_step if r) if self.draft else 0.0
        if predicted > 0:
            self.draft_scale += self.correction * (seconds / predicted - self.draft_scale)

    def to_dict(self) -> dict[str, object]:
        return {
            "target": asdict(self.target),
            "draft": asdict(self.draft) if self.draft else None,
            "draft_prefill": asdict(self.draft_prefill) if self.draft_prefill else None,
            "per_key": self.per_key,
            "target_scale": self.target_scale,
            "draft_scale": self.draft_scale,
        }


def measure_target(model: CausalLM, context: int = 64, repeats: int = 5) -> Curve:
    """Least seconds of a batched forward of t tokens (rows of up to 8) on ``context``-token caches
    (shorter where the model's context could not hold a row after them)."""
    context = _fitting(model, context, _ROW_WIDTH)
    steps = [_RowsStep(model, _rows_for(t), context) for t in TARGET_TOKENS]
    return Curve(TARGET_TOKENS, _least_round_robin(steps, repeats))


def measure_per_key(model: CausalLM, repeats: int = 5, tokens: int = 8, extra: int = 512) -> float:
    """Seconds per query token per cached key: 8 tokens on a 576-token cache against a 64-token one."""
    extra = min(extra, model.max_context - 64 - tokens)
    if extra < 64:  # a model with too short a context to tell: no context price
        return 0.0
    short, long = _least_round_robin(
        [_RowsStep(model, [tokens], 64), _RowsStep(model, [tokens], 64 + extra)], repeats
    )
    return max(0.0, (long - short) / (tokens * extra))


def measure_draft(model: CausalLM, context: int = 64, repeats: int = 5) -> Curve:
    """Least seconds of one draft step (one token per row) for each row count."""
    steps = [_RowsStep(model, [1] * r, _fitting(model, context, 1)) for r in DRAFT_ROWS]
    return Curve(DRAFT_ROWS, _least_round_robin(steps, repeats))


def measure_prefill(model: CausalLM, repeats: int = 3) -> Curve:
    """Least seconds of one pass over n prompt tokens of one sequence (no logits kept), from an
    empty cache: the way a draft model catches up. A model with a short context is measured up to
    its context (the curve extrapolates beyond, where no prompt of it can go)."""
    generator = torch.Generator().manual_seed(0)
    counts = sorted({min(n, model.max_context) for n in PREFILL_TOKENS})
    seconds = []
    for n in counts:
        tokens = torch.randint(0, model.vocab_size, (n,), generator=generator).tolist()
        times = []
        for i in range(repeats + 1):  # the first is a warm-up
            cache = model.new_cache()
            synchronize(model)
            started = time.perf_counter()
            model.forward_batch([cache], [tokens], logits_to_keep=[0])
            synchronize(model)
            if i:
                times.append(time.perf_counter() - started)
        seconds.append(min(times))
    return Curve(tuple(counts), tuple(seconds))


def synchronize(model: CausalLM) -> None:
    """Wait for the model's device: a GPU runs asynchronously, and a timer must see its work, not
    only the launches."""
    device = torch.device(getattr(model, "device", "cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fitting(model: CausalLM, context: int, width: int) -> int:
    """``context``, cut so that a row of ``width`` tokens after it stays within the model's context:
    the measurement must run on any model the engine runs (a 64-position model included), and a
    shorter context only makes its curve a little cheaper, which serving corrects."""
    return max(0, min(context, model.max_context - width))


def _rows_for(tokens: int) -> list[int]:
    full, rest = divmod(tokens, _ROW_WIDTH)
    return [_ROW_WIDTH] * full + ([rest] if rest else [])


class _RowsStep:
    """One batched forward of rows of the given widths on ``context``-token caches, repeatable."""

    def __init__(self, model: CausalLM, widths: list[int], context: int) -> None:
        generator = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, model.vocab_size, (1, context), generator=generator)
        base = model.new_cache()
        if context:
            model.forward(prefix, base)
        self.model = model
        self.widths = widths
        self.caches = [base.clone() for _ in widths]
        self.tokens = [torch.randint(0, model.vocab_size, (w,), generator=generator).tolist() for w in widths]

    def seconds(self) -> float:
        synchronize(self.model)
        started = time.perf_counter()
        self.model.forward_batch(self.caches, self.tokens, logits_to_keep=self.widths)
        synchronize(self.model)
        elapsed = time.perf_counter() - started
        for cache, w in zip(self.caches, self.widths, strict=True):
            cache.trim(w)
        return elapsed


def _least_round_robin(steps: list[_RowsStep], repeats: int) -> tuple[float, ...]:
    """Each step's least time over ``repeats`` rounds that time every step once, after a warm-up
    round: the least, since contention only ever adds time; round-robin, so a slow spell of the
    machine does not fall on some points only."""
    for step in steps:
        step.seconds()
    least = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            least[i] = min(least[i], step.seconds())
    return tuple(least)


def load_or_measure(
    target: CausalLM, draft: CausalLM | None, cache_dir: Path | None, repeats: int = 5
) -> StepCostModel:
    """The cost model for this target (and draft), from ``cache_dir`` when measured before."""
    path = cache_dir / f"{_identity(target, draft)}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        return load_costs_file(path)
    costs = StepCostModel(
        measure_target(target, repeats=repeats),
        measure_draft(draft, repeats=repeats) if draft is not None else None,
        per_key=measure_per_key(target, repeats=repeats),
        draft_prefill=measure_prefill(draft) if draft is not None else None,
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(costs.to_dict(), indent=1))
        tmp.replace(path)
    return costs


def load_costs_file(path: Path) -> StepCostModel:
    """Costs from a file: a ``forward.json`` of ``verispec bench forward`` (k tokens in one row
    stand in for k tokens across rows, and a draft forward of k tokens for a draft step over k
    rows), or a cost model this module cached."""
    from verispec.errors import VerispecError

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VerispecError(f"cannot read the cost file {path}: {exc}") from exc
    if "target" in data and isinstance(data["target"], dict):
        return StepCostModel(
            Curve(**_tuples(data["target"])),
            Curve(**_tuples(data["draft"])) if data.get("draft") else None,
            per_key=float(data.get("per_key", 0.0)),
            draft_prefill=Curve(**_tuples(data["draft_prefill"])) if data.get("draft_prefill") else None,
        )
    curves = {c["role"]: c for c in data.get("curves", []) if isinstance(c, dict)}
    if "target" not in curves:
        raise VerispecError(f"{path} is neither a forward.json with a target curve nor a verispec cost file")

    def curve(c: dict) -> Curve:
        points = sorted((int(p["k"]), float(p["median_ms"]) / 1000) for p in c["points"])
        return Curve(tuple(k for k, _ in points), tuple(s for _, s in points))

    return StepCostModel(curve(curves["target"]), curve(curves["draft"]) if "draft" in curves else None)


def _tuples(d: dict[str, list]) -> dict[str, tuple]:
    return {k: tuple(v) for k, v in d.items()}


def _identity(target: CausalLM, draft: CausalLM | None) -> str:
    """Model names, shapes, quantization (with the int4 kernel's build), the C++ attention's and
    layer operations' builds and threads: what changes a forward's cost."""
    from verispec.models import attention as attention_module
    from verispec.models import lean, native

    def kernels(m: CausalLM) -> str:
        """Decode and verify steps run the C++ attention and layer operations where the model has
        them on: their builds change what a step costs."""
        out = ""
        if getattr(m, "native_attention", True):
            out = f"-a{native.build_key(attention_module.NATIVE_SOURCE)[:8]}"
        if getattr(m, "native_layers", True):
            out += f"-l{native.build_key(lean.NATIVE_SOURCE)[:8]}"
        return out

    def one(m: CausalLM) -> str:
        quant = getattr(m, "quantization", "none")
        if quant == "int4":
            from verispec.models.int4 import kernel_key
            from verispec.models.quant import lm_head_kind

            quant = f"int4{kernel_key()[:8]}"
            if lm_head_kind(m) == "int4":
                quant += "-h4"  # an int4 LM head: its rows cost other than the int8 head's
        if quant == "gguf":
            from verispec.models.gguf_linear import kernel_key as gguf_kernel_key

            quant = f"gguf{gguf_kernel_key()[:8]}"
        if quant != "none" and _runs_amx(m):
            quant += "-amx"  # the AMX kernels price a verified row at a fraction of the others'
        params = sum(p.numel() for p in m.model.parameters()) if hasattr(m, "model") else 0
        shape = f"{m.vocab_size}-{m.hidden_size}-{params}"
        return f"{m.name}-{shape}-{quant}-{m.device}{kernels(m)}".replace("/", "_")

    draft_part = f"+{one(draft)}" if draft is not None else ""
    return f"{one(target)}{draft_part}-t{torch.get_num_threads()}-v{_COSTS_VERSION}"


def _runs_amx(m: CausalLM) -> bool:
    """Whether ``m``'s quantized Linears run verispec's AMX kernels (``VERISPEC_INT4_AMX`` chooses)."""
    layers = m.model.modules() if hasattr(m, "model") else ()
    return any(getattr(layer, "amx", False) is True for layer in layers)
