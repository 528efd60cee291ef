"""Training data: the cut-off ShareGPT file, chat-template label masks, code windows and the
resumable hidden-state cache."""

from __future__ import annotations

import json
import random
from typing import ClassVar

import numpy as np
import pytest
import torch

from tests.conftest import needs_smollm2, tiny_llama
from verispec.errors import VerispecError
from verispec.heads.identity import identify
from verispec.models.hf import HFCausalLM
from verispec.training.cache import prepare_store
from verispec.training.data import (
    Cursor,
    DataSpec,
    Example,
    build_examples,
    chat_example,
    code_example,
    iter_sharegpt,
)
from verispec.training.states import target_states
from verispec.training.store import HiddenStore


def record(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_is_read_record_by_record_up_to_the_cut(tmp_path):
    good = record(("human", "hi"), ("gpt", "hello"))
    odd = record(("gpt", "I start"), ("human", "no"))  # starts with the assistant: skipped
    double = record(("human", "a"), ("human", "b"), ("gpt", "c"))  # not alternating: skipped
    unknown = record(("human", "a"), ("bard", "b"))  # unknown role: skipped
    text = json.dumps([good, odd, double, unknown, good], indent=2)
    cut = text[: text.rindex('"hello"') + 3]  # the last record is cut off mid-way
    path = tmp_path / "share.json"
    path.write_text(cut)
    got = list(iter_sharegpt(path))
    assert got == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
    path.write_text(text)
    assert len(list(iter_sharegpt(path))) == 2


class FakeTokenizer:
    """Characters as token ids; a template ``<s> (role content </t>)* [assistant header]``."""

    HEAD: ClassVar[dict[str, int]] = {"system": 1, "user": 2, "assistant": 3}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        ids = [0]
        for m in messages:
            ids += [self.HEAD[m["role"]], *(ord(c) for c in m["content"]), 9]
        return ids + ([3] if add_generation_prompt else [])

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_chat_examples_label_exactly_the_assistant_replies():
    messages = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "xyz"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "w"},
    ]
    ex = chat_example(FakeTokenizer(), messages, max_len=100)
    text = [chr(i) if i > 31 else str(i) for i in ex.ids]
    labelled = "".join(t for t, keep in zip(text, ex.labelled, strict=True) if keep)
    assert labelled == "xyz9w9"  # the replies and their end tokens, not the role headers
    assert len(ex.ids) == len(ex.labelled) == 16
    cut = chat_example(FakeTokenizer(), messages, max_len=7)
    assert len(cut.ids) == 7 and sum(cut.labelled) == 1  # <s> user a b </t> assistant x
    assert chat_example(FakeTokenizer(), messages[:1], max_len=100) is None  # nothing to label


def test_code_examples_are_windows_at_line_starts():
    text = "".join(f"line {i}\n" for i in range(200))
    ex = code_example(FakeTokenizer(), text, 50, random.Random(0))
    assert len(ex.ids) == 50 and all(ex.labelled) and ex.source == "stdlib"
    assert "".join(map(chr, ex.ids)).startswith("line ")


@needs_smollm2
def test_chat_example_with_a_real_template():
    from transformers import AutoTokenizer

    from verispec.models.cache import hf_folder_for

    tok = AutoTokenizer.from_pretrained(hf_folder_for("smollm2-135m-instruct"))
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]
    ex = chat_example(tok, messages, max_len=512)
    reply = tok.decode([t for t, keep in zip(ex.ids, ex.labelled, strict=True) if keep])
    assert reply.startswith("Hi there!") and "<|im_start|>assistant" not in reply


def test_data_spec_is_validated():
    with pytest.raises(VerispecError, match="unknown data source"):
        DataSpec(sources=("wikipedia",))
    with pytest.raises(VerispecError, match="max-tokens"):
        DataSpec(max_tokens=10)
    assert DataSpec().key() == DataSpec().key() != DataSpec(seed=1).key()


def examples_of(lengths: list[int]) -> list[Example]:
    """Sequences of the given lengths over the tiny vocabulary, the first token unlabelled."""
    return [
        Example([(7 * i + t) % 90 + 1 for t in range(n)], [t > 0 for t in range(n)], "stdlib")
        for i, n in enumerate(lengths)
    ]


def test_hidden_store_fills_resumes_and_matches_the_target(tmp_path, tiny_target):
    examples = examples_of([5, 3] * 3 + [100] * 10)
    store = HiddenStore(tmp_path)
    store.extend(examples, Cursor(stdlib=16), identify(tiny_target), DataSpec(heldout_every=3), 64)
    assert not store.complete and store.tokens == 1024
    store.fill(tiny_target, progress=False)
    hidden, argmax = store.array("hidden"), store.array("argmax")
    h, top = target_states(tiny_target, examples[1].ids)
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(hidden[5:8], dtype=np.float32)), h, atol=1e-2, rtol=1e-2
    )
    assert argmax[5:8].tolist() == top.tolist()
    assert store.array("heldout")[:6].tolist() == [False, False, True, False, False, True]
    # An interrupted run: progress says two sequences are done; the rest is recomputed on reopening.
    store._save_filled(np.arange(16) < 2)
    assert store.meta["done"] == 2 and not store.complete
    writable = store.array("hidden", "r+")
    writable[8:] = 0
    writable.flush()
    spec = DataSpec(max_tokens=1000, heldout_every=3)
    reopened = prepare_store(tiny_target, identify(tiny_target), spec, tmp_path, progress=False)
    assert reopened.complete
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(reopened.array("hidden")[13:16], dtype=np.float32)),
        target_states(tiny_target, examples[3].ids)[0],
        atol=1e-2,
        rtol=1e-2,
    )


def test_a_store_grows_without_recomputing_what_it_holds(tmp_path, tiny_target):
    spec = DataSpec(heldout_every=3)
    store = HiddenStore(tmp_path / "store")
    store.extend(
        examples_of([6, 4, 5]), Cursor(stdlib=3, tokens={"stdlib": 15}), identify(tiny_target), spec, 64
    )
    store.fill(tiny_target, progress=False)
    marked = store.array("hidden", "r+")
    marked[:] = 7.0  # were the cached sequences recomputed, this mark would be gone
    marked.flush()
    del marked
    more = examples_of([9, 8, 3, 4])
    store.extend(more, Cursor(stdlib=7, tokens={"stdlib": 39}), identify(tiny_target), spec, 64)
    assert not store.complete and store.meta["done"] == 3 and store.tokens == 39
    assert HiddenStore.open(store.folder).meta == store.meta  # swapped in on disk, no .next left over
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    # Interrupted between the swap's two renames: reopening restores the old store.
    store.folder.rename(tmp_path / "store.old")
    assert HiddenStore.open(tmp_path / "store").meta == store.meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    store.fill(tiny_target, progress=False)
    hidden = np.asarray(store.array("hidden"), dtype=np.float32)
    assert (hidden[:15] == 7.0).all() and not (hidden[15:] == 7.0).any()
    h, _ = target_states(tiny_target, more[1].ids)
    torch.testing.assert_close(torch.from_numpy(hidden[24:32]), h, atol=1e-2, rtol=1e-2)
    assert store.array("heldout").tolist() == [False, False, True, False, False, True, False]
    assert store.cursor == Cursor(stdlib=7, tokens={"stdlib": 39})
    # --max-tokens N uses the first sequences covering N tokens, whatever else the store holds.
    assert store.sequences_for(15) == 3 and store.sequences_for(16) == 4 and store.sequences_for(10**6) == 7
    part = store.arrays(16)
    assert part["starts"].tolist() == [0, 6, 10, 15, 24] and len(part["hidden"]) == 24
    assert store.summary(16) == {
        "sequences": 4, "tokens": 24, "tokens_by_source": {"sharegpt": 0, "stdlib": 24, "distilled": 0},
        "labelled_tokens": 20,
    }  # fmt: skip
    (tmp_path / "store.old").mkdir()  # left over after the swap: the next extension clears it
    store.extend(examples_of([5]), Cursor(stdlib=8, tokens={"stdlib": 44}), identify(tiny_target), spec, 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"] and store.tokens == 44


class ModTokenizer(FakeTokenizer):
    """FakeTokenizer with ids folded into the tiny model's vocabulary."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 90 + 1 for c in text]


def test_the_stream_is_the_same_however_the_store_was_grown(tmp_path, monkeypatch):
    """Both sources, interleaved by their share of tokens: grown in three steps or built at once, a
    store holds the same sequences, so cached runs and fresh ones train on the same data."""
    conversations = [
        record(("human", f"question {i} " * (i % 5 + 1)), ("gpt", f"answer {i} " * 9)) for i in range(80)
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(conversations))
    monkeypatch.setattr("verispec.training.data.sharegpt_file", lambda: path)
    spec = DataSpec(max_tokens=6000, max_seq_len=200, code_fraction=0.3)
    at_once, cursor = build_examples(ModTokenizer(), spec, 6000, progress=False)
    steps: list[Example] = []
    grown = Cursor()
    for need in (1000, 2000, 3000):
        got, grown = build_examples(ModTokenizer(), spec, need, grown, progress=False)
        assert sum(len(e.ids) for e in got) >= need
        steps += got
    assert [e.ids for e in steps[: len(at_once)]] == [e.ids for e in at_once]
    code = sum(len(e.ids) for e in at_once if e.source == "stdlib")
    assert 0.25 < code / sum(len(e.ids) for e in at_once) < 0.35
    assert cursor.sharegpt > 0 and cursor.stdlib > 0 and sum(cursor.tokens.values()) >= 6000
    # A source that runs out leaves the rest to the other one.
    few, end = build_examples(ModTokenizer(), spec, 10**6, Cursor(sharegpt=78), progress=False)
    assert end.sharegpt == 80 and sum(e.source == "sharegpt" for e in few) == 2


def test_prepare_store_extends_the_cache_it_finds(tmp_path, tiny_target, monkeypatch):
    monkeypatch.setattr(tiny_target, "tokenizer", ModTokenizer(), raising=False)
    spec = DataSpec(max_tokens=1000, sources=("stdlib",), max_seq_len=128)
    small = prepare_store(tiny_target, identify(tiny_target), spec, tmp_path / "a", progress=False)
    assert small.complete and 1000 <= small.tokens < 1128
    bigger = DataSpec(max_tokens=2000, sources=("stdlib",), max_seq_len=128)
    grown = prepare_store(tiny_target, identify(tiny_target), bigger, tmp_path / "a", progress=False)
    fresh = prepare_store(tiny_target, identify(tiny_target), bigger, tmp_path / "b", progress=False)
    assert grown.complete and grown.tokens == fresh.tokens >= 2000
    for name in ("tokens", "starts", "heldout", "labelled", "argmax"):
        assert np.array_equal(grown.array(name), fresh.array(name)), name
    assert spec.key() == bigger.key()  # one cache folder, whatever --max-tokens asks for


def test_skip_tokens_starts_the_store_where_the_first_tokens_end(tmp_path, tiny_target, monkeypatch):
    """--skip-tokens: heads warm-started on the stream's first N tokens go on with text they have not
    seen; the store then holds exactly the stream's sequences after those, in their own cache."""
    monkeypatch.setattr(tiny_target, "tokenizer", ModTokenizer(), raising=False)
    spec = DataSpec(max_tokens=1000, sources=("stdlib",), max_seq_len=128, skip_tokens=1500)
    store = prepare_store(tiny_target, identify(tiny_target), spec, tmp_path / "s", progress=False)
    whole = DataSpec(max_tokens=2500, sources=("stdlib",), max_seq_len=128)
    first, after = build_examples(ModTokenizer(), whole, 1500, progress=False)
    later, end = build_examples(ModTokenizer(), whole, 1000, after, progress=False)
    assert store.complete and sum(len(e.ids) for e in first) >= 1500
    held = np.asarray(store.array("tokens")).tolist()
    assert held == [t for e in later for t in e.ids]  # exactly the sequences after the skipped ones
    assert store.cursor == end
    assert spec.key() != whole.key() == DataSpec(**{**whole.to_dict(), "skip_tokens": 0}).key()
    with pytest.raises(VerispecError, match="skip-tokens"):
        DataSpec(skip_tokens=-1)


def test_a_cache_of_another_model_is_refused(tmp_path, tiny_target):
    store = HiddenStore(tmp_path)
    store.extend(examples_of([3]), Cursor(), identify(tiny_target), DataSpec(), 64)
    other = HFCausalLM(tiny_llama(0, vocab=50), name="other")
    with pytest.raises(VerispecError, match="another model"):
        prepare_store(other, identify(other), DataSpec(), tmp_path, progress=False)


def test_a_cache_of_the_same_model_quantized_otherwise_is_refused(tmp_path, tiny_target, monkeypatch):
    """int8 and int4 targets give different hidden states: heads for one learn from its own, so a
    cache records the quantization it was made with, and its default folder is named by it."""
    monkeypatch.setattr(tiny_target, "tokenizer", ModTokenizer(), raising=False)
    monkeypatch.setattr(tiny_target, "quantization", "int8", raising=False)
    monkeypatch.setattr("verispec.models.registry.cache_root", lambda: tmp_path)
    spec = DataSpec(max_tokens=1000, sources=("stdlib",), max_seq_len=128)
    int8 = prepare_store(tiny_target, identify(tiny_target), spec, progress=False)
    assert int8.complete and int8.meta["quantization"] == "int8" and "-int8-" in int8.folder.name
    assert HiddenStore.open(int8.folder).meta["quantization"] == "int8"  # on disk from the start
    monkeypatch.setattr(tiny_target, "quantization", "int4")
    with pytest.raises(VerispecError, match="int8 target, not of the int4 one"):
        prepare_store(tiny_target, identify(tiny_target), spec, int8.folder, progress=False)
    int4 = prepare_store(tiny_target, identify(tiny_target), spec, progress=False)
    assert int4.folder != int8.folder and int4.meta["quantization"] == "int4"


def test_a_store_made_beside_another_lm_head_gets_its_argmaxes_again(tmp_path, monkeypatch):
    """The int4 path's LM head is int4 or int8 by the CPU (or VERISPEC_INT4_LM_HEAD): the hidden
    states are the same, the greedy tokens are not, so a store made beside the other head gets its
    argmaxes recomputed from its states instead of mixing two targets' tokens."""
    from verispec.models import int4
    from verispec.models.quant import quantize_model
    from verispec.training.cache import open_store
    from verispec.training.states import lm_head_argmax

    if not int4.cpu_supports_int4():
        pytest.skip("the int4 kernel needs AVX2 or AVX-512 VNNI")

    def target(head: str) -> HFCausalLM:
        monkeypatch.setenv(int4.HEAD_ENV, "1" if head == "int4" else "0")
        lm = HFCausalLM(quantize_model(tiny_llama(0), "int4"), name="tiny-int4", tokenizer=ModTokenizer())
        lm.quantization = "int4"
        return lm

    spec = DataSpec(max_tokens=1000, sources=("stdlib",), max_seq_len=128)
    t8, t4 = target("int8"), target("int4")
    store = prepare_store(t8, identify(t8), spec, tmp_path, progress=False)
    assert store.complete and store.meta["lm_head"] == "int8"
    rows = torch.from_numpy(np.asarray(store.array("hidden"), dtype=np.float32))
    stale = store.array("argmax", "r+")
    stale[:] = -1
    stale.flush()
    assert (open_store(t8, identify(t8), spec, tmp_path).array("argmax") == -1).all()  # same head: kept
    reopened = open_store(t4, identify(t4), spec, tmp_path)
    assert reopened.array("argmax").tolist() == lm_head_argmax(t4, rows).tolist()
    assert HiddenStore.open(tmp_path).lm_head == "int4"
    # A store made before the head was recorded was made beside the int8 head.
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["lm_head"]
    assert HiddenStore(tmp_path, meta).lm_head == "int8"


def test_a_store_with_feature_layers_keeps_their_taps_and_grows_with_them(tmp_path, tiny_target, monkeypatch):
    """--feature-layers: the store keeps each token's normed inputs of those layers beside its last
    state (what the target computes, unchanged), in a cache of its own; another layer list on the
    same folder is refused, and so are layers the target does not have."""
    monkeypatch.setattr(tiny_target, "tokenizer", ModTokenizer(), raising=False)
    plain = DataSpec(max_tokens=1000, sources=("stdlib",), max_seq_len=128)
    spec = DataSpec(**{**plain.to_dict(), "feature_layers": [1]})
    assert spec.feature_layers == (1,) and spec.key() != plain.key()
    assert DataSpec(**{**plain.to_dict(), "feature_layers": ()}).key() == plain.key()
    store = prepare_store(tiny_target, identify(tiny_target), spec, tmp_path / "t", progress=False)
    assert store.complete and store.feature_layers == (1,)
    arrays = store.arrays()
    assert arrays["taps"].shape == (store.tokens, 64) and arrays["hidden"].shape == (store.tokens, 64)
    a, b = int(arrays["starts"][2]), int(arrays["starts"][3])
    rows, top = target_states(tiny_target, np.asarray(arrays["tokens"][a:b]).tolist(), (1,))
    got = np.concatenate([arrays["hidden"][a:b], arrays["taps"][a:b]], axis=1)
    torch.testing.assert_close(torch.from_numpy(got.astype(np.float32)), rows, atol=1e-2, rtol=1e-2)
    assert arrays["argmax"][a:b].tolist() == top.tolist()
    bigger = DataSpec(**{**spec.to_dict(), "max_tokens": 1500})
    grown = prepare_store(tiny_target, identify(tiny_target), bigger, tmp_path / "t", progress=False)
    assert grown.tokens >= 1500 and grown.array("taps").shape == (grown.tokens, 64)
    assert np.array_equal(grown.array("taps")[:a], arrays["taps"][:a])  # kept, not recomputed
    with pytest.raises(VerispecError, match="not of \\[0\\]"):
        prepare_store(
            tiny_target, identify(tiny_target), DataSpec(**{**spec.to_dict(), "feature_layers": [0]}),
            tmp_path / "t", progress=False,
        )  # fmt: skip
    with pytest.raises(VerispecError, match="feature layers \\[5\\] do not exist"):
        prepare_store(
            tiny_target, identify(tiny_target), DataSpec(**{**spec.to_dict(), "feature_layers": [5]}),
            tmp_path / "u", progress=False,
        )  # fmt: skip
    with pytest.raises(VerispecError, match="distinct"):
        DataSpec(feature_layers=(1, 1))
