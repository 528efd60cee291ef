"""The evaluation prompt sets shipped inside the package: Spec-Bench, MT-bench and HumanEval, and the
workloads generated from them.

They are package data, not a folder beside the repository, so that ``verispec bench`` runs the same
prompts from a clone, an editable install or a wheel. Each folder holds the upstream file exactly as
it was published, the upstream LICENSE, and a README giving the source, commit and checksum:

- ``spec_bench/question.jsonl``: Spec-Bench's 480 prompts (Apache-2.0);
- ``mt_bench/question.jsonl``: FastChat's 80 MT-bench questions (Apache-2.0);
- ``humaneval/HumanEval.jsonl.gz``: OpenAI's 164 HumanEval problems (MIT), gzipped as upstream.

The workloads (:data:`WORKLOADS`) have no folder: :mod:`verispec.bench.workloads` builds them, the
same way every time, from those files and from the text in :mod:`verispec.data.workloads` (tool
schemas, cities, edit requests, follow-up questions), which this project wrote:

- ``code_edit``: each HumanEval problem as a 4-6 turn chat asking for the whole function again after
  each small change (HumanEval's MIT license applies to the problems it quotes);
- ``tool_calls``: chats where each answer is a JSON tool call and the next message its result;
- ``mt_bench_6turn``: MT-bench's two turns followed by four generic follow-ups (Apache-2.0 for the
  questions it quotes).

These are the prompts speedups are measured on, so they must never become training text for draft
heads (:mod:`verispec.training`): heads that had seen them would draft them better than they draft
anything else, and the measured speedup would not carry over. :mod:`verispec.bench.datasets`
parses them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal, get_args

from verispec.errors import VerispecError

ShippedName = Literal["spec_bench", "mt_bench", "humaneval"]
SHIPPED: tuple[str, ...] = get_args(ShippedName)
"""The upstream prompt sets this package ships, one folder each."""

WorkloadName = Literal["code_edit", "tool_calls", "mt_bench_6turn"]
WORKLOADS: tuple[str, ...] = get_args(WorkloadName)
"""Conversations generated from the shipped sets (:mod:`verispec.bench.workloads`); no folder."""

DatasetName = Literal[ShippedName, WorkloadName]
DATASETS: tuple[str, ...] = get_args(DatasetName)
"""Every name ``--dataset`` takes: the shipped sets, then the workloads."""


def packaged_data_dir() -> Path:
    """The folder holding ``spec_bench/``, ``mt_bench/`` and ``humaneval/``.

    Located through :mod:`importlib.resources` rather than ``__file__`` arithmetic, so it is the
    installed copy wherever verispec was installed. The readers need real files (``gzip.open``,
    ``open``); an install that leaves the package inside a zip is refused with the way out.
    """
    root = resources.files(__name__)
    if not isinstance(root, Path):
        raise VerispecError(
            f"verispec's packaged benchmark data is not on the file system ({root}); "
            "pass --data-dir to a folder holding spec_bench/, mt_bench/ and humaneval/"
        )
    return root


def dataset_dir(name: ShippedName) -> Path:
    """The packaged folder of shipped dataset ``name`` (a workload has none: it is generated)."""
    if name in WORKLOADS:
        raise VerispecError(
            f"{name} is generated from the shipped data (verispec.bench.workloads), no folder"
        )
    if name not in SHIPPED:
        raise VerispecError(f"no packaged dataset {name!r}; verispec ships {', '.join(SHIPPED)}")
    return packaged_data_dir() / name
