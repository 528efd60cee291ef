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
from verispec.heads.data import (
    DataSpec,
    Example,
    HiddenStore,
    chat_example,
    code_example,
    iter_sharegpt,
    prepare_store,
    target_states,
)
from verispec.heads.identity import identify
from verispec.models.hf import HFCausalLM


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


def test_hidden_store_fills_resumes_and_matches_the_target(tmp_path, tiny_target):
    examples = [Example([1, 2, 3, 4, 5], [False, True, True, True, True]), Example([7, 8, 9], [True] * 3)] * 3
    store = HiddenStore(tmp_path)
    store.create(examples, identify(tiny_target), DataSpec(heldout_every=3), tiny_target.hidden_size)
    assert not store.complete and store.meta["tokens"] == 24
    store.fill(tiny_target, progress=False)
    hidden, argmax = store.array("hidden"), store.array("argmax")
    h, top = target_states(tiny_target, [7, 8, 9])
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(hidden[5:8], dtype=np.float32)), h, atol=1e-2, rtol=1e-2
    )
    assert argmax[5:8].tolist() == top.tolist()
    assert store.array("heldout").tolist() == [False, False, True, False, False, True]
    # An interrupted run: progress says two sequences are done; the rest is recomputed on reopening.
    store.meta.update(done=2, complete=False)
    store._write_meta()
    writable = store.array("hidden", "r+")
    writable[8:] = 0
    writable.flush()
    reopened = prepare_store(tiny_target, identify(tiny_target), DataSpec(), tmp_path, progress=False)
    assert reopened.complete
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(reopened.array("hidden")[13:16], dtype=np.float32)),
        h,
        atol=1e-2,
        rtol=1e-2,
    )


def test_a_cache_of_another_model_is_refused(tmp_path, tiny_target):
    store = HiddenStore(tmp_path)
    store.create([Example([1, 2, 3], [True] * 3)], identify(tiny_target), DataSpec(), 64)
    other = HFCausalLM(tiny_llama(0, vocab=50), name="other")
    with pytest.raises(VerispecError, match="another model"):
        prepare_store(other, identify(other), DataSpec(), tmp_path, progress=False)
