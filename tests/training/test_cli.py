"""`verispec train`: its flags and one-line errors on a tiny model folder, and (on the real SmolLM2)
`--data-only` growing the hidden-state cache and `--eval-only` measuring saved heads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import verispec
from tests.conftest import needs_smollm2, tiny_llama
from verispec.cli import build_parser, main


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny model folder without a tokenizer (heads need text, so training refuses it)."""
    folder = tmp_path_factory.mktemp("train-cli") / "target"
    tiny_llama(0).save_pretrained(folder)
    return folder


def test_train_flags_and_a_target_without_tokenizer(target, capsys):
    args = build_parser().parse_args(["train", "eagle", "--out", "x", "--max-tokens", "5000", "--resume"])
    assert (args.kind, args.max_tokens, args.resume, args.epochs, args.draft_vocab) == (
        "eagle",
        5000,
        True,
        2,
        8192,
    )
    code = main(["train", "medusa", "--target", str(target), "--out", "unused", "--max-tokens", "2000",
                 "--quiet", "--cache-dir", str(target.parent / "cache")])  # fmt: skip
    assert code == 2 and "no tokenizer" in capsys.readouterr().err


@needs_smollm2
def test_train_data_only_fills_and_then_grows_the_cache(tmp_path, capsys, restore_torch_threads):
    """`verispec train --data-only` on a real model: the hidden-state cache is built, then a larger
    --max-tokens extends the same cache folder instead of starting another one."""
    base = ["train", "eagle", "--target", "smollm2-135m-instruct", "--out", str(tmp_path / "unused"),
            "--sources", "stdlib", "--max-seq-len", "256", "--data-only", "--quiet", "--threads", "2",
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    assert main([*base, "--max-tokens", "1000"]) == 0
    first = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert first["complete"] and 1000 <= first["tokens"] < 1256
    assert main([*base, "--max-tokens", "2000"]) == 0
    grown = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert grown["complete"] and grown["tokens"] >= 2000 and grown["sequences"] > first["sequences"]
    assert grown["cursor"]["stdlib"] > first["cursor"]["stdlib"]
    assert "hidden states cached in" in capsys.readouterr().out
    assert not (tmp_path / "unused").exists()  # --data-only trains nothing


@needs_smollm2
def test_train_eval_only_prints_saved_heads_accuracy(tmp_path, capsys, restore_torch_threads):
    """`verispec train eagle --eval-only --init-from HEADS` on a real model: the shipped heads'
    accuracy per depth on held-out and training text; no --out needed, nothing written."""
    heads = Path(verispec.__file__).parent / "heads" / "shipped" / "smollm2-135m-instruct" / "eagle"
    code = main(["train", "eagle", "--target", "smollm2-135m-instruct", "--sources", "stdlib",
                 "--max-seq-len", "128", "--max-tokens", "6000", "--eval-only", "--init-from", str(heads),
                 "--quiet", "--threads", "2", "--cache-dir", str(tmp_path / "cache")])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and "held-out | on a sample of the training text" in out[0]
    depth1 = out[1].split(":")[1].split("|")
    assert 0.2 < float(depth1[0].split("/")[0]) <= 1 and 0.2 < float(depth1[1].split("/")[0]) <= 1
    assert out[-1].startswith("  positions at depth 1:") and sorted(p.name for p in tmp_path.iterdir()) == [
        "cache"
    ]


def test_train_without_out_is_a_clear_error(target, capsys):
    assert main(["train", "eagle", "--target", str(target), "--max-tokens", "2000"]) == 2
    assert "give --out FOLDER" in capsys.readouterr().err
