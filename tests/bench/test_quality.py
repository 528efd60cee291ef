"""`verispec bench quality` on SmolLM2: the int8 path is close to float32, and the report is complete."""

from __future__ import annotations

import json

import pytest

from tests.conftest import needs_smollm2
from verispec.cli import main

pytestmark = [
    pytest.mark.slow,
    needs_smollm2,
]


def test_quality_report_on_smollm2(tmp_path, capsys):
    code = main(
        ["bench", "quality", "--target", "smollm2-135m-instruct", "--limit", "2", "--out", str(tmp_path)]
    )
    assert code == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    assert report["prompts"] == 2 and report["agreement_positions"] > 100
    assert 0.8 < report["agreement"] <= 1.0  # int8 changes some near-ties, not the model
    assert abs(report["perplexity_change"]) < 0.2
    assert report["command"].startswith("verispec bench quality")
    assert "greedy agreement" in capsys.readouterr().out
