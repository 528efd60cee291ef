"""``verispec bench forward``: the verify-cost curve, on a tiny random model (shape, not timing values)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_llama
from verispec.bench.forward import curve_table, measure_curve
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM


class CountingModel(HFCausalLM):
    """Records the cache length seen by every forward, to check each repeat starts from the same cache."""

    def __init__(self) -> None:
        super().__init__(tiny_llama(0), name="tiny")
        self.seen: list[tuple[int, int]] = []  # (cache length before, new tokens)

    def forward(self, input_ids, cache, **kwargs):
        self.seen.append((cache.length, input_ids.shape[1]))
        return super().forward(input_ids, cache, **kwargs)


def test_curve_has_a_median_per_k_and_every_repeat_sees_the_same_cache():
    model = CountingModel()
    curve = measure_curve(model, "target", ks=[1, 2, 4], context=16, repeats=3)
    assert curve.role == "target" and curve.model == "tiny" and curve.context == 16
    assert [p.k for p in curve.points] == [1, 2, 4]
    for point in curve.points:
        assert len(point.ms) == 3 and all(ms > 0 for ms in point.ms)
        assert min(point.ms) <= point.median_ms <= max(point.ms)
    # Prefill once, one warm-up per k, then 3 rounds of one timed forward per k, each on a 16-token cache.
    assert model.seen == [(0, 16)] + [(16, k) for _ in range(4) for k in (1, 2, 4)]
    table = curve_table([curve])
    assert "k=4" in table and "target: tiny" in table


def test_curve_rejects_a_context_beyond_the_model():
    model = HFCausalLM(tiny_llama(0), name="tiny")
    with pytest.raises(VerispecError, match="exceeds"):
        measure_curve(model, "target", ks=[16], context=model.max_context, repeats=1)


def test_cli_writes_forward_json(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_llama(0).save_pretrained(folder)
    out = tmp_path / "out"
    argv = ["bench", "forward", "--target", str(folder), "--draft", str(folder),
            "--ks", "1,2,3", "--context", "8", "--repeats", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "k=3" in capsys.readouterr().out
    result = json.loads((out / "forward.json").read_text())
    assert set(result) == {"schema", "command", "machine", "versions", "git_commit", "settings", "curves"}
    assert result["settings"]["ks"] == [1, 2, 3] and result["settings"]["context"] == 8
    assert [c["role"] for c in result["curves"]] == ["target", "draft"]
    for curve in result["curves"]:
        assert set(curve) == {"role", "model", "context", "points"}
        assert [p["k"] for p in curve["points"]] == [1, 2, 3]
        assert all(set(p) == {"k", "median_ms", "ms"} and len(p["ms"]) == 2 for p in curve["points"])
