"""The command line with heads: `generate --method medusa|eagle --heads DIR` end to end on a tiny model
folder (int8, as the CLI loads it); `train`'s flags and errors are tests/training/test_cli.py's."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_llama
from tests.training.tiny import trained
from verispec.cli import build_parser, main
from verispec.config import ModelLoadConfig
from verispec.heads.identity import identify
from verispec.heads.io import save_heads
from verispec.models import load_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads-cli")
    tiny_llama(0).save_pretrained(root / "target")
    target = load_model(root / "target", ModelLoadConfig())  # int8, as the CLI runs it
    for kind in ("medusa", "eagle"):
        module, vocab, report = trained(target, kind)
        save_heads(root / "heads" / kind, kind, module, identify(target), vocab, training=report)
    return root / "target", root / "heads"


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_generate_with_heads_matches_plain(folders, method, capsys, restore_torch_threads):
    target, heads = folders
    code = main(
        ["generate", "--target", str(target), "--method", method, "--heads", str(heads),
         "--prompt", "5 17 42 8", "--max-new-tokens", "24", "-k", "3", "--depth-policy", "fixed",
         "--tree-nodes", "6", "--json", "--compare-plain"]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["method"] == method
    assert out["matches_plain"] is True and out["stats"]["accepted"] > 0


def test_heads_of_another_target_are_a_one_line_error(folders, tmp_path, capsys):
    _, heads = folders
    tiny_llama(3).save_pretrained(tmp_path / "other")
    code = main(["generate", "--target", str(tmp_path / "other"), "--method", "eagle", "--heads", str(heads),
                 "--prompt", "1 2", "--max-new-tokens", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "were trained for" in err and err.count("\n") == 1


def test_acceptance_flag_reaches_the_config(capsys):
    args = build_parser().parse_args(["generate", "--prompt", "x", "--acceptance", "typical"])
    assert args.acceptance == "typical"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--acceptance", "lossy"])
    assert "typical" in capsys.readouterr().err
