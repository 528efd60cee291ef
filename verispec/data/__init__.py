"""The evaluation prompt sets shipped inside the package: Spec-Bench, MT-bench and HumanEval.

They are package data, not a folder beside the repository, so that ``verispec bench`` runs the same
prompts from a clone, an editable install or a wheel. Each folder holds the upstream file exactly as
it was published, the upstream LICENSE, and a README giving the source, commit and checksum:

- ``spec_bench/question.jsonl``: Spec-Bench's 480 prompts (Apache-2.0);
- ``mt_bench/question.jsonl``: FastChat's 80 MT-bench questions (Apache-2.0);
- ``humaneval/HumanEval.jsonl.gz``: OpenAI's 164 HumanEval problems (MIT), gzipped as upstream.

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

DatasetName = Literal["spec_bench", "mt_bench", "humaneval"]
DATASETS: tuple[str, ...] = get_args(DatasetName)
"""The datasets this package ships, one folder each."""


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


def dataset_dir(name: DatasetName) -> Path:
    """The packaged folder of dataset ``name``."""
    if name not in DATASETS:
        raise VerispecError(f"no packaged dataset {name!r}; verispec ships {', '.join(DATASETS)}")
    return packaged_data_dir() / name
