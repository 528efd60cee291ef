"""`verispec bench quality --reference llamacpp`: verispec's model against llama.cpp's greedy replies.

The arithmetic is checked on hand-made logits, the alignment of rows to reply tokens on both sides,
and the whole comparison with fakes of llama.cpp that need no llama-cpp-python: one whose logits are
written by hand (the worker's scoring), and one that runs a tiny PyTorch model, so that the same
model on both sides must agree everywhere. The last test runs the real llama.cpp on SmolLM2 where
llama-cpp-python is installed.
"""

from __future__ import annotations

import gzip
import inspect
import io
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import needs_smollm2
from verispec.bench import llamacpp_worker
from verispec.bench import quality_llamacpp as q
from verispec.bench.datasets import BenchPrompt
from verispec.bench.llamacpp_baselines import WORKER
from verispec.bench.quality import all_logits
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.models.hf import HFCausalLM

# --- arithmetic on hand-made logits ---------------------------------------------------------------


def test_token_scores_top_tokens_and_nll_on_hand_made_logits():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    top, nll = q.token_scores(logits, [1, 2])
    assert top == [0, 2]
    assert nll == pytest.approx([math.log(4), -math.log(0.8)])
    assert q.agreeing(top, [1, 2]) == 1
    assert q.perplexity(nll) == pytest.approx(math.sqrt(4 / 0.8))  # exp(mean nll)
    with pytest.raises(ValueError, match="2 rows of logits for 3 reply tokens"):
        q.token_scores(logits, [1, 2, 0])


def test_logits_shifted_by_a_constant_score_the_same():
    """Only the softmax counts: llama.cpp and verispec may offset their logits differently."""
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, 1.0]])
    top, nll = q.token_scores(logits, [2, 1])
    shifted_top, shifted_nll = q.token_scores(logits + 40.0, [2, 1])
    assert shifted_top == top and shifted_nll == pytest.approx(nll)


def test_first_difference_and_perplexity_edges():
    assert q.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert q.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert q.first_difference([9, 1, 2], [1, 2]) == 0  # a BOS one side only shows at 0
    assert q.first_difference([1, 2], [1, 2, 3]) == 2
    assert q.perplexity([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError):
        q.perplexity([])


class ScoresLlama:
    """A llama.cpp stand-in whose logits are written by hand: row ``p`` of ``scores`` is one-hot
    (log 0.7 on ``(token + 1) % 4``, log 0.1 elsewhere) on the token at position ``p``. Rows are
    filled only while ``_logits_all`` is on, as llama-cpp-python does."""

    VOCAB = 4

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.scores = np.full((32, self.VOCAB), np.nan, dtype=np.float32)
        self._logits_all = False
        self.evals: list[tuple[list[int], bool]] = []

    def n_ctx(self) -> int:
        return 32

    def n_vocab(self) -> int:
        return self.VOCAB

    def token_eos(self) -> int:
        return 3

    def reset(self) -> None:
        self.tokens = []
        self.scores[:] = np.nan

    def eval(self, tokens: list[int]) -> None:
        self.evals.append((list(tokens), self._logits_all))
        for token in tokens:
            if self._logits_all:
                row = np.full(self.VOCAB, math.log(0.1))
                row[(token + 1) % self.VOCAB] = math.log(0.7)
                self.scores[len(self.tokens)] = row
            self.tokens.append(token)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return [b % self.VOCAB for b in text]


def test_worker_scores_each_reply_token_from_the_row_before_it():
    llm = ScoresLlama()
    nll, top = llamacpp_worker.score(llm, [1, 2, 3], [0, 2])
    # Reply token 0 is predicted by the row of prompt token 3 (top 0), reply token 2 by the row of 0.
    assert top == [0, 1]
    assert nll == pytest.approx([-math.log(0.7), -math.log(0.1)], rel=1e-6)
    # The prompt but its last token without logits, then the scored rows with them; off again after.
    assert llm.evals == [([1, 2], False), ([3, 0], True)]
    assert llm._logits_all is False


def test_worker_refuses_to_score_ids_outside_its_vocabulary():
    with pytest.raises(ValueError, match=r"outside llama\.cpp's vocabulary of 4: \[7\]"):
        llamacpp_worker.score(ScoresLlama(), [1, 7], [0])
    with pytest.raises(ValueError, match="at least one token"):
        llamacpp_worker.score(ScoresLlama(), [1], [])


def test_worker_protocol_answers_tokenize_and_score_and_reports_bad_requests(monkeypatch):
    monkeypatch.setattr(llamacpp_worker, "load", lambda settings: ScoresLlama())
    lines = [
        {"model_path": "m.gguf", "logits_all": True},
        {"kind": "tokenize", "text": "ab", "add_special": False},
        {"kind": "score", "prompt_ids": [1], "reply_ids": [2, 3]},
        {"kind": "score", "prompt_ids": [1]},
        {"kind": "embed"},
    ]
    out = io.StringIO()
    assert llamacpp_worker.serve(io.StringIO("".join(json.dumps(m) + "\n" for m in lines)), out) == 0
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"ready": {"n_ctx": 32, "eos": 3}}
    assert replies[1] == {"ids": [ord("a") % 4, ord("b") % 4]}
    assert replies[2]["top"] == [2, 3] and replies[2]["nll"] == pytest.approx([-math.log(0.7)] * 2)
    assert replies[3] == {"error": "the request has no 'reply_ids'"}
    assert replies[4] == {"error": "unknown request kind 'embed'"}


# --- verispec's side: the rows that predict the reply ---------------------------------------------


def test_teacher_forcing_rows_are_the_full_forward_rows_that_predict_the_reply(tiny_target):
    prompt, reply = [5, 17, 3, 40, 2], [8, 9, 60]
    rows = q.teacher_force(tiny_target, prompt, reply)
    full = all_logits(tiny_target, prompt + reply)  # row i predicts token i + 1
    assert rows.shape == (3, tiny_target.vocab_size)
    torch.testing.assert_close(rows, full[len(prompt) - 1 : -1], atol=1e-4, rtol=1e-4)
    one = q.teacher_force(tiny_target, [5], [8])  # a one-token prompt has no prefill
    torch.testing.assert_close(one, full[:1], atol=1e-4, rtol=1e-4)


# --- the whole comparison, llama.cpp played by a PyTorch model -------------------------------------


class FakeTokenizer:
    """Characters as token ids inside the tiny models' vocabulary; a chat template that frames the
    user's text with two marker tokens."""

    chat_template = "fake"

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % 80 for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        text = "\x01" + messages[0]["content"] + "\x02"
        return self.encode(text) if kwargs["tokenize"] else text


class ModelLlama:
    """llama.cpp played by a PyTorch model: greedy generation and logits from ``model``; its
    tokenizer is :class:`FakeTokenizer`'s, with a BOS token 1 in front of raw text if ``bos``."""

    def __init__(self, model: HFCausalLM, bos: bool = False) -> None:
        self.model = model
        self.bos = bos
        self.tokens: list[int] = []
        self.scores = np.full((256, model.vocab_size), np.nan, dtype=np.float32)
        self._logits_all = False

    def n_vocab(self) -> int:
        return self.model.vocab_size

    def reset(self) -> None:
        self.tokens = []

    def eval(self, tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens += tokens
        if self._logits_all:
            self.scores[start : len(self.tokens)] = all_logits(self.model, self.tokens)[start:].numpy()

    def generate(self, prompt_ids: list[int], **sampling: float):
        tokens = list(prompt_ids)
        while True:
            token = int(all_logits(self.model, tokens)[-1].argmax())
            tokens.append(token)
            yield token

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return ([1] if add_bos and self.bos else []) + FakeTokenizer().encode(text.decode())


class InProcessReference:
    """The :class:`~verispec.bench.quality_llamacpp.Reference` a worker process would be, in this
    process: every request goes through the worker's own :func:`llamacpp_worker.answer`."""

    def __init__(self, llm: ModelLlama) -> None:
        self.llm = llm

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return llamacpp_worker.answer(
            self.llm, {"kind": "tokenize", "text": text, "add_special": add_special}
        )["ids"]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int]):
        request = {"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, "eos_ids": sorted(eos_ids)}
        reply = llamacpp_worker.answer(self.llm, request)
        return reply["tokens"], reply["seconds"]

    def score(self, prompt_ids: list[int], reply_ids: list[int]):
        reply = llamacpp_worker.answer(
            self.llm, {"kind": "score", "prompt_ids": prompt_ids, "reply_ids": reply_ids}
        )
        return reply["nll"], reply["top"]


PROMPTS = [
    BenchPrompt(dataset="humaneval", category="code", id="HumanEval/0", turns=["def add(a, b):"], chat=False),
    BenchPrompt(dataset="spec_bench", category="qa", id="7", turns=["Why is the sky blue?"], chat=True),
]


def compare(target: HFCausalLM, llm: ModelLlama, max_new_tokens: int = 6, context: int = 128):
    prompts = [q.prompt_ids(FakeTokenizer(), p) for p in PROMPTS]
    replies, skipped = q.compare_replies(
        target, InProcessReference(llm), prompts, max_new_tokens, frozenset(), context
    )
    report = q.LlamaCppQualityReport(
        target=target.name,
        quantization="none",
        gguf="/models/fake.gguf",
        llamacpp_version="0",
        threads=1,
        max_new_tokens=max_new_tokens,
        datasets=["humaneval", "spec_bench"],
        replies=replies,
        skipped=skipped,
    )
    return report


def test_prompt_ids_raw_and_through_the_chat_template():
    raw, chat = (q.prompt_ids(FakeTokenizer(), p) for p in PROMPTS)
    assert raw.ids == FakeTokenizer().encode("def add(a, b):") and raw.add_special
    assert chat.text == "\x01Why is the sky blue?\x02" and not chat.add_special
    assert chat.ids == FakeTokenizer().encode(chat.text)


def test_the_same_model_on_both_sides_agrees_everywhere(tiny_target):
    report = compare(tiny_target, ModelLlama(tiny_target))
    assert len(report.replies) == 2 and report.skipped == []
    assert report.positions == 12
    assert report.agreement == 1.0 and report.llamacpp_self_agreement == 1.0
    assert report.perplexity_verispec == pytest.approx(report.perplexity_llamacpp, rel=1e-4)
    assert report.tokenizer_mismatches == []
    data = json.loads(json.dumps(report.to_dict()))  # quality.json is plain JSON
    assert data["reference"] == "llamacpp" and data["agreement"] == 1.0
    assert [p["first_disagreement"] for p in data["per_prompt"]] == [None, None]
    assert "greedy agreement 100.00% over 12 positions" in report.summary()
    assert "tokenizers agree on all 2 prompts" in report.summary()


def test_another_model_disagrees_and_is_less_sure_of_llamacpps_replies(tiny_target, tiny_draft):
    report = compare(tiny_draft, ModelLlama(tiny_target), max_new_tokens=12)
    assert 0.0 <= report.agreement < 1.0
    assert report.llamacpp_self_agreement == 1.0  # llama.cpp's side is unchanged
    assert report.perplexity_verispec > report.perplexity_llamacpp
    first = [r.first_disagreement for r in report.replies]
    assert any(f is not None for f in first)


def test_a_tokenizer_that_differs_on_the_prompt_is_reported(tiny_target):
    report = compare(tiny_target, ModelLlama(tiny_target, bos=True))
    # Raw text gets llama.cpp's BOS; the chat template writes its own, so that prompt agrees.
    assert report.tokenizer_mismatches == ["humaneval/HumanEval/0"]
    assert report.replies[0].tokenizer_difference == 0
    assert "TOKENIZERS DIFFER on 1 of 2 prompts (humaneval/HumanEval/0)" in report.summary()
    assert report.agreement == 1.0  # both models still saw the same ids


def test_prompts_longer_than_the_context_are_skipped_with_the_reason(tiny_target):
    report = compare(tiny_target, ModelLlama(tiny_target), max_new_tokens=6, context=20)
    assert [r.id for r in report.replies] == ["HumanEval/0"]  # 14 + 6 tokens fit, 22 + 6 do not
    assert report.skipped == ["spec_bench/7: 22 prompt + 6 new tokens exceed the context of 20"]
    assert "skipped spec_bench/7" in report.summary()


def test_context_is_the_longest_prompt_and_reply_rounded_up_within_the_model():
    prompts = [q.prompt_ids(FakeTokenizer(), p) for p in PROMPTS]  # 14 and 22 tokens
    assert q.context_size(prompts, 96, 32768) == 256
    assert q.context_size(prompts, 300, 32768) == 512
    assert q.context_size(prompts, 300, 300) == 300


# --- llama.cpp in its own process, and the prompts -------------------------------------------------


def scores_worker(tmp_path: Path) -> list[str]:
    """A real worker process over :class:`ScoresLlama`. It loads the worker's file as the benchmark
    runs it, a script, without the verispec package (and torch): a process that starts in a second."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import importlib.util, math, sys\n"
        "import numpy as np\n"
        f"spec = importlib.util.spec_from_file_location('llamacpp_worker', {str(WORKER)!r})\n"
        "llamacpp_worker = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(llamacpp_worker)\n"
        + textwrap.dedent(inspect.getsource(ScoresLlama))
        + "llamacpp_worker.load = lambda settings: ScoresLlama()\n"
        "sys.exit(llamacpp_worker.main())\n"
    )
    return [sys.executable, str(script)]


def test_scoring_worker_asks_a_process_and_turns_refusals_into_errors(tmp_path):
    settings = {"model_path": "fake.gguf", "n_ctx": 32, "n_batch": 32, "n_threads": 1, "logits_all": True}
    worker = q.ScoringWorker(settings, command=scores_worker(tmp_path))
    try:
        assert worker.tokenize("ab", add_special=True) == [ord("a") % 4, ord("b") % 4]  # starts it
        nll, top = worker.score([1, 2, 3], [0, 2])
        assert top == [0, 1] and nll == pytest.approx([-math.log(0.7), -math.log(0.1)], rel=1e-6)
        with pytest.raises(VerispecError, match=r"refused the score request: .*vocabulary of 4"):
            worker.score([9], [0])
        assert worker.score([1], [2])[1] == [2]  # the same process goes on
    finally:
        worker.stop()


def write_data(root: Path) -> Path:
    (root / "spec_bench").mkdir(parents=True)
    rows = [("writing", 81), ("writing", 82), ("translation", 161), ("translation", 162), ("qa", 321)]
    (root / "spec_bench" / "question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]}) + "\n" for c, i in rows)
    )
    (root / "humaneval").mkdir()
    with gzip.open(root / "humaneval" / "HumanEval.jsonl.gz", "wt") as fh:
        for i in range(4):
            fh.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}) + "\n")
    return root


def test_prompts_are_spread_over_each_datasets_categories(tmp_path):
    data = write_data(tmp_path)
    prompts = q.quality_prompts(["humaneval", "spec_bench"], 3, data)
    assert [(p.dataset, p.id) for p in prompts] == [
        ("humaneval", "HumanEval/0"),
        ("humaneval", "HumanEval/1"),
        ("humaneval", "HumanEval/2"),
        ("spec_bench", "81"),  # one per task, in file order, not the first three rows
        ("spec_bench", "161"),
        ("spec_bench", "321"),
    ]
    with pytest.raises(VerispecError, match="--limit must be >= 1"):
        q.quality_prompts(["humaneval"], 0, data)


# --- the command ------------------------------------------------------------------------------------


def test_without_llama_cpp_the_command_says_so_and_fails(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(q, "llamacpp_installed", lambda: False)
    code = main(["bench", "quality", "--reference", "llamacpp", "--target", "x.gguf", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0
    assert "llama-cpp-python not installed (pip install verispec[llamacpp])" in err
    assert "Traceback" not in err
    assert not (tmp_path / "quality.json").exists()


def test_llamacpp_only_flags_are_refused_with_the_float32_reference(capsys, tmp_path):
    code = main(["bench", "quality", "--max-new-tokens", "8", "--out", str(tmp_path)])
    assert code != 0
    assert "--max-new-tokens go with --reference llamacpp only" in capsys.readouterr().err


def llamacpp_importable() -> bool:
    return q.llamacpp_installed()


@pytest.mark.slow
@needs_smollm2
@pytest.mark.skipif(not llamacpp_importable(), reason="llama-cpp-python not installed")
def test_verispec_and_llamacpp_agree_on_smollm2(tmp_path, capsys, restore_torch_threads):
    code = main(
        [
            "bench",
            "quality",
            "--reference",
            "llamacpp",
            "--target",
            "smollm2-135m-instruct",
            "--quantization",
            "int8",
            "--limit",
            "1",
            "--max-new-tokens",
            "12",
            "--threads",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    assert report["reference"] == "llamacpp" and report["prompts"] == 2 and report["skipped"] == []
    assert 0 < report["positions"] <= 24
    assert 0.0 <= report["agreement"] <= 1.0
    assert report["agreement"] >= 0.6  # the same GGUF: int8 vs llama.cpp's 4-bit kernels, near-ties only
    assert report["llamacpp_self_agreement"] >= 0.9
    for name in ("perplexity_verispec", "perplexity_llamacpp"):
        assert math.isfinite(report[name]) and report[name] >= 1.0
    assert abs(math.log(report["perplexity_verispec"] / report["perplexity_llamacpp"])) < math.log(2)
    assert "greedy agreement" in capsys.readouterr().out
