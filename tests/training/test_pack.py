"""Distill packs: replies kept in git without ShareGPT's text, rebuilt into full records and checked."""

from __future__ import annotations

import gzip
import json

import pytest

from verispec.cli import main
from verispec.errors import VerispecError
from verispec.heads.identity import TargetIdentity
from verispec.training.pack import prompt_hash, read_pack, unpack, write_pack
from verispec.training.prompts import LONG_CHARS, DistillPrompt, json_answer_prompt, json_function_prompt
from verispec.training.records import read_records

ARTICLE = "Summarise this article:\n\n" + "The quick brown fox jumps over the lazy dog. " * 55
QUESTIONS = [
    "What is the capital of France, and why?",
    "short",
    "Explain recursion to a child, please.",
    ARTICLE,
]
ME = TargetIdentity("tiny", 100, 8, "a" * 64, ())


def encode(prompt: DistillPrompt) -> list[int]:
    """A stand-in for the chat template: the user's text (or the raw text) as character codes."""
    text = prompt.messages[0][1] if prompt.kind == "chat" else prompt.text
    return [ord(c) % 90 + 1 for c in "<user>" * (prompt.kind == "chat") + text]


@pytest.fixture
def share(tmp_path, monkeypatch):
    """A four-conversation ShareGPT file in place of the package (CI does not install it)."""
    turns = [[{"from": "human", "value": q}, {"from": "gpt", "value": "an answer"}] for q in QUESTIONS]
    path = tmp_path / "share.json"
    path.write_text(json.dumps([{"conversations": t} for t in turns]))
    monkeypatch.setattr("verispec.training.data.sharegpt_file", lambda: path)
    return path


def records() -> list[dict]:
    """Records as `verispec distill` writes them: two chat replies, one code completion, and a
    ShareGPT question and that code prompt in JSON mode."""
    code = DistillPrompt("stdlib:os:join", "text", text="def join(a, *p):\n    ")
    prompts = [
        DistillPrompt("sharegpt:2", "chat", messages=(("user", QUESTIONS[2]),)),
        code,
        DistillPrompt("sharegpt:0", "chat", messages=(("user", QUESTIONS[0]),)),
        json_answer_prompt(DistillPrompt("sharegpt:2", "chat", messages=(("user", QUESTIONS[2]),))),
        json_function_prompt(code),
    ]
    out = []
    for i, p in enumerate(prompts):
        out.append({
            "id": p.id, "kind": p.kind, "messages": [list(m) for m in p.messages], "text": p.text,
            "schema": p.schema,
            "prompt_ids": encode(p), "completion_ids": [i + 1, i + 2, 3], "completion": "x",
            "finish_reason": "length" if i else "stop", "target": "tiny", "target_config_sha256": "a" * 64,
        })  # fmt: skip
    return out


def written(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_pack_round_trips_to_the_same_records_without_sharegpt_text(tmp_path, share):
    pack = tmp_path / "p.jsonl.gz"
    assert write_pack(records(), pack) == 5
    raw = gzip.decompress(pack.read_bytes()).decode()
    assert QUESTIONS[0] not in raw and QUESTIONS[2] not in raw  # chat prompts are ids only
    assert "def join(a, *p)" in raw  # standard-library prompts (PSF license) are kept
    assert "JSON object" not in raw  # a JSON-mode prompt's instruction is made again from its id
    header, packed = read_pack(pack)
    assert header["target"] == "tiny"
    ids = [
        "sharegpt:2",
        "stdlib:os:join",
        "sharegpt:0",
        "json-answer:sharegpt:2",
        "json-function:stdlib:os:join",
    ]
    assert [r["id"] for r in packed] == ids
    out = tmp_path / "d.jsonl"
    assert unpack(pack, out, ME, encode) == 5
    keys = ("id", "kind", "messages", "text", "schema", "prompt_ids", "completion_ids", "finish_reason",
            "target", "target_config_sha256")  # fmt: skip

    def fields(rows):
        return [{k: r[k] for k in keys} for r in rows]

    assert fields(read_records(out)) == fields(records())


def test_a_long_prompt_is_kept_as_its_id_and_made_again_as_a_chat_prompt_is(tmp_path, share):
    """``--long`` prompts (first turns too long for ``--chat``) keep ids of the same kind."""
    assert LONG_CHARS[0] <= len(ARTICLE) <= LONG_CHARS[1]
    long = DistillPrompt("sharegpt:3", "chat", messages=(("user", ARTICLE),))
    row = {
        **records()[0],
        "id": long.id,
        "messages": [list(m) for m in long.messages],
        "prompt_ids": encode(long),
    }
    pack = tmp_path / "p.gz"
    assert write_pack([row], pack) == 1
    assert "quick brown fox" not in gzip.decompress(pack.read_bytes()).decode()
    out = tmp_path / "d.jsonl"
    assert unpack(pack, out, ME, encode) == 1
    (made,) = read_records(out)
    assert made["messages"] == row["messages"] and made["prompt_ids"] == row["prompt_ids"]


def test_pack_bytes_depend_only_on_the_records(tmp_path):
    write_pack(records(), tmp_path / "a.gz")
    write_pack(records(), tmp_path / "b.gz")
    assert (tmp_path / "a.gz").read_bytes() == (tmp_path / "b.gz").read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_unpack_adds_only_what_the_file_lacks(tmp_path, share):
    pack = tmp_path / "p.gz"
    write_pack(records(), pack)
    out = written(tmp_path / "d.jsonl", records()[1:2])
    assert unpack(pack, out, ME, encode) == 4
    assert unpack(pack, out, ME, encode) == 0
    ids = [
        "stdlib:os:join",
        "sharegpt:2",
        "sharegpt:0",
        "json-answer:sharegpt:2",
        "json-function:stdlib:os:join",
    ]
    assert [r["id"] for r in read_records(out)] == ids


def test_prompts_that_tokenize_otherwise_are_refused_and_nothing_is_written(tmp_path, share):
    pack = tmp_path / "p.gz"
    write_pack(records(), pack)
    out = tmp_path / "d.jsonl"

    def other_template(prompt: DistillPrompt) -> list[int]:
        return encode(prompt) + ([7] if prompt.id == "sharegpt:0" else [])

    with pytest.raises(VerispecError, match="sharegpt:0 tokenizes to other ids"):
        unpack(pack, out, ME, other_template)
    assert read_records(out) == []


def test_a_prompt_the_installed_package_lacks_is_refused(tmp_path, share):
    pack = tmp_path / "p.gz"
    rows = records()
    rows[0]["id"] = "sharegpt:1"  # in the file, but its first turn is too short to be a prompt
    rows[2]["id"] = "sharegpt:9"  # past the file's end
    write_pack(rows[:1], pack)
    with pytest.raises(VerispecError, match="sharegpt:1 is not a prompt of the installed ShareGPT"):
        unpack(pack, tmp_path / "d.jsonl", ME, encode)
    write_pack(rows[2:], pack)
    with pytest.raises(VerispecError, match="sharegpt:9 is not a prompt"):
        unpack(pack, tmp_path / "d.jsonl", ME, encode)


def test_a_code_prompt_without_its_code_is_refused_as_such(tmp_path, share):
    pack = tmp_path / "p.gz"
    write_pack(records()[4:], pack)  # the JSON-mode function prompt; write_pack keeps its code
    lines = gzip.decompress(pack.read_bytes()).decode().splitlines()
    edited = json.loads(lines[1])
    edited.pop("text")  # a hand-edited pack
    pack.write_bytes(gzip.compress((lines[0] + "\n" + json.dumps(edited) + "\n").encode()))
    with pytest.raises(VerispecError, match="json-function:stdlib:os:join has no code to rebuild it from"):
        unpack(pack, tmp_path / "d.jsonl", ME, encode)
    assert read_records(tmp_path / "d.jsonl") == []


def test_another_targets_pack_is_refused(tmp_path, share):
    pack = tmp_path / "p.gz"
    write_pack(records(), pack)
    other = TargetIdentity("big", 100, 8, "b" * 64, ())
    with pytest.raises(VerispecError, match="replies of tiny, not of big"):
        unpack(pack, tmp_path / "d.jsonl", other, encode)


def test_what_cannot_be_packed_or_read_says_why(tmp_path):
    rows = records()
    with pytest.raises(VerispecError, match="no records"):
        write_pack([], tmp_path / "p.gz")
    with pytest.raises(VerispecError, match="one target"):
        write_pack([rows[0], {**rows[1], "target_config_sha256": "b" * 64}], tmp_path / "p.gz")
    for id in ("mine:0", "json-answer:mine:0", "sharegpt:x"):
        with pytest.raises(VerispecError, match="not a prompt that can be rebuilt"):
            write_pack([{**rows[0], "id": id}], tmp_path / "p.gz")
    with pytest.raises(VerispecError, match="not a prompt that can be rebuilt"):
        write_pack([{**rows[4], "text": ""}], tmp_path / "p.gz")  # the code it describes is needed
    with pytest.raises(VerispecError, match="is not a distill pack"):
        read_pack(written(tmp_path / "d.jsonl", rows))  # a records file, not gzipped
    (tmp_path / "h.gz").write_bytes(gzip.compress(b'{"format": "other"}\n'))
    with pytest.raises(VerispecError, match="no verispec-distill-pack header"):
        read_pack(tmp_path / "h.gz")
    (tmp_path / "v.gz").write_bytes(gzip.compress(b'{"format": "verispec-distill-pack", "version": 9}\n'))
    with pytest.raises(VerispecError, match="version 9 pack"):
        read_pack(tmp_path / "v.gz")
    assert prompt_hash([1, 2]) != prompt_hash([12]) and len(prompt_hash([1])) == 16


def test_the_command_packs_without_loading_a_model_and_checks_a_pack_first(tmp_path, capsys):
    out = written(tmp_path / "d.jsonl", records())
    pack = tmp_path / "p.gz"
    args = ["distill", "--target", "no-such-model", "--out", str(out), "--chat", "0", "--code", "0"]
    assert main([*args, "--pack", str(pack)]) == 0
    assert "5 replies packed" in capsys.readouterr().out and len(read_pack(pack)[1]) == 5
    assert main([*args, "--unpack", str(out)]) == 2  # not a pack: said before the (missing) model
    assert "is not a distill pack" in capsys.readouterr().err
    assert main(args) == 2
    assert "not all 0" in capsys.readouterr().err
