"""CLI tests: a real subprocess over a tiny model folder, JSON output, one-line user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_smollm2, perturbed, tiny_llama
from verispec.cli import TOOLS, build_parser, main
from verispec.models.registry import BUNDLED
from verispec.settings import flags_by_dest


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    target = tiny_llama(0)
    target.save_pretrained(root / "target")
    perturbed(target, 0.3, seed=1).save_pretrained(root / "draft")
    return root / "target", root / "draft"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json_with_token_id_prompt(tiny_folders):
    target, draft = tiny_folders
    out = run_cli(
        "generate", "--target", str(target), "--draft", str(draft), "-k", "3", "--depth-policy", "fixed",
        "--prompt", "5 17 42 8 9", "--max-new-tokens", "16", "--json", "--compare-plain",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 16
    assert result["method"] == "draft"
    assert result["matches_plain"] is True
    stats = result["stats"]
    assert stats["drafted"] > 0 and stats["accepted"] > 0
    assert stats["mean_accepted_length"] > 1.0
    assert set(stats["seconds"]) == {"total", "draft", "verify", "other"}


def test_generate_with_penalties_matches_plain(tiny_folders):
    target, draft = tiny_folders
    common = ["generate", "--target", str(target), "--prompt", "5 17 42 8 9", "--max-new-tokens", "16"]
    common.append("--json")
    out = run_cli(
        *common, "--draft", str(draft), "-k", "3", "--depth-policy", "fixed", "--compare-plain",
        "--repetition-penalty", "1.3", "--frequency-penalty", "0.5",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["matches_plain"] is True and result["stats"]["accepted"] > 0
    unpenalised = json.loads(run_cli(*common, "--method", "ngram").stdout)
    assert result["token_ids"] != unpenalised["token_ids"]


REPEATING = "5 17 42 8 9 5 17 42 8 9 5 17 42"
"""A prompt whose tail occurred before in it: prompt lookup and suffix decoding have a continuation to
draft at once."""


def test_generate_without_a_method_speculates_by_default(tiny_folders, flat_costs):
    target, _ = tiny_folders
    out = run_cli(
        "generate", "--target", str(target), "--prompt", REPEATING, "--max-new-tokens", "24",
        "--costs", str(flat_costs), "--json", "--compare-plain",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["method"] == "suffix" and result["method_by_default"] is True
    assert result["depth_policy"] == "adaptive" and result["num_speculative_tokens"] == 5
    assert result["stats"]["drafted"] > 0
    assert result["matches_plain"] is True


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "method suffix (default), adaptive depth up to k=5 | "),
        (["--method", "ngram", "--depth-policy", "fixed", "-k", "3"], "method ngram, fixed k=3 | "),
        (["--method", "none"], "method none (plain decoding) | "),
    ],
)
def test_the_summary_line_says_which_method_decoded(tiny_folders, flat_costs, capsys, args, said):
    target, _ = tiny_folders
    common = ["generate", "--target", str(target), "--prompt", REPEATING, "--max-new-tokens", "8"]
    assert main([*common, "--costs", str(flat_costs), *args]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith(said), summary


def test_method_none_decodes_plainly(tiny_folders, capsys):
    target, _ = tiny_folders
    args = ["generate", "--target", str(target), "--prompt", REPEATING, "--max-new-tokens", "8", "--json"]
    assert main([*args, "--method", "none"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] is None and result["method_by_default"] is False
    assert result["num_speculative_tokens"] == 0 and result["stats"]["drafted"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "no-such-model"], "no-such-model"),
        (["-k", "0"], "--num-speculative-tokens must be between 1 and 64, got 0"),
        (["-k", "500"], "--num-speculative-tokens must be between 1 and 64"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--ngram-min", "5"], "--ngram-min must be at most ngram_max (4)"),
        (["--draft-p-min", "1"], "--draft-p-min must be in [0, 1)"),
        (["--presence-penalty", "3"], "--presence-penalty must be between -2 and 2"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
        (["--json-schema", "{not json"], "--json-schema is not JSON"),
        (["--json-schema", "@/no/such/file"], "No such file"),
        (["--regex", "a+"], "structured output needs a tokenizer"),
        (["--method", "draft"], "draft model"),
        (["--suffix", "x"], "suffix needs a tokenizer"),
        (["--suffix", "x", "--chat"], "does not go with --chat"),
    ],
)
def test_user_errors_are_one_line_without_traceback(tiny_folders, args, message):
    target, _ = tiny_folders
    base = [
        "generate",
        "--target",
        str(target),
        "--prompt",
        "1 2 3",
        "--max-new-tokens",
        "4",
        "--method",
        "ngram",
    ]
    out = run_cli(*base, *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert message in out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr


def test_text_prompt_without_tokenizer_is_a_clear_error(tiny_folders):
    target, _ = tiny_folders
    out = run_cli("generate", "--target", str(target), "--prompt", "hello world")
    assert out.returncode == 2 and "token ids" in out.stderr and "Traceback" not in out.stderr


def test_models_lists_the_registry_without_importing_torch():
    """``verispec models`` reads a table: importing PyTorch (seconds) for it would be all its time."""
    script = (
        "import sys; from verispec.cli import main; code = main(['models']); "
        "print('torch imported:', 'torch' in sys.modules); raise SystemExit(code)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in BUNDLED:
        assert name in out.stdout
    assert "torch imported: False" in out.stdout


def test_top_level_help_lists_every_command_without_importing_torch():
    """``verispec --help`` is a newcomer's first command: the tools that import PyTorch (5 s) are
    listed by their one-line help, their flags added only when they run."""
    script = (
        "import sys; from verispec.cli import main\n"
        "try: main(['--help'])\n"
        "except SystemExit as exit: print('torch imported:', 'torch' in sys.modules); raise"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for command in ("generate", "serve", "models", "bench", "plan", *TOOLS):
        assert f"    {command} " in out.stdout, command
    for help in TOOLS.values():
        assert " ".join(help.split()[:4]) in " ".join(out.stdout.split())
    assert "torch imported: False" in out.stdout
    train = build_parser("train")
    assert {"--draft-vocab", "--aux-layers"} <= set(flags_by_dest(train).values())  # its own flags, in full


@needs_smollm2
@pytest.mark.slow
def test_generate_with_a_regex_on_a_real_model():
    out = run_cli(
        "generate", "--target", "smollm2-135m-instruct", "--method", "ngram", "--chat", "--json",
        "--prompt", "What year did the Apollo 11 mission land?", "--regex", "[0-9]{4}", "--compare-plain",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["text"]) == 4 and result["text"].isdigit() and result["matches_plain"] is True
