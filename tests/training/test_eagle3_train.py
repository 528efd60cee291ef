"""`verispec train eagle3`: an EAGLE-3 drafter trained on raw target states and written in
speculators' format. On a 4-layer tiny Llama (the 2-layer one has too few layers for three distinct
aux layers), on its own greedy text: the raw taps and their order, the draft vocabulary, the pass
alignment of the loss against a position-by-position reference, learning, the written folder
loaded back (by verispec and, where installed, by speculators) and the command line end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.training.test_data import ModTokenizer
from tests.training.tiny import greedy_texts
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.heads.speculators_io import load_eagle3
from verispec.heads.vocab import VocabHead, float_lm_head_weight
from verispec.models.hf import HFCausalLM
from verispec.training.config import TrainSettings
from verispec.training.eagle3 import (
    TRAINING_FILE,
    aux_layers_for,
    eagle3_batch,
    eagle3_config,
    eagle3_loss,
    evaluate_eagle3,
    new_drafter,
    save_eagle3,
    select_draft_vocab,
    train_eagle3,
    ttt_outputs,
)
from verispec.training.states import target_states
from verispec.training.tokens import TokenData

AUX = (3, 1, 2)
"""Out of order on purpose: the store keeps them sorted, the drafter reads them in its own order."""
VOCAB, DRAFT_VOCAB = 96, 48


def deep_llama() -> LlamaForCausalLM:
    """conftest's tiny Llama with 4 layers (sharp LM head, so its greedy text is learnable)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def target() -> HFCausalLM:
    return HFCausalLM(deep_llama(), name="tiny-deep")


def raw_arrays(target: HFCausalLM, sequences: list[list[int]], layers: tuple[int, ...]) -> dict:
    """What a store with ``raw_taps`` holds, computed in memory (every 5th sequence held out)."""
    hidden, argmax = [], []
    for ids in sequences:
        h, top = target_states(target, ids, layers, raw_features=True)
        hidden.append(h.numpy().astype(np.float16))
        argmax.append(top.numpy())
    starts = np.zeros(len(sequences) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(s) for s in sequences])
    rows, size = np.concatenate(hidden), target.hidden_size
    return {
        "taps": rows[:, size:],
        "tokens": np.array([t for s in sequences for t in s], dtype=np.int32),
        "labelled": np.ones(int(starts[-1]), dtype=bool),
        "hidden": rows[:, :size],
        "argmax": np.concatenate(argmax).astype(np.int32),
        "starts": starts,
        "heldout": np.arange(len(sequences)) % 5 == 4,
    }


@pytest.fixture(scope="module")
def data(target) -> TokenData:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (4,), generator=gen).tolist() for _ in range(100)]
    arrays = raw_arrays(target, greedy_texts(target, prompts, 32), tuple(sorted(AUX)))
    return TokenData(arrays, "soft", tuple(sorted(AUX)), raw_taps=True)


def settings(**overrides) -> TrainSettings:
    values = dict(
        kind="eagle3", aux_layers=AUX, unroll=2, draft_vocab=DRAFT_VOCAB, epochs=10, batch_tokens=256, lr=1e-2
    )
    return TrainSettings(**{**values, **overrides})  # type: ignore[arg-type]


_TRAINED: dict[int, tuple] = {}


def trained(target: HFCausalLM, data: TokenData) -> tuple:
    """(drafter, report) fitted once per session."""
    if id(target) not in _TRAINED:
        _TRAINED[id(target)] = train_eagle3(target, data, settings(), progress=False)
    return _TRAINED[id(target)]


def test_raw_taps_are_the_residual_stream_read_in_the_drafters_order(target, data):
    """aux(j) = [output_hidden_states[i] for i in AUX] at token j (float16-rounded); EAGLE's normed
    reading of the same data, and an EAGLE-3 reading of normed data, are refused."""
    a, b = data.sequences(heldout=False)[0]
    ids = data.tokens[a:b]
    with torch.no_grad():
        states = target.model(ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in AUX], dim=-1)
    torch.testing.assert_close(data.aux(torch.arange(a, b), AUX), want, atol=2e-2, rtol=2e-3)
    with pytest.raises(VerispecError, match="raw residual states"):
        data.features(torch.arange(a, b), tuple(sorted(AUX)))
    arrays = raw_arrays(target, [ids.tolist()], (1, 2, 3))
    normed = TokenData(arrays, feature_layers=(1, 2, 3))  # arrays without raw_taps=True: normed taps
    with pytest.raises(VerispecError, match="needs their raw inputs"):
        normed.aux(torch.arange(3), AUX)
    with pytest.raises(VerispecError, match="needs their raw inputs"):
        data.aux(torch.arange(3), (0, 1, 2))  # layer 0 is not cached


def test_aux_layers_default_and_refusals():
    assert aux_layers_for(30) == (2, 15, 27)  # SmolLM2-135M: speculators' [2, L/2, L-3]
    assert aux_layers_for(4, AUX) == AUX
    with pytest.raises(VerispecError, match="pass --aux-layers"):
        aux_layers_for(4)  # [2, 2, 1]
    with pytest.raises(VerispecError, match=r"distinct decoder layers 0\.\.3"):
        aux_layers_for(4, (1, 4, 2))


def test_draft_vocabulary_is_speculators_selection(target, data):
    """The most frequent training labels, ties to the lower id, sorted; d2t/t2d say the same; the
    LM head rows are the target's rows of those tokens."""
    chosen, coverage = select_draft_vocab(data, DRAFT_VOCAB, VOCAB)
    counts = data.label_counts(VOCAB)
    assert chosen.tolist() == sorted(chosen.tolist()) and chosen.numel() == DRAFT_VOCAB
    key = sorted(range(VOCAB), key=lambda t: (-int(counts[t]), t))
    assert chosen.tolist() == sorted(key[:DRAFT_VOCAB])
    assert coverage == pytest.approx(float(counts[chosen].sum() / counts.sum()))
    assert select_draft_vocab(data, 0, VOCAB) == (None, 1.0)
    assert select_draft_vocab(data, VOCAB, VOCAB) == (None, 1.0)
    drafter = new_drafter(target, eagle3_config(target, AUX, DRAFT_VOCAB), chosen)
    assert torch.equal(drafter.to_target_ids(torch.arange(DRAFT_VOCAB)), chosen)
    assert drafter.t2d.nonzero()[:, 0].tolist() == chosen.tolist()
    assert torch.equal(drafter.lm_head.weight, float_lm_head_weight(target)[chosen])
    assert torch.equal(drafter.embed_tokens.weight, target.model.get_input_embeddings().weight)
    assert torch.equal(drafter.norm.weight, torch.ones(64))  # speculators' init, not the target's gain
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert (
        not cfg.norm_before_residual and cfg.aux_layer_ids == AUX and not cfg.qk_norm
    )  # SGLang's arithmetic
    assert eagle3_config(target, AUX, DRAFT_VOCAB, norm_before_residual=True).norm_before_residual


def test_pass_outputs_are_the_drafters_forward(target, data):
    torch.manual_seed(0)
    drafter = new_drafter(target, eagle3_config(target, AUX, VOCAB), None).eval()  # the whole vocabulary
    batch = eagle3_batch(data, data.sequences(heldout=False)[:3], AUX)
    with torch.no_grad():
        want = drafter(batch.aux, batch.input_ids, steps=3)
        got = [drafter.logits(out) for out in ttt_outputs(drafter, batch.aux, batch.input_ids, 3)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("labels", ["soft", "target"])
def test_the_loss_pairs_each_pass_with_the_token_it_drafts(target, data, labels):
    """eagle3_loss against a reference written position by position from the store: pass s at pair
    j (aux states after token j, token j+1+s fed) is scored on token j+2+s, i.e. the target's state
    and argmax after token j+1+s, and only where that token is labelled and in the draft vocabulary."""
    torch.manual_seed(0)
    vocab_ids, _ = select_draft_vocab(data, 24, VOCAB)
    drafter = new_drafter(target, eagle3_config(target, AUX, 24), vocab_ids)
    head = VocabHead(target, vocab_ids, for_training=True)
    to_draft = head.target_to_draft(VOCAB)
    seqs = data.sequences(heldout=False)[:3]
    batch = eagle3_batch(data, seqs, AUX)
    options = settings(unroll=3, labels=labels)
    got = eagle3_loss(drafter, head, batch, to_draft, options)
    logits = drafter(batch.aux, batch.input_ids, steps=3)
    want = torch.zeros(())
    for s in range(3):
        scores, wants = [], []
        for row, (a, b) in enumerate(seqs):
            for j in range(b - a - 1):
                t = a + j + 1 + s  # the store position whose label is token j+2+s
                if t >= b - 1 or not data.ok[t] or to_draft[data.label[t]] < 0:
                    continue
                assert batch.input_ids[row, j + s] == data.tokens[t]  # the token pass s was fed
                scores.append(logits[s][row, j])
                teacher = head(data.features(torch.tensor([t])))[0].softmax(-1)
                wants.append(teacher if labels == "soft" else to_draft[data.label[t]])
        want = want + 0.8**s * F.cross_entropy(torch.stack(scores), torch.stack(wants))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_training_learns_and_the_folder_loads_back_with_the_same_logits(tmp_path, target, data):
    torch.manual_seed(0)
    untrained = new_drafter(
        target, eagle3_config(target, AUX, DRAFT_VOCAB), select_draft_vocab(data, 48, 96)[0]
    )
    before = evaluate_eagle3(untrained.eval(), data, width=4, depths=3)
    drafter, report = trained(target, data)
    after = report["heldout_accuracy"]
    assert [row["depth"] for row in after] == [1, 2, 3, 4, 5]  # beyond the 2 trained passes too
    assert report["final_loss"] < report["loss_curve"][0][1]
    # Chance: always drafting the commonest greedy token.
    held = torch.cat([data.greedy[a + 1 : b] for a, b in data.sequences(heldout=True)])
    chance = float(torch.bincount(held).max() / held.numel())
    assert after[0]["top1"] > max(before[0]["top1"], chance) + 0.25, (before, after, chance)
    assert after[1]["top1"] > max(before[1]["top1"], chance) + 0.1, (before, after, chance)
    assert 0 < report["draft_vocab_label_coverage"] <= 1 and report["aux_layer_ids"] == list(AUX)
    # Frozen as speculators keeps them: the target's embeddings and LM head rows.
    d2t = drafter.to_target_ids(torch.arange(DRAFT_VOCAB))
    assert torch.equal(drafter.lm_head.weight, float_lm_head_weight(target)[d2t])
    assert torch.equal(drafter.embed_tokens.weight, target.model.get_input_embeddings().weight)

    record = {**report, "settings": dict(report["settings"])}
    save_eagle3(drafter, tmp_path / "out", "tiny-deep", target, record)
    loaded, meta = load_eagle3(tmp_path / "out")
    assert loaded.config == drafter.config and meta.speculative_tokens == 2
    assert meta.verifier == "tiny-deep" and meta.verifier_architectures == ("LlamaForCausalLM",)
    assert meta.config["norm_before_residual"] is False  # written, not left to a reader's default
    assert meta.config["transformer_layer_config"]["model_type"] == "llama"
    batch = eagle3_batch(data, data.sequences(heldout=True)[:4], AUX)
    with torch.no_grad():
        for a, b in zip(
            loaded(batch.aux, batch.input_ids, 3), drafter(batch.aux, batch.input_ids, 3), strict=True
        ):
            assert torch.equal(a, b)
    written = json.loads((tmp_path / "out" / TRAINING_FILE).read_text())
    assert written["heldout_accuracy"] == after and written["verifier"] == "tiny-deep"
    assert evaluate_eagle3(loaded, data, width=4, depths=5) == after


def test_training_goes_on_from_a_saved_folder(tmp_path, target, data):
    """--init-from: a run starts from a saved drafter, its draft vocabulary and layers kept (here with
    a learning rate too small to move it, so its accuracy stays); other layers are refused."""
    drafter, report = trained(target, data)
    save_eagle3(drafter, tmp_path / "out", "tiny-deep", target, report)
    still = settings(init_from=str(tmp_path / "out"), lr=1e-12, epochs=1, draft_vocab=8)
    warm, kept = train_eagle3(target, data, still, progress=False)
    assert torch.equal(warm.d2t, drafter.d2t) and kept["draft_vocab_size"] == DRAFT_VOCAB
    first = [row["top1"] for row in report["heldout_accuracy"]]
    assert [row["top1"] for row in kept["heldout_accuracy"]] == pytest.approx(first, abs=0.01)
    assert len(kept["init_from_sha256"]) == 64
    with pytest.raises(VerispecError, match=r"reads layers \[3, 1, 2\], not \[1, 2, 3\]"):
        train_eagle3(target, data, settings(init_from=str(tmp_path / "out"), aux_layers=(1, 2, 3)))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # speculators' own call
def test_speculators_loads_the_trained_folder(tmp_path, target, data):
    """speculators' own ``SpeculatorModel.from_pretrained`` reads the folder, with the target's own
    folder as its verifier (0.9.0 needs one), and drafts the same logits pass for pass."""
    pytest.importorskip("speculators", reason="speculators is not installed: pip install 'verispec[interop]'")
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    drafter, report = trained(target, data)
    verifier = tmp_path / "verifier"
    target.model.save_pretrained(verifier)
    save_eagle3(drafter, tmp_path / "out", str(verifier), target, report)
    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "out")
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention wants 128-multiples on CPU
    model = SpeculatorModel.from_pretrained(tmp_path / "out", config=config)
    assert isinstance(model, Eagle3DraftModel) and model.config.eagle_aux_hidden_state_layer_ids == list(AUX)
    batch = eagle3_batch(data, data.sequences(heldout=True)[:1], AUX)
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.clone()))
    with torch.no_grad():
        model.eval()(batch.aux, batch.input_ids, torch.zeros_like(batch.input_ids), ttt_steps=3)
        ours = drafter(batch.aux, batch.input_ids, steps=3)
    hook.remove()
    for a, b in zip(ours, captured, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cli_trains_writes_and_measures_an_eagle3_drafter(tmp_path, monkeypatch, capsys):
    """`verispec train eagle3` end to end on a tiny model folder (with a character tokenizer, on the
    standard library's code): a speculators folder plus training.json; its store keeps raw taps, which
    `train eagle` (normed taps) refuses to reuse; `--eval-only` measures the folder."""
    import verispec.models

    folder = tmp_path / "target"
    deep_llama().save_pretrained(folder)
    real_load = verispec.models.load_model

    def with_tokenizer(source, cfg=None):
        model = real_load(source, cfg)
        model.tokenizer = ModTokenizer()
        return model

    monkeypatch.setattr(verispec.models, "load_model", with_tokenizer)
    monkeypatch.setattr("verispec.models.registry.cache_root", lambda: tmp_path / "cache-root")
    cache, out = tmp_path / "store", tmp_path / "drafter"
    base = ["--target", str(folder), "--sources", "stdlib", "--max-tokens", "3000", "--max-seq-len", "64",
            "--quiet", "--cache-dir", str(cache)]  # fmt: skip
    assert main(["train", "eagle3", *base, "--out", str(out)]) == 2
    assert "pass --aux-layers" in capsys.readouterr().err  # 4 layers: the default [2, 2, 1] is no good
    train = ["--aux-layers", "3,1,2", "--epochs", "1", "--unroll", "2", "--draft-vocab", "40",
             "--batch-tokens", "512", "--lr", "1e-2"]  # fmt: skip
    code = main(["train", "eagle3", *base, "--out", str(out), *train])
    assert code == 0, capsys.readouterr().err
    assert "eagle3 heads written to" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", TRAINING_FILE]
    drafter, meta = load_eagle3(out)
    assert drafter.config.aux_layer_ids == AUX and drafter.config.draft_vocab_size == 40
    assert meta.verifier == str(folder.resolve()) and meta.speculative_tokens == 2
    record = json.loads((out / TRAINING_FILE).read_text())
    assert record["data"]["raw_taps"] and record["data"]["feature_layers"] == [1, 2, 3]
    assert len(record["heldout_accuracy"]) == 5 and record["steps"] > 0
    store = json.loads((cache / "meta.json").read_text())
    assert store["data"]["raw_taps"] is True and store["complete"]
    assert main(["train", "eagle", *base, "--out", str(tmp_path / "e"), "--feature-layers", "1,2,3"]) == 2
    assert "raw inputs of layers [1, 2, 3], not their normed inputs" in capsys.readouterr().err
    assert main(["train", "eagle3", *base, "--eval-only", "--init-from", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("eagle3 heads in") and len(table) == 7
    held = float(table[1].split(":")[1].split("/")[0])
    assert held == pytest.approx(record["heldout_accuracy"][0]["top1"], abs=5e-4)  # printed to 3 places


def test_cli_flag_combinations_are_refused(tmp_path, capsys):
    args = ["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]
    assert main(["train", "medusa", *args, "--aux-layers", "1,2,3"]) == 2
    assert "--aux-layers is for eagle3" in capsys.readouterr().err
    assert main(["train", "eagle3", *args, "--feature-layers", "1,2"]) == 2
    assert "eagle3 drafters read raw states: --aux-layers" in capsys.readouterr().err
    assert main(["train", "eagle3", *args, "--aux-layers", "1,x"]) == 2
    assert "--aux-layers takes a comma list" in capsys.readouterr().err


def test_draft_vocab_defaults_by_kind():
    from verispec.cli import build_parser
    from verispec.training.train import _draft_vocab

    parse = build_parser().parse_args
    assert _draft_vocab(parse(["train", "eagle3"])) == 32000
    assert _draft_vocab(parse(["train", "eagle"])) == 8192
    assert _draft_vocab(parse(["train", "eagle3", "--draft-vocab", "8192"])) == 8192
    with pytest.raises(VerispecError, match="unknown heads kind"):
        TrainSettings(kind="eagle4")
    assert settings().tree == {"nodes": 16, "width": 4}
