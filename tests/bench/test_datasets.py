"""The benchmark prompt loaders, read from the real files packaged in verispec/data."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

import verispec
from verispec.bench.datasets import DATA_DIR_ENV, BenchPrompt, default_data_dir, load_dataset
from verispec.data import dataset_dir
from verispec.errors import VerispecError

SPEC_BENCH_SIZES = {
    "mt_bench": 80,
    "translation": 80,
    "summarization": 80,
    "qa": 80,
    "math_reasoning": 80,
    "rag": 80,
}
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def test_spec_bench_counts_and_categories() -> None:
    prompts = load_dataset("spec_bench")
    assert len(prompts) == 480
    assert Counter(p.category for p in prompts) == SPEC_BENCH_SIZES
    assert [p.id for p in prompts] == [str(i) for i in range(81, 561)]  # file order
    assert all(p.dataset == "spec_bench" and p.chat for p in prompts)
    turns = Counter((p.category, len(p.turns)) for p in prompts)
    assert turns == {("mt_bench", 2): 80, **{(c, 1): 80 for c in SPEC_BENCH_SIZES if c != "mt_bench"}}


def test_mt_bench_two_turns_eight_categories() -> None:
    prompts = load_dataset("mt_bench")
    assert len(prompts) == 80
    assert Counter(p.category for p in prompts) == dict.fromkeys(MT_BENCH, 10)
    assert all(len(p.turns) == 2 and all(isinstance(t, str) and t for t in p.turns) for p in prompts)
    # Spec-Bench's multi-turn task is the same 80 questions.
    spec_mt = load_dataset("spec_bench", categories=["mt_bench"])
    assert [(p.id, p.turns) for p in spec_mt] == [(p.id, p.turns) for p in prompts]


def test_humaneval_prompt_is_signature_and_docstring() -> None:
    prompts = load_dataset("humaneval")
    assert len(prompts) == 164
    first = prompts[0]
    assert first == BenchPrompt(
        dataset="humaneval", category="code", id="HumanEval/0", turns=[first.turns[0]], chat=False
    )
    text = first.turns[0]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in text
    assert text.rstrip().endswith('"""')  # ends with the docstring: the body is left to the model
    assert "return" not in text
    with gzip.open(dataset_dir("humaneval") / "HumanEval.jsonl.gz", "rt") as f:
        raw = [json.loads(line) for line in f]
    assert [p.turns for p in prompts] == [[row["prompt"]] for row in raw]


def test_limit_per_category_takes_the_first_rows_in_file_order() -> None:
    everything = load_dataset("spec_bench")
    picked = load_dataset("spec_bench", limit_per_category=3)
    assert Counter(p.category for p in picked) == dict.fromkeys(SPEC_BENCH_SIZES, 3)
    seen: Counter[str] = Counter()
    expected = []
    for prompt in everything:
        seen[prompt.category] += 1
        if seen[prompt.category] <= 3:
            expected.append(prompt)
    assert picked == expected
    assert [p.id for p in picked if p.category == "mt_bench"] == ["81", "82", "83"]  # all "writing"
    assert picked == load_dataset("spec_bench", limit_per_category=3)  # deterministic


def test_categories_and_limit_filters() -> None:
    picked = load_dataset("spec_bench", categories=["rag", "qa"], limit_per_category=2)
    assert [(p.category, p.id) for p in picked] == [
        ("qa", "321"),
        ("qa", "322"),
        ("rag", "481"),
        ("rag", "482"),
    ]
    assert [p.id for p in load_dataset("mt_bench", limit=5)] == ["81", "82", "83", "84", "85"]
    assert [p.id for p in load_dataset("mt_bench", categories=["coding"], limit=3)] == ["121", "122", "123"]
    assert load_dataset("humaneval", limit=0) == []
    assert len(load_dataset("humaneval", limit_per_category=7)) == 7


def test_unknown_category_lists_valid_ones() -> None:
    with pytest.raises(VerispecError, match="writing") as info:
        load_dataset("spec_bench", categories=["writing"])  # an MT-bench category, not a Spec-Bench task
    assert all(task in str(info.value) for task in SPEC_BENCH_SIZES)


def test_unknown_dataset_lists_valid_ones() -> None:
    with pytest.raises(VerispecError, match="spec_bench, mt_bench, humaneval"):
        load_dataset("gsm8k")  # type: ignore[arg-type]


def test_missing_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(VerispecError, match="--data-dir"):
        load_dataset("mt_bench", data_dir=missing)
    monkeypatch.setenv(DATA_DIR_ENV, str(missing))
    with pytest.raises(VerispecError, match="--data-dir"):
        load_dataset("mt_bench")


def test_the_default_is_the_packaged_data_and_an_explicit_folder_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --data-dir or the variable, the prompts come from inside the package, so nothing
    beside the repository (or beside an install) is needed; either one still wins."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    package = Path(verispec.__file__).resolve().parent
    assert default_data_dir().resolve() == package / "data"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert default_data_dir() == tmp_path


def test_data_dir_from_argument_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "mt_bench"
    folder.mkdir()
    row = {"question_id": 1, "category": "stem", "turns": ["a", "b"]}
    (folder / "question.jsonl").write_text(json.dumps(row) + "\n")
    expected = [BenchPrompt(dataset="mt_bench", category="stem", id="1", turns=["a", "b"], chat=True)]
    assert load_dataset("mt_bench", data_dir=tmp_path) == expected
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert load_dataset("mt_bench") == expected
    with pytest.raises(VerispecError, match="missing"):
        load_dataset("humaneval")  # the folder exists but holds no HumanEval file


def test_seed_samples_reproducibly_and_differs_from_file_order():
    first = load_dataset("spec_bench", limit_per_category=3)
    a = load_dataset("spec_bench", limit_per_category=3, seed=1)
    b = load_dataset("spec_bench", limit_per_category=3, seed=1)
    c = load_dataset("spec_bench", limit_per_category=3, seed=2)
    assert [p.id for p in a] == [p.id for p in b]
    assert [p.id for p in a] != [p.id for p in first] and [p.id for p in a] != [p.id for p in c]
    assert sorted({p.category for p in a}) == sorted({p.category for p in first})
    assert all(sum(p.category == cat for p in a) == 3 for cat in {p.category for p in a})
