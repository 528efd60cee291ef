"""``verispec bench suffix-cost``: what suffix decoding costs per step, and in memory, as its cache of
earlier outputs grows (10^4 to 10^7 tokens).

The claim to check is that a step's cost does not grow with the cache (:mod:`verispec.proposers.
suffix_index`: bounded chain walks) while memory grows linearly and stays bounded by the budget.
For each size the cache is filled to it with synthetic outputs, then one sequence decodes against it
for ``steps`` steps: each step proposes a tree (k = 8), commits what a verifier would accept of it
(the longest path through the tree along the sequence's true continuation) plus one token, and
tells the proposer. Propose and update are timed apart; memory is the index's arrays and the
process's RSS growth over the fill.

The outputs are token streams of a phrase bank: recurring spans (4 to 40 tokens, drawn with Zipf
frequencies) with filler between them and 5% of tokens perturbed, which is what agents' and code
edits' repeated outputs look like to an index: many partial repeats, few exact ones. The sequence's
own continuation is drawn the same way, so its tail matches the cache about as often as a repeated
workload's does. No model and no tokenizer: the index only ever sees token ids.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SIZES: tuple[int, ...] = (10_000, 100_000, 1_000_000)
VOCAB = 32_000
PHRASES = 4_000
K = 8


@dataclass(frozen=True)
class CostRow:
    """One cache size's measurements."""

    cache_tokens: int
    """Tokens of outputs held (the budget, filled)."""
    outputs: int
    """Outputs (documents) held."""
    fill_seconds: float
    """Time to add them all (per output at release: vectorized indexing)."""
    propose_us: float
    """Median microseconds of one propose (both indexes looked up, the tree built)."""
    propose_p90_us: float
    update_us: float
    """Median microseconds of one update (the sequence's own index extended)."""
    step_us: float
    """Median of propose + update in one step."""
    index_bytes: int
    """Bytes of the cache's arrays (tokens, owners, hash chains)."""
    bytes_per_token: float
    rss_growth_bytes: int
    """The process's resident memory after the fill minus before it."""
    drafted_per_step: float
    """Mean draft tree nodes per step (that the workload matches at all)."""
    accepted_per_step: float
    """Mean tokens of the tree on the sequence's true continuation per step."""


class PhraseBank:
    """Synthetic outputs: recurring phrases with filler and perturbed tokens (module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        lengths = self.rng.integers(4, 41, size=PHRASES)
        self.phrases = [self._zipf_tokens(int(n)) for n in lengths]
        weights = 1.0 / np.arange(1, PHRASES + 1)
        self.weights = weights / weights.sum()

    def _zipf_tokens(self, n: int) -> np.ndarray:
        return (self.rng.zipf(1.2, size=n) % VOCAB).astype(np.int32)

    def stream(self, tokens: int) -> np.ndarray:
        """About ``tokens`` tokens: phrases with 0 to 8 filler tokens between them, 5% perturbed."""
        parts: list[np.ndarray] = []
        total = 0
        while total < tokens:
            batch = self.rng.choice(PHRASES, size=4096, p=self.weights)
            fillers = self.rng.integers(0, 9, size=4096)
            for phrase, filler in zip(batch.tolist(), fillers.tolist(), strict=True):
                parts.append(self.phrases[phrase])
                parts.append(self._zipf_tokens(filler))
                total += len(self.phrases[phrase]) + filler
        out = np.concatenate(parts)[:tokens]
        perturb = self.rng.random(len(out)) < 0.05
        out[perturb] = self.rng.integers(0, VOCAB, size=int(perturb.sum()))
        return out

    def outputs(self, tokens: int) -> list[np.ndarray]:
        """Outputs of 50 to 800 tokens adding up to ``tokens``."""
        stream = self.stream(tokens)
        cuts = np.cumsum(self.rng.integers(50, 801, size=tokens // 50 + 1))
        return [part for part in np.split(stream, cuts[cuts < len(stream)]) if len(part)]


def rss_bytes() -> int:
    """The process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def accepted_along(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """How many of ``truth``'s tokens the tree holds as a path from the root: what exact
    verification of a deterministic tree accepts when the target would write ``truth``."""
    node, depth = -1, 0
    children: dict[tuple[int, int], int] = {
        (p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))
    }
    while depth < len(truth) and (node, truth[depth]) in children:
        node = children[(node, truth[depth])]
        depth += 1
    return depth


def measure(size: int, steps: int = 500, seed: int = 0, prompt_tokens: int = 256) -> CostRow:
    """Fill a suffix proposer's cache to ``size`` tokens and time ``steps`` decode steps against it."""
    from verispec.config import SamplingConfig, SpecConfig, SuffixConfig
    from verispec.proposers.suffix import SuffixProposer

    bank = PhraseBank(seed)
    outputs = bank.outputs(size)
    sequence = bank.stream(prompt_tokens + steps * (K + 1)).tolist()
    gc.collect()
    before = rss_bytes()
    spec = SpecConfig(method="suffix", num_speculative_tokens=K, suffix=SuffixConfig(cache_tokens=size))
    proposer = SuffixProposer(spec)
    start = time.perf_counter()
    for output in outputs:
        proposer.cache.add("bench", output)
    fill = time.perf_counter() - start
    grown = rss_bytes() - before
    index = proposer.cache.index

    ids = sequence[:prompt_tokens]
    state = proposer.new_state(ids, SamplingConfig())
    proposer.set_scope(state, "bench")
    propose_ns, update_ns, drafted, accepted = [], [], 0, 0
    for _ in range(steps):
        if len(ids) + K + 1 > len(sequence):
            break
        t0 = time.perf_counter_ns()
        draft = proposer.propose(state, ids, K)
        t1 = time.perf_counter_ns()
        truth = sequence[len(ids) : len(ids) + K + 1]
        kept = accepted_along(draft.tokens.tolist(), draft.parents.tolist(), truth[:K])
        ids = ids + truth[: kept + 1]
        t2 = time.perf_counter_ns()
        proposer.update(state, ids, kept)
        t3 = time.perf_counter_ns()
        propose_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
        drafted += draft.size
        accepted += kept
    proposals = np.asarray(propose_ns) / 1e3
    updates = np.asarray(update_ns) / 1e3
    done = max(1, len(propose_ns))
    return CostRow(
        cache_tokens=index.live,
        outputs=len(index.docs),
        fill_seconds=round(fill, 3),
        propose_us=round(float(np.median(proposals)), 1),
        propose_p90_us=round(float(np.percentile(proposals, 90)), 1),
        update_us=round(float(np.median(updates)), 1),
        step_us=round(float(np.median(proposals + updates)), 1),
        index_bytes=index.nbytes,
        bytes_per_token=round(index.nbytes / max(1, index.live), 1),
        rss_growth_bytes=grown,
        drafted_per_step=round(drafted / done, 2),
        accepted_per_step=round(accepted / done, 2),
    )


def table(rows: list[CostRow]) -> str:
    """The rows as a fixed-width table."""
    head = (
        f"{'cache tokens':>12} {'outputs':>8} {'fill s':>7} {'propose us':>10} {'p90 us':>7} "
        f"{'update us':>9} {'step us':>8} {'index MB':>9} {'B/token':>7} {'RSS +MB':>8} "
        f"{'drafted':>7} {'accepted':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.cache_tokens:>12,} {r.outputs:>8,} {r.fill_seconds:>7.2f} {r.propose_us:>10.1f} "
            f"{r.propose_p90_us:>7.1f} {r.update_us:>9.1f} {r.step_us:>8.1f} {r.index_bytes / 1e6:>9.1f} "
            f"{r.bytes_per_token:>7.1f} {r.rss_growth_bytes / 1e6:>8.1f} {r.drafted_per_step:>7.2f} "
            f"{r.accepted_per_step:>8.2f}"
        )
    return "\n".join(lines)


def _sizes(value: str) -> list[int]:
    try:
        sizes = [int(float(item)) for item in value.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {value!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError("every size must be at least 2 tokens")
    return sizes


def add_suffix_cost_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``suffix-cost`` on bench's subcommands."""
    parser = sub.add_parser(
        "suffix-cost",
        help="suffix decoding's per-step time and memory as its output cache grows",
        description="Fill suffix decoding's cache of earlier outputs with synthetic outputs (recurring "
        "phrases) to each size, then time propose and update for one sequence decoding against it. "
        "Prints a table; writes suffix_cost.json to --out when given.",
    )
    parser.add_argument(
        "--sizes", type=_sizes, default=list(SIZES), help="comma list of cache sizes in tokens (1e7 works)"
    )
    parser.add_argument("--steps", type=int, default=500, help="timed decode steps per size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic outputs")
    parser.add_argument("--out", type=Path, default=None, help="output folder (created if needed)")


def run(args: argparse.Namespace, command: str) -> int:
    """``verispec bench suffix-cost``: measure every size, print the table, write the JSON."""
    from verispec.bench import environment
    from verispec.errors import VerispecError

    if args.steps < 1:
        raise VerispecError(f"--steps must be >= 1, got {args.steps}")
    rows = []
    for size in args.sizes:
        rows.append(measure(size, steps=args.steps, seed=args.seed))
        print(f"measured {size:,} tokens", file=sys.stderr)
    machine = environment.machine()
    print(f"suffix decoding, k={K}, {args.steps} steps per size, on {environment.describe_cpu(machine)}")
    print(table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "suffix_cost.json"
        result = {
            "schema": "verispec-bench-suffix-cost/1",
            "command": command,
            "machine": machine,
            "settings": {"sizes": args.sizes, "steps": args.steps, "seed": args.seed, "k": K},
            "rows": [asdict(r) for r in rows],
        }
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0
