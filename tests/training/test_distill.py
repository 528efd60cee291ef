"""Self-distillation data: prompts from ShareGPT and the standard library, the target's replies
appended with their exact token ids, and those records as a training source."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import needs_smollm2
from tests.training.test_data import ModTokenizer
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.heads.identity import identify
from verispec.structured import Structured
from verispec.training.cache import prepare_store
from verispec.training.data import DataSpec, build_examples, distilled_example
from verispec.training.distill import distill
from verispec.training.prompts import (
    JSON_SCHEMAS,
    LONG_CHARS,
    DistillPrompt,
    function_prompts,
    json_prompts,
    method_prompts,
    rebuild_prompt,
    sharegpt_index,
    sharegpt_prompts,
    stdlib_prompts,
)
from verispec.training.records import read_records

SOURCE = '''"""A module."""
import os


def documented(a, b=1):
    """Add two numbers, the second one optional, and return their sum as an int."""
    total = a + b
    return total


@decorator
def decorated(x):
    """A decorated function's prompt would start at the decorator: left out for that."""
    return x


def short_doc(x):
    """Too short."""
    return x


def only_doc():
    """A docstring and nothing else: there is no body to complete, so it is left out."""


class Holder:
    def method(self):
        """A method needs its class around it: a function prompt leaves it out, a method prompt has it."""
        return 1


class Base(
    Holder,  # a comment with a colon: here
    metaclass=type,
):  # the header ends here
    """The class docstring is not part of a method's prompt."""

    limit = 3

    def grow(self, n):
        """Grow by n, never past the limit set on the class, and return the new size of it."""
        self.n = min(self.n + n, self.limit)
        return self.n

    @property
    def size(self):
        """A decorated method starts at its decorator: left out, as decorated functions are."""
        return self.n
'''


def test_function_prompts_are_signature_and_docstring_of_top_level_functions():
    got = dict(function_prompts(SOURCE))
    assert list(got) == ["documented"]
    assert got["documented"] == (
        'def documented(a, b=1):\n    """Add two numbers, the second one optional, and return their '
        'sum as an int."""\n'
    )
    assert list(function_prompts("def broken(:\n")) == []


def test_method_prompts_put_each_documented_method_under_its_class_header():
    got = dict(method_prompts(SOURCE))
    assert list(got) == ["Holder.method", "Base.grow"]
    assert got["Holder.method"] == (
        'class Holder:\n    def method(self):\n        """A method needs its class around it: a function '
        'prompt leaves it out, a method prompt has it."""\n'
    )
    assert got["Base.grow"] == (
        "class Base(\n    Holder,  # a comment with a colon: here\n    metaclass=type,\n"
        "):  # the header ends here\n"
        '    def grow(self, n):\n        """Grow by n, never past the limit set on the class, and return the '
        'new size of it."""\n'
    )
    for prompt in got.values():
        compile(prompt + "        pass\n", "<prompt>", "exec")  # the model continues valid code
    assert list(method_prompts("class Broken(:\n")) == []


def test_stdlib_method_prompts_are_new_prompts_with_their_own_ids():
    methods = stdlib_prompts(40, per_file=4, kind="methods")
    functions = {p.id for p in stdlib_prompts(400, per_file=32)}
    assert len(methods) == 40 and not functions & {p.id for p in methods}
    assert all(p.text.startswith("class ") and "\n    def " in p.text for p in methods)
    with pytest.raises(VerispecError, match="functions or methods"):
        stdlib_prompts(1, kind="classes")


def test_stdlib_prompts_are_seeded_completion_prompts():
    prompts = stdlib_prompts(20, seed=0)
    assert len(prompts) == 20 and prompts == stdlib_prompts(20, seed=0) != stdlib_prompts(20, seed=1)
    assert len({p.id for p in prompts}) == 20
    for p in prompts:
        assert p.kind == "text" and p.text.startswith(("def ", "async def ")) and p.text.endswith("\n")
        assert "/test/" not in p.id and "/tests/" not in p.id


def test_stdlib_prompts_take_up_to_per_file_functions_from_each_file():
    """More functions per file give more prompts; the files keep their seeded order."""
    few, many = stdlib_prompts(60, per_file=1), stdlib_prompts(60, per_file=4)
    modules = [p.id.rsplit(":", 1)[0] for p in many]
    assert len({p.id.rsplit(":", 1)[0] for p in few}) == 60
    assert max(modules.count(m) for m in modules) == 4 and len(set(modules)) < 60
    assert [p.id for p in stdlib_prompts(60, per_file=2)][:2] == [p.id for p in many][:2]


def test_distill_command_refuses_bad_counts_before_loading(capsys, tmp_path):
    from verispec.cli import main

    out = tmp_path / "d.jsonl"
    assert main(["distill", "--out", str(out), "--code-per-file", "0"]) == 2
    assert "--code-per-file must be >= 1" in capsys.readouterr().err
    assert main(["distill", "--out", str(out), "--chat", "0", "--code", "0"]) == 2
    assert "not all 0" in capsys.readouterr().err and not out.exists()
    for flag in ("--json", "--long"):
        assert main(["distill", "--out", str(out), flag, "-1"]) == 2
        err = capsys.readouterr().err
        assert flag in err and "must be >= 0" in err and not out.exists()
    assert main(["distill", "--out", str(out), "--cache-dir", str(tmp_path / "s")]) == 2
    assert "--keep-hidden" in capsys.readouterr().err and not out.exists()


def test_sharegpt_prompts_come_from_the_end_of_the_training_order(tmp_path, monkeypatch):
    """Training consumes the seeded order from its start; distillation takes first turns from its end,
    so the two meet only if both use nearly everything."""
    reply = {"from": "gpt", "value": "a"}
    turns = [[{"from": "human", "value": f"the question {i:03d}"}, reply] for i in range(50)]
    conversations = [{"conversations": t} for t in turns]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(conversations))
    monkeypatch.setattr("verispec.training.prompts.sharegpt_file", lambda: path)
    monkeypatch.setattr("verispec.training.data.sharegpt_file", lambda: path)
    prompts = sharegpt_prompts(10)
    assert len(prompts) == 10 and all(p.kind == "chat" and len(p.messages) == 1 for p in prompts)
    spec = DataSpec(max_tokens=1000, sources=("sharegpt",), max_seq_len=200)
    trained, _ = build_examples(ModTokenizer(), spec, 600, progress=False)
    trained_texts = {"".join(chr(t) for t in e.ids if t > 31) for e in trained}
    asked = [p.messages[0][1] for p in prompts]
    assert 10 < len(trained) < 40 and not any(q in text for q in asked for text in trained_texts)


def test_long_prompts_are_the_first_turns_chat_prompts_skip_and_are_made_again_from_their_ids(
    tmp_path, monkeypatch
):
    """``--long`` takes the first turns too long for ``--chat`` (never the same conversation), from the
    same end of the training order; a pack's id is enough to make one again, as for a chat prompt."""
    lengths = [100, 2500, 50, 2001, 3000, 3001, 2999, 10]
    turns = [[{"from": "human", "value": f"{i}" + "x" * (n - 1)}, {"from": "gpt", "value": "a"}]
             for i, n in enumerate(lengths)]  # fmt: skip
    path = tmp_path / "share.json"
    path.write_text(json.dumps([{"conversations": t} for t in turns]))
    monkeypatch.setattr("verispec.training.prompts.sharegpt_file", lambda: path)
    long = sharegpt_prompts(10, chars=LONG_CHARS)
    chat = sharegpt_prompts(10)
    assert sorted(sharegpt_index(p.id) for p in long) == [1, 3, 4, 6]
    assert sorted(sharegpt_index(p.id) for p in chat) == [0, 2]  # 10 characters are too few for either
    assert [p.id for p in sharegpt_prompts(2, chars=LONG_CHARS)] == [p.id for p in long[:2]]
    conversations = [[{"role": "user", "content": t[0]["value"]}] for t in turns]
    for p in long + chat:
        assert rebuild_prompt(p.id, p.kind, "", lambda i: conversations[i]) == p
    assert rebuild_prompt("sharegpt:5", "chat", "", lambda i: conversations[i]) is None  # too long for both


def test_json_prompts_alternate_questions_and_functions_and_are_made_again_from_their_ids(
    tmp_path, monkeypatch
):
    """JSON-mode prompts: a ShareGPT question to answer and a standard-library function to describe,
    alternating, each naming its schema; a pack keeps only the id (and the code), and that is enough
    to make the same prompt again. Ids that name nothing rebuildable are refused."""
    turns = [[{"from": "human", "value": f"the question number {i:03d}"}, {"from": "gpt", "value": "a"}]
             for i in range(20)]  # fmt: skip
    path = tmp_path / "share.json"
    path.write_text(json.dumps([{"conversations": t} for t in turns]))
    monkeypatch.setattr("verispec.training.prompts.sharegpt_file", lambda: path)
    conversations = [[{"role": "user", "content": t[0]["value"]}] for t in turns]
    prompts = json_prompts(5)
    assert [p.schema for p in prompts] == ["answer", "function", "answer", "function", "answer"]
    assert all(p.kind == "chat" and len(p.messages) == 1 for p in prompts)
    assert prompts[0].id.startswith("json-answer:sharegpt:") and "JSON object" in prompts[0].messages[0][1]
    assert prompts[1].id.startswith("json-function:stdlib:") and prompts[1].text.startswith("def ")
    assert prompts[1].text in prompts[1].messages[0][1]
    asked = [sharegpt_index(p.id) for p in prompts if p.schema == "answer"]
    assert asked != [sharegpt_index(p.id) for p in sharegpt_prompts(3)]  # an order of its own
    for p in prompts:
        assert rebuild_prompt(p.id, p.kind, p.text, lambda i: conversations[i]) == p
    for id, text in (("json-answer:other:1", ""), ("json-function:x", ""), ("sharegpt:99", "")):
        assert rebuild_prompt(id, "chat", text, lambda i: conversations[i] if i < 20 else None) is None
    assert set(JSON_SCHEMAS) == {"answer", "function"}


def test_records_become_examples_with_the_exact_tokens():
    chat = {"kind": "chat", "prompt_ids": [5, 6, 7], "completion_ids": [8, 9]}
    text = {"kind": "text", "prompt_ids": [5, 6, 7], "completion_ids": [8, 9]}
    a, b = distilled_example(chat, 100), distilled_example(text, 4)
    assert a.ids == [5, 6, 7, 8, 9] and a.labelled == [False, False, False, True, True]
    assert a.source == "distilled"
    assert b.ids == [5, 6, 7, 8] and b.labelled == [True] * 4  # raw code: labelled whole, then cut


def test_a_cut_off_last_line_is_dropped(tmp_path):
    path = tmp_path / "d.jsonl"
    good = {"id": "a", "kind": "chat", "prompt_ids": [1], "completion_ids": [2]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "b"})[:20])
    assert [r["id"] for r in read_records(path)] == ["a"]
    assert read_records(tmp_path / "missing.jsonl") == []


def test_unicode_line_separators_stay_inside_their_record(tmp_path):
    path = tmp_path / "d.jsonl"
    odd = {"id": "odd", "kind": "chat", "messages": [["user", "a\u2028b\u2029c\x85d\x1ce\rf"]],
           "prompt_ids": [1], "completion_ids": [2]}  # fmt: skip
    with path.open("w", encoding="utf-8") as f:  # as distill() writes them
        for record in (odd, {**odd, "id": "next"}):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    assert [r["id"] for r in read_records(path)] == ["odd", "next"]
    assert read_records(path)[0]["messages"] == odd["messages"]


def test_the_distilled_source_needs_its_file():
    with pytest.raises(VerispecError, match="go together"):
        DataSpec(sources=("distilled",))
    with pytest.raises(VerispecError, match="go together"):
        DataSpec(distilled="/x.jsonl")
    spec = DataSpec(sources=("distilled",), distilled="/x.jsonl")
    assert spec.key() != DataSpec(sources=("distilled",), distilled="/y.jsonl").key() != DataSpec().key()


def write_records(path, n, start=0):
    with path.open("a") as f:
        for i in range(start, start + n):
            ids = [(3 * i + t) % 90 + 1 for t in range(40)]
            f.write(json.dumps({"id": f"r{i}", "kind": "chat" if i % 2 else "text",
                                "prompt_ids": ids[:10], "completion_ids": ids[10:]}) + "\n")  # fmt: skip


def test_a_store_of_distilled_records_grows_with_the_file(tmp_path, tiny_target, monkeypatch):
    monkeypatch.setattr(tiny_target, "tokenizer", ModTokenizer(), raising=False)
    path = tmp_path / "d.jsonl"
    write_records(path, 30)
    spec = DataSpec(max_tokens=1000, sources=("distilled",), distilled=str(path))
    store = prepare_store(tiny_target, identify(tiny_target), spec, tmp_path / "s", progress=False)
    assert store.complete and store.tokens == 1000 and store.cursor.distilled == 25
    assert (np.asarray(store.array("source")) == 2).all()
    first = np.asarray(store.array("labelled"))[:40].tolist()
    assert first == [True] * 40  # record 0 is raw text: labelled whole
    assert np.asarray(store.array("labelled"))[40:80].tolist() == [False] * 10 + [True] * 30
    write_records(path, 30, start=30)  # the file grows (a resumed `verispec distill`)
    bigger = DataSpec(max_tokens=2000, sources=("distilled",), distilled=str(path))
    grown = prepare_store(tiny_target, identify(tiny_target), bigger, tmp_path / "s", progress=False)
    assert grown.tokens == 2000 and grown.cursor.distilled == 50
    assert np.asarray(grown.array("tokens"))[1000:1040].tolist() == [(3 * 25 + t) % 90 + 1 for t in range(40)]


def test_replies_of_another_model_are_refused_before_any_work(tmp_path, tiny_target, monkeypatch):
    monkeypatch.setattr(tiny_target, "tokenizer", ModTokenizer(), raising=False)
    identity = identify(tiny_target)
    spec = DataSpec(max_tokens=1000, sources=("distilled",), distilled=str(tmp_path / "d.jsonl"))
    record = {"id": "a", "kind": "chat", "prompt_ids": [1, 2], "completion_ids": [3, 4] * 10}
    other = {"target": "big", "target_config_sha256": "0" * 64}
    for bad in (other, {"prompt_ids": [1, identity.vocab_size]}):
        (tmp_path / "d.jsonl").write_text(json.dumps({**record, **bad}) + "\n")
        with pytest.raises(VerispecError, match="not of tiny-target"):
            prepare_store(tiny_target, identity, spec, tmp_path / "s", progress=False)
        assert not (tmp_path / "s").exists()
    mine = {"target": "tiny-target", "target_config_sha256": identity.config_sha256}
    (tmp_path / "d.jsonl").write_text(json.dumps({**record, **mine}) + "\n")
    assert prepare_store(tiny_target, identity, spec, tmp_path / "s", progress=False).tokens == 22


@needs_smollm2
def test_distill_writes_the_targets_greedy_replies_and_resumes(
    tmp_path, capsys, restore_torch_threads, monkeypatch
):
    """On a real model: the records hold exactly what plain greedy decoding writes (the command
    speculates with prompt lookup, which must not change a token), and a rerun adds nothing."""
    import verispec

    questions = ["Write a haiku about the sea, please.", "What is a Python list comprehension?"]
    turns = [[{"from": "human", "value": q}, {"from": "gpt", "value": "a"}] for q in questions]
    share = [{"conversations": t} for t in turns]
    (tmp_path / "share.json").write_text(json.dumps(share))  # CI has no ShareGPT package (training data)
    monkeypatch.setattr("verispec.training.prompts.sharegpt_file", lambda: tmp_path / "share.json")
    monkeypatch.setattr("verispec.training.data.sharegpt_file", lambda: tmp_path / "share.json")  # unpacking
    out = tmp_path / "d.jsonl"
    args = ["distill", "--target", "smollm2-135m-instruct", "--out", str(out), "--chat", "2", "--code", "2",
            "--json", "2", "--max-new-tokens", "24", "--quiet", "--threads", "2"]  # fmt: skip
    assert main(args) == 0
    records = read_records(out)
    kinds = [("chat", ""), ("chat", ""), ("chat", "answer"), ("chat", "function"), ("text", ""), ("text", "")]
    assert sorted((r["kind"], r["schema"]) for r in records) == kinds
    assert {r["target"] for r in records} == {"smollm2-135m-instruct"}
    plain = verispec.load("smollm2-135m-instruct", method="none", threads=2)
    for r in records:
        grammar = Structured("json", JSON_SCHEMAS[r["schema"]]) if r["schema"] else None
        gen = plain.generate(r["prompt_ids"], max_new_tokens=24, structured=grammar)
        assert r["completion_ids"] == gen.token_ids and r["completion"] == gen.text
        if r["kind"] == "text":
            assert plain.encode(r["text"]) == r["prompt_ids"]
    by_schema = {r["schema"]: r for r in records}
    assert by_schema["answer"]["completion"].startswith('{"topic":"')  # written under its schema
    assert by_schema["function"]["completion"].startswith('{"name":"')
    printed = capsys.readouterr().out
    assert "6 replies written now" in printed and "6 records" in printed
    assert main(args) == 0
    assert len(read_records(out)) == 6 and "0 replies written now" in capsys.readouterr().out
    # More prompts later: only the new ones are answered.
    engine = verispec.load("smollm2-135m-instruct", method="ngram", threads=2)
    extra = [DistillPrompt("extra:0", "text", text="def add(a, b):\n    ")]
    with out.open("a") as f:
        f.write('{"id": "cut off')  # an interrupted write
    assert distill(engine, extra, out, max_new_tokens=8, progress=False) == 1
    assert len(read_records(out)) == 7 and read_records(out)[-1]["id"] == "extra:0"
    # Kept in git as a pack and made again elsewhere: the real chat template rebuilds the same prompts.
    pack = tmp_path / "p.jsonl.gz"
    only = ["distill", "--target", "smollm2-135m-instruct", "--chat", "0", "--code", "0", "--quiet",
            "--threads", "2"]  # fmt: skip
    assert main([*only, "--out", str(out), "--pack", str(pack)]) == 0
    assert main([*only, "--out", str(tmp_path / "again.jsonl"), "--unpack", str(pack)]) == 0
    assert "7 replies added" in capsys.readouterr().out
    keys = ("id", "kind", "text", "prompt_ids", "completion_ids", "finish_reason", "target_config_sha256")
    again = read_records(tmp_path / "again.jsonl")
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in read_records(out)]
