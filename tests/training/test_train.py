"""Training on cached target states: labels, learning, evaluation and resumable checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from tests.training.tiny import tiny_data, token_arrays, trained
from verispec.errors import VerispecError
from verispec.heads.eagle import EagleConfig, EagleDrafter
from verispec.heads.identity import identify
from verispec.heads.io import WEIGHTS_FILE, file_sha256, load_heads, save_heads
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.heads.vocab import VocabHead
from verispec.training.config import PRECISIONS, TrainSettings, default_precision
from verispec.training.eagle import eagle_batch, eagle_loss, eagle_passes, evaluate_eagle, length_batches
from verispec.training.loop import fit, warm_start
from verispec.training.medusa import evaluate_medusa, medusa_loss, medusa_positions
from verispec.training.tokens import TokenData
from verispec.training.train import evaluate_saved, train_heads


def test_token_data_labels_and_validity(tiny_target):
    arrays = token_arrays(tiny_target, [[1, 2, 3, 4], [5, 6, 7]], heldout_every=2)
    arrays["labelled"] = np.array([0, 0, 1, 1, 1, 0, 1], dtype=bool)
    target, text = TokenData(arrays, "target"), TokenData(arrays, "data")
    # ok[t]: token t+1 exists in t's sequence and is labelled.
    assert target.ok.tolist() == [False, True, True, False, False, True, False]
    assert text.label[:3].tolist() == [2, 3, 4] and text.label[4:6].tolist() == [6, 7]
    assert torch.equal(target.label, torch.from_numpy(arrays["argmax"]).long())
    assert torch.equal(text.greedy, target.greedy)  # accuracy is always against the target's argmax
    assert target.sequences(heldout=False) == [(0, 4)] and target.sequences(heldout=True) == [(4, 7)]
    assert medusa_positions(target, heldout=False).tolist() == [0, 1]


def test_frequent_labels_come_from_the_training_split(tiny_target):
    data = tiny_data(tiny_target, count=10, length=20)
    vocab, coverage = data.frequent_labels(5)
    assert vocab.numel() == 5 and 0 < coverage <= 1
    train = torch.zeros(data.total, dtype=torch.bool)
    for a, b in data.sequences(heldout=False):
        train[a:b] = True
    counts = torch.bincount(data.label[train & data.ok], minlength=tiny_target.vocab_size)
    assert counts[vocab].min() >= counts.sort(descending=True).values[4]
    assert data.frequent_labels(0) == (None, 1.0)


def test_medusa_training_learns_the_targets_continuations(tiny_target):
    data = tiny_data(tiny_target)
    vocab = VocabHead(tiny_target, None, for_training=True)
    untrained = MedusaHeads(MedusaConfig(hidden_size=64, num_heads=3))
    before = evaluate_medusa(untrained, vocab, data, width=3)
    heads, _, report = trained(tiny_target, "medusa")
    after = report["heldout_accuracy"]
    assert [row["depth"] for row in after] == [1, 2, 3]
    assert after[0]["top1"] > before[0]["top1"] + 0.1, (before, after)
    assert after[0]["top4"] >= after[0]["top1"] > 0.35
    assert report["final_loss"] < report["loss_curve"][0][1]
    assert evaluate_medusa(heads, vocab, data, width=4) == after


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eagle_training_learns_and_reports_every_depth(tiny_target, precision):
    """Under bf16 autocast too: the products run in bfloat16, the master weights stay float32."""
    data = tiny_data(tiny_target)
    vocab = VocabHead(tiny_target, None, for_training=True)
    embeddings = tiny_target.model.get_input_embeddings().weight.detach()
    torch.manual_seed(0)
    untrained = EagleDrafter(EagleConfig.for_target(tiny_target)).eval()
    before = evaluate_eagle(untrained, vocab, data, embeddings, width=4, depths=3)
    overrides = {} if precision == "fp32" else {"precision": precision}  # fp32: the shared cached run
    drafter, _, report = trained(tiny_target, "eagle", **overrides)
    after = report["heldout_accuracy"]
    assert [row["depth"] for row in after] == [1, 2, 3, 4, 5]  # beyond the 2 trained passes too
    assert after[0]["top1"] > before[0]["top1"] + 0.2, (before, after)
    assert after[1]["top1"] > before[1]["top1"], (before, after)
    assert report["settings"]["precision"] == precision
    assert all(p.dtype == torch.float32 for p in drafter.parameters())


def test_eagle_soft_loss_shares_one_teacher_across_passes(tiny_target):
    """The per-batch teacher equals the per-pass teacher it replaced: same loss to float precision."""
    data = tiny_data(tiny_target, count=6, length=20)
    vocab = VocabHead(tiny_target, None, for_training=True)
    to_draft = vocab.target_to_draft(tiny_target.vocab_size)
    embeddings = tiny_target.model.get_input_embeddings().weight.detach()
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target))
    batch = eagle_batch(data, embeddings, data.sequences(heldout=False)[:3])
    settings = TrainSettings(kind="eagle", unroll=3, labels="soft")
    want = torch.zeros(())
    for d, (out, counts) in enumerate(eagle_passes(drafter, batch, settings.unroll)):
        teacher = vocab(batch.next_features[counts]).softmax(dim=-1)
        ce = F.cross_entropy(vocab(out[counts]), teacher)
        feat = F.smooth_l1_loss(out[counts], batch.next_features[counts])
        want = want + settings.depth_decay**d * (ce + settings.feature_weight * feat)
    got = eagle_loss(drafter, vocab, batch, to_draft, settings)
    assert torch.allclose(got, want, rtol=1e-5), (got, want)


def test_a_draft_vocabulary_restricts_what_heads_can_propose(tiny_target):
    _, vocab_ids, report = trained(tiny_target, "medusa", draft_vocab=8, epochs=3)
    assert vocab_ids.numel() == 8 and report["draft_vocab_size"] == 8
    assert 0 < report["draft_vocab_label_coverage"] <= 1


def test_training_resumes_from_its_checkpoint(tmp_path, tiny_target):
    data = tiny_data(tiny_target, count=10, length=20)
    vocab = VocabHead(tiny_target, None, for_training=True)
    to_draft = vocab.target_to_draft(tiny_target.vocab_size)
    j = medusa_positions(data, heldout=False)

    def batches(epoch: int) -> list[torch.Tensor]:
        return list(j[torch.randperm(j.numel(), generator=torch.Generator().manual_seed(epoch))].split(32))

    def run(epochs: int, resume: bool) -> tuple[MedusaHeads, dict]:
        torch.manual_seed(0)
        heads = MedusaHeads(MedusaConfig(hidden_size=64, num_heads=2))
        settings = TrainSettings(kind="medusa", num_heads=2, epochs=epochs, lr=1e-2)
        loss = lambda b: medusa_loss(heads, vocab, data, to_draft, b, 0.8)  # noqa: E731
        return heads, fit(heads, batches, loss, settings, tmp_path / "ck.pt", resume=resume, progress=False)

    _, first = run(epochs=1, resume=False)
    per_epoch = len(batches(0))
    assert first["steps"] == per_epoch and (tmp_path / "ck.pt").is_file()
    resumed, second = run(epochs=2, resume=True)  # continues at step per_epoch, not from zero
    assert second["steps"] == 2 * per_epoch
    assert second["seconds"] >= first["seconds"]
    _, third = run(epochs=2, resume=False)  # without --resume the checkpoint is ignored
    assert third["steps"] == 2 * per_epoch
    h = data.features(j[:8])
    assert not torch.allclose(resumed(h), MedusaHeads(MedusaConfig(hidden_size=64, num_heads=2))(h))


def test_training_can_go_on_from_saved_heads(tmp_path, tiny_target):
    """--init-from: a run starts from saved heads (here with a learning rate too small to move them,
    so it keeps their accuracy, where the same run from scratch has learnt nothing)."""
    drafter, vocab_ids, report = trained(tiny_target, "eagle")
    save_heads(tmp_path / "eagle", "eagle", drafter, identify(tiny_target), vocab_ids)
    still = dict(kind="eagle", unroll=2, draft_vocab=0, epochs=1, batch_tokens=256, lr=1e-12)
    data = tiny_data(tiny_target)
    _, _, kept = train_heads(
        tiny_target, data, TrainSettings(**still, init_from=str(tmp_path / "eagle")), progress=False
    )
    _, _, cold = train_heads(tiny_target, data, TrainSettings(**still), progress=False)
    first = [row["top1"] for row in report["heldout_accuracy"]]
    assert [row["top1"] for row in kept["heldout_accuracy"]] == pytest.approx(first, abs=0.03)
    assert cold["heldout_accuracy"][0]["top1"] < first[0] - 0.2
    assert kept["init_from_sha256"] == file_sha256(tmp_path / "eagle" / WEIGHTS_FILE)
    assert "init_from_sha256" not in cold
    # Other sizes or another kind are refused with a clear error.
    narrow = EagleDrafter(EagleConfig.for_target(tiny_target, 32))
    with pytest.raises(VerispecError, match="only a wider MLP"):
        warm_start(narrow, TrainSettings(kind="eagle", init_from=str(tmp_path / "eagle")), tiny_target)
    medusa = MedusaHeads(MedusaConfig(hidden_size=64, num_heads=2))
    with pytest.raises(VerispecError, match="not medusa heads"):
        warm_start(medusa, TrainSettings(kind="medusa", init_from=str(tmp_path / "eagle")), tiny_target)


def test_a_wider_drafter_starts_from_narrower_heads_computing_the_same(tmp_path, tiny_target):
    """--init-from heads with a narrower MLP: the old units are copied and the new ones add nothing
    until trained (zero down-projection columns), so the widened drafter's outputs are the saved
    drafter's; the new units' gate/up rows are random, so they get gradients and learn."""
    trained_plain, vocab_ids, _ = trained(tiny_target, "eagle")
    save_heads(tmp_path / "eagle", "eagle", trained_plain, identify(tiny_target), vocab_ids)
    plain = load_heads(tmp_path / "eagle", tiny_target, kind="eagle").module  # as saved (rounded)
    wide = EagleDrafter(EagleConfig.for_target(tiny_target, 3 * plain.config.intermediate_size))
    warm_start(wide, TrainSettings(kind="eagle", init_from=str(tmp_path / "eagle")), tiny_target)
    data = tiny_data(tiny_target, count=6, length=20)
    embeddings = tiny_target.model.get_input_embeddings().weight.detach()
    batch = eagle_batch(data, embeddings, data.sequences(heldout=False)[:3])
    with torch.no_grad():
        for (got, _), (want, _) in zip(
            eagle_passes(wide.eval(), batch, 2), eagle_passes(plain, batch, 2), strict=True
        ):
            assert torch.allclose(got, want, atol=1e-5)
    mlp, width = wide.layers[0].mlp, plain.config.intermediate_size
    assert mlp.gate_proj.weight[width:].abs().sum() > 0 and mlp.down_proj.weight[:, width:].abs().sum() == 0
    vocab = VocabHead(tiny_target, None, for_training=True)
    wide.train()
    eagle_loss(
        wide, vocab, batch, vocab.target_to_draft(tiny_target.vocab_size), TrainSettings(kind="eagle")
    ).backward()
    assert mlp.down_proj.weight.grad[:, width:].abs().sum() > 0


def test_saved_heads_are_evaluated_on_held_out_and_training_text(tmp_path, tiny_target):
    """--eval-only: the saved heads' held-out accuracy is the one training reported (to float16
    rounding of the weights), beside a sample of the training split of about the same size."""
    data = tiny_data(tiny_target)
    held, sample = data.eval_sequences("heldout"), data.eval_sequences("train")
    assert held == data.sequences(heldout=True) and 0 < len(sample) <= len(held)
    assert set(sample) <= set(data.sequences(heldout=False))
    with pytest.raises(VerispecError, match="unknown evaluation split"):
        data.eval_sequences("test")
    for kind in ("eagle", "medusa"):
        module, vocab_ids, report = trained(tiny_target, kind)
        save_heads(tmp_path / kind, kind, module, identify(tiny_target), vocab_ids)
        settings = TrainSettings(kind=kind, num_heads=3, unroll=2, init_from=str(tmp_path / kind))
        table = evaluate_saved(tiny_target, data, settings).splitlines()
        depths = len(report["heldout_accuracy"])
        assert len(table) == depths + 2 and "held-out | on a sample of the training text" in table[0]
        for line, row in zip(table[1:], report["heldout_accuracy"], strict=False):
            held_top1 = float(line.split(":")[1].split("/")[0])
            assert held_top1 == pytest.approx(row["top1"], abs=0.02), (kind, line, row)
    with pytest.raises(VerispecError, match="give their folder as --init-from"):
        evaluate_saved(tiny_target, data, TrainSettings(kind="eagle"))


def test_length_batches_group_similar_lengths():
    seqs = [(0, 10), (10, 110), (110, 115), (115, 215), (215, 220)]
    batches = length_batches(seqs, batch_tokens=200, rng=None)
    assert sorted(s for b in batches for s in b) == sorted(seqs)
    assert all(len(b) * max(e - s for s, e in b) <= 200 or len(b) == 1 for b in batches)
    shuffled = length_batches(seqs, 200, np.random.default_rng(0))
    assert sorted(map(tuple, shuffled)) == sorted(map(tuple, batches))


def test_settings_are_validated():
    with pytest.raises(VerispecError, match="unknown heads kind"):
        TrainSettings(kind="hydra")
    with pytest.raises(VerispecError, match="labels"):
        TrainSettings(kind="medusa", labels="mixed")
    with pytest.raises(VerispecError, match="epochs"):
        TrainSettings(kind="eagle", epochs=0)
    with pytest.raises(VerispecError, match="precision"):
        TrainSettings(kind="eagle", precision="fp8")
    assert TrainSettings(kind="eagle").tree == {"nodes": 16, "width": 4}
    assert default_precision() in PRECISIONS


def test_eagle_with_feature_layers_trains_and_warm_starts_from_heads_without_them(tmp_path, tiny_target):
    """On data with taps (the normed input of layer 1) the drafter fuses them and learns; heads
    trained without taps are a warm start that keeps their accuracy (the taps' projection starts
    at zero); data without the drafter's taps is refused with a clear error."""
    plain, vocab_ids, plain_report = trained(tiny_target, "eagle")
    drafter, _, report = trained(tiny_target, "eagle", layers=(1,))
    assert drafter.config.feature_layers == (1,) and drafter.tap_fc.weight.abs().sum() > 0
    assert report["heldout_accuracy"][0]["top1"] > 0.5, report["heldout_accuracy"]
    save_heads(tmp_path / "eagle", "eagle", plain, identify(tiny_target), vocab_ids)
    data = tiny_data(tiny_target, layers=(1,))
    still = dict(kind="eagle", unroll=2, draft_vocab=0, epochs=1, batch_tokens=256, lr=1e-12)
    warm, _, kept = train_heads(
        tiny_target, data, TrainSettings(**still, init_from=str(tmp_path / "eagle")), progress=False
    )
    assert warm.config.feature_layers == (1,)
    first = [row["top1"] for row in plain_report["heldout_accuracy"]]
    assert [row["top1"] for row in kept["heldout_accuracy"]] == pytest.approx(first, abs=0.01)
    vocab = VocabHead(tiny_target, None, for_training=True)
    embeddings = tiny_target.model.get_input_embeddings().weight.detach()
    with pytest.raises(VerispecError, match="train with --feature-layers"):
        evaluate_eagle(drafter, vocab, tiny_data(tiny_target), embeddings, width=4, depths=2)
