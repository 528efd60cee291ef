"""Hidden states kept while distilling: the engine's observer sees the states a store pass computes,
and a store filled that way trains without a pass of the target (verispec/training/keep.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import needs_smollm2
from tests.training.test_data import ModTokenizer
from tests.training.test_distill import write_records
from verispec.cli import main
from verispec.config import NgramConfig, SchedulerConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.heads.identity import identify
from verispec.proposers import build_proposer
from verispec.training import store as store_module
from verispec.training.cache import open_store, prepare_store
from verispec.training.data import DataSpec, build_examples
from verispec.training.eagle import eagle_batch
from verispec.training.keep import HiddenRecorder, StoreKeeper, _aligned
from verispec.training.medusa import _medusa_positions_in, _medusa_targets
from verispec.training.records import read_records
from verispec.training.states import target_states
from verispec.training.store import HiddenStore
from verispec.training.tokens import TokenData

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(target, method: str | None) -> SpecEngine:
    spec = SpecConfig(method=method, num_speculative_tokens=4, depth="fixed", ngram=NgramConfig(3, 1))  # type: ignore[arg-type]
    proposer = build_proposer(spec, target, None) if method else None
    return SpecEngine(target, proposer, spec, scheduler=SchedulerConfig(max_batch_size=4, prefill_chunk=8))


@pytest.mark.parametrize("method", [None, "ngram"])
def test_the_observer_sees_the_states_of_every_fed_token(tiny_target, method):
    """Batched, chunked prefill (8-token chunks of 13-token prompts) and decode steps that commit
    several drafted tokens: the recorded rows are the states after each token of prompt and reply
    but the last (never fed), as one forward over the whole sequence gives them, and the argmax is
    the target's greedy next token there."""
    engine = _engine(tiny_target, method)
    recorder = HiddenRecorder(tiny_target)
    engine.hidden_observer = recorder
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, tiny_target.vocab_size, (13,), generator=gen).tolist() for _ in range(6)]
    ids = [f"r{i}" for i in range(len(prompts))]
    outs = engine.generate_batch(prompts, each=[{"request_id": i} for i in ids], max_new_tokens=23)
    if method:  # the rows of a multi-token step are kept too: drafts were accepted
        assert sum(o.stats.num_accepted for o in outs) > 10
    for rid, prompt, out in zip(ids, prompts, outs, strict=True):
        kept = recorder.take(rid)
        assert kept is not None
        hidden, greedy = kept
        sequence = prompt + out.token_ids
        assert len(hidden) == len(greedy) in (len(sequence) - 1, len(sequence))
        whole, top = target_states(tiny_target, sequence)
        np.testing.assert_allclose(
            hidden.astype(np.float32), whole[: len(hidden)].numpy(), atol=2e-3, rtol=2e-3
        )
        assert greedy.tolist() == top[: len(greedy)].tolist()
        assert (
            greedy[len(prompt) - 1 :].tolist()[: len(out.token_ids)]
            == out.token_ids[: len(greedy) - len(prompt) + 1]
        )
    assert recorder.take("r0") is None  # taken once


def test_recorded_states_are_cut_to_the_stored_sequence():
    hidden, greedy = np.ones((9, 4), np.float16), np.arange(9, dtype=np.int32)
    h, g = _aligned((hidden, greedy), 10, 4)  # the last token's state was never computed: zeros
    assert h.shape == (10, 4) and not h[-1].any() and g.tolist() == [*range(9), 0]
    h, g = _aligned((hidden, greedy), 5, 4)  # a record cut to max_seq_len
    assert h.shape == (5, 4) and g.tolist() == [0, 1, 2, 3, 4]
    assert _aligned((hidden, greedy), 11, 4) is None and _aligned(None, 3, 4) is None


def test_no_training_pair_reads_a_sequences_last_state(tiny_target):
    """Why zeros may stand in for the last token's state: the training view marks nothing valid there."""
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    arrays = {
        "tokens": np.array([t for s in seqs for t in s], dtype=np.int32),
        "labelled": np.ones(10, dtype=bool),
        "hidden": np.zeros((10, tiny_target.hidden_size), np.float16),
        "argmax": np.zeros(10, dtype=np.int32),
        "starts": np.array([0, 6, 10]),
        "heldout": np.zeros(2, dtype=bool),
    }
    data = TokenData(arrays)
    assert not data.ok[[5, 9]].any()  # ok[t]: token t+1 exists and is labelled
    embeddings = torch.zeros(tiny_target.vocab_size, tiny_target.hidden_size)
    batch = eagle_batch(data, embeddings, [(0, 6), (6, 10)])
    # EAGLE's pairs (h_j, x_{j+1}) read h_{j+1} only as the target of a valid pair: the last pair, whose
    # target would be the last state, is not one; Medusa's labels stop at ok too.
    assert batch.valid[0].tolist() == [True] * 4 + [False] and batch.valid[1].tolist()[:3] == [
        True,
        True,
        False,
    ]
    positions = _medusa_positions_in(data, [(0, 6), (6, 10)])
    _, valid = _medusa_targets(data, positions, 3)
    assert not ((positions[:, None] + 1 + torch.arange(3))[valid] == 5).any()
    assert not ((positions[:, None] + 1 + torch.arange(3))[valid] == 9).any()


def test_a_store_fills_only_the_sequences_not_kept(tmp_path, tiny_target):
    """Sequences whose states were put (kept while distilling) are skipped by the store pass; the
    others are computed; the store is complete once all are filled."""
    path = tmp_path / "d.jsonl"
    write_records(path, 6)
    spec = DataSpec(max_tokens=1000, sources=("distilled",), distilled=str(path))
    store = open_store(tiny_target, identify(tiny_target), spec, tmp_path / "s")
    examples, cursor = build_examples(None, spec, 1 << 62, store.cursor, progress=False)
    store.extend(examples, cursor, identify(tiny_target), spec, tiny_target.hidden_size)
    marker = np.full((40, tiny_target.hidden_size), 0.5, np.float16), np.full(40, 7, np.int32)
    store.put({1: marker, 3: marker})
    assert store.filled().tolist() == [False, True, False, True, False, False]
    assert not store.complete and store.meta["done"] == 0
    store.fill(tiny_target, progress=False)
    assert store.complete and store.filled().all() and store.meta["done"] == 6
    again = HiddenStore.open(tmp_path / "s")
    hidden, argmax = np.asarray(again.array("hidden")), np.asarray(again.array("argmax"))
    assert (hidden[40:80] == 0.5).all() and (argmax[120:160] == 7).all()  # kept, not recomputed
    whole, top = target_states(tiny_target, np.asarray(again.array("tokens"))[80:120].tolist())
    np.testing.assert_allclose(hidden[80:120].astype(np.float32), whole.numpy(), atol=2e-3, rtol=2e-3)
    assert argmax[80:120].tolist() == top.tolist()
    with pytest.raises(ValueError, match="sequence 2 has 40 tokens"):
        again.put({2: (marker[0][:5], marker[1][:5])})


def test_a_store_made_before_the_mask_and_the_prompt_lengths_reads_them_from_what_it_has(
    tmp_path, tiny_target, monkeypatch
):
    """Its first ``done`` sequences are filled; its distilled replies' prompt lengths are read again
    from the file when the store is opened for training (so the rest are fed as they were written)."""
    monkeypatch.setattr(tiny_target, "tokenizer", ModTokenizer(), raising=False)
    path = tmp_path / "d.jsonl"
    write_records(path, 4)
    spec = DataSpec(max_tokens=1000, sources=("distilled",), distilled=str(path))
    store = prepare_store(tiny_target, identify(tiny_target), spec, tmp_path / "s", progress=False)
    assert store.prompt_lengths().tolist() == [10] * 4  # write_records: 10 prompt tokens each
    (tmp_path / "s" / "filled.npy").unlink()
    (tmp_path / "s" / "prompts.npy").unlink()
    assert HiddenStore.open(tmp_path / "s").filled().tolist() == [True] * 4
    store.meta["done"] = 2
    assert store.filled().tolist() == [True, True, False, False]
    assert store.prompt_lengths().tolist() == [0] * 4  # prefilled whole, as such stores were
    assert (
        open_store(tiny_target, identify(tiny_target), spec, tmp_path / "s").prompt_lengths().tolist()
        == [10] * 4
    )
    write_records(path, 1, start=4)  # a file that no longer lines up with the store is not read
    (tmp_path / "s" / "prompts.npy").unlink()
    other = DataSpec(max_tokens=1000, sources=("distilled",), distilled=str(path), max_seq_len=20)
    assert not HiddenStore.open(tmp_path / "s").recover_prompt_lengths(other)


@needs_smollm2
def test_distill_keep_hidden_fills_the_store_train_opens(
    tmp_path, capsys, restore_torch_threads, monkeypatch
):
    """On a real model (int8: 7-bit activation rows, where how a token is fed shows), chat, code and
    JSON-mode replies (a grammar: the kept argmax must be the raw target's), batched and speculated:
    `verispec train` opens the kept store without running the target over the kept replies, and a
    store pass over the same file, feeding each reply as the engine fed it, computes the same
    states to the bit. Records already in the file join the store unfilled."""
    questions = ["Write a haiku about the sea, please.", "What is a Python list comprehension?"]
    share = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "a"}]} for q in questions
    ]
    (tmp_path / "share.json").write_text(json.dumps(share))
    monkeypatch.setattr("verispec.training.prompts.sharegpt_file", lambda: tmp_path / "share.json")
    monkeypatch.setattr("verispec.training.data.sharegpt_file", lambda: tmp_path / "share.json")
    out, kept, passed = tmp_path / "d.jsonl", tmp_path / "kept", tmp_path / "pass"
    common = ["distill", "--target", "smollm2-135m-instruct", "--out", str(out), "--max-new-tokens", "20",
              "--quiet", "--threads", "2", "--method", "ngram"]  # fmt: skip
    assert main([*common, "--chat", "2", "--code", "0", "--json", "0"]) == 0  # no states kept
    keep = ["--chat", "2", "--code", "2", "--json", "2", "--keep-hidden", "--cache-dir", str(kept)]
    assert main([*common, *keep]) == 0
    assert "hidden states of 4 of 6 replies kept" in capsys.readouterr().out
    store = HiddenStore.open(kept)
    assert store.filled().tolist() == [False, False, True, True, True, True] and not store.complete
    records = read_records(out)
    assert store.prompt_lengths().tolist() == [len(r["prompt_ids"]) for r in records]
    assert sorted((r["kind"], r["schema"]) for r in records[2:]) == [
        ("chat", "answer"),
        ("chat", "function"),
        ("text", ""),
        ("text", ""),
    ]  # fmt: skip

    import verispec

    target = verispec.load("smollm2-135m-instruct", method="none", threads=2).target
    identity = identify(target)
    spec = DataSpec(max_tokens=10_000, sources=("distilled",), distilled=str(out.resolve()))
    reference = prepare_store(target, identity, spec, passed, progress=False)  # a store pass over all 6
    filled_by_pass = []
    real_states = store_module.target_states  # what HiddenStore.fill calls

    def counting(target, ids, layers=(), prompt_len=0):
        filled_by_pass.append(len(ids))
        return real_states(target, ids, layers, prompt_len)

    monkeypatch.setattr(store_module, "target_states", counting)
    store = prepare_store(target, identity, spec, kept, progress=False)  # what `verispec train` does
    assert store.complete and len(filled_by_pass) == 2  # only the two records written without the flag
    starts = np.asarray(store.array("starts"))
    assert starts.tolist() == np.asarray(reference.array("starts")).tolist()
    for name in ("tokens", "labelled", "source"):
        assert np.asarray(store.array(name)).tolist() == np.asarray(reference.array(name)).tolist()
    hidden, ref_hidden = np.asarray(store.array("hidden")), np.asarray(reference.array("hidden"))
    argmax, ref_argmax = np.asarray(store.array("argmax")), np.asarray(reference.array("argmax"))
    for s in range(6):
        a, b = int(starts[s]), int(starts[s + 1])
        if s >= 2:  # kept: the last token's state is never computed while generating
            assert not hidden[b - 1].any()
            b -= 1
        assert (hidden[a:b] == ref_hidden[a:b]).all(), s
        assert (argmax[a:b] == ref_argmax[a:b]).all(), s


def test_a_keeper_of_a_file_not_written_yet_waits_for_its_first_records(tmp_path, tiny_target):
    keeper = StoreKeeper(tiny_target, identify(tiny_target), tmp_path / "new.jsonl", tmp_path / "s")
    assert keeper.sync() == (0, 0) and not keeper.store.meta  # `distill --keep-hidden` on a new file
    write_records(tmp_path / "new.jsonl", 3)
    assert keeper.sync() == (3, 0) and keeper.store.filled().tolist() == [False] * 3
