"""The head networks and the draft-vocabulary LM head: shapes, initial behaviour, masks, int8."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_llama
from tests.models.failed_build import fail_build
from verispec.heads.eagle import DraftCache, DraftRows, EagleConfig, EagleDrafter, unrolled_masks
from verispec.heads.medusa import MedusaConfig, MedusaHeads
from verispec.heads.vocab import VocabHead, float_lm_head_weight
from verispec.models import native
from verispec.models.attention import NATIVE_SOURCE as ATTENTION_SOURCE
from verispec.models.fused import fuse_projections
from verispec.models.hf import HFCausalLM
from verispec.models.lean import NATIVE_SOURCE
from verispec.models.quant import quantize_int8_dynamic, quantize_model


def test_medusa_heads_shapes_and_identity_start():
    heads = MedusaHeads(MedusaConfig(hidden_size=64, num_heads=3, num_layers=2))
    h = torch.randn(5, 64)
    out = heads(h)
    assert out.shape == (5, 3, 64)
    # W = 0 at the start: every head is the identity, i.e. predicts what the LM head does.
    torch.testing.assert_close(out, h[:, None].expand(5, 3, 64))
    names = set(heads.state_dict())
    assert "medusa_head.0.0.linear.weight" in names and "medusa_head.2.1.linear.bias" in names


def test_eagle_config_takes_the_target_sizes(tiny_target):
    cfg = EagleConfig.for_target(tiny_target)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        64,
        128,
        4,
        2,
    )
    assert cfg.head_dim == 16
    assert EagleConfig.for_target(tiny_target, intermediate_size=32).intermediate_size == 32


def test_eagle_identity_start_passes_the_feature_through(tiny_target):
    """Like Medusa's zero-initialised heads: the untrained drafter's output is the feature itself
    (RMS-normalised), whatever the token and the other pairs, so it predicts what the LM head does."""
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target)).init_identity().eval()
    emb, feat = torch.randn(1, 6, 64), torch.randn(1, 6, 64)
    out, _, _ = drafter(emb, feat, torch.arange(6), torch.ones(6, 6, dtype=torch.bool).tril())
    rms = feat.pow(2).mean(-1, keepdim=True).add(drafter.config.rms_norm_eps).sqrt()
    torch.testing.assert_close(out, feat / rms, rtol=1e-4, atol=1e-4)


def test_eagle_feature_layers_start_as_the_last_state_alone(tiny_target):
    """EAGLE-3's taps: a drafter fusing lower layers starts exactly where one without them is (its
    projection is zero), so heads trained without taps are a warm start; trained, the taps count.
    Rows of the wrong width (heads for other layers) are refused."""
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target, feature_layers=[1, 0])).eval()
    assert drafter.config.feature_layers == (1, 0)
    assert drafter.tap_fc.weight.shape == (64, 128) and not drafter.tap_fc.weight.any()
    rows = torch.randn(5, 3 * 64) * torch.linspace(0.1, 40.0, 3 * 64)  # layers of different scales
    assert torch.equal(drafter.fuse(rows), rows[:, :64])
    with torch.no_grad():
        drafter.tap_fc.weight.normal_(0, 0.02)
    fused = drafter.fuse(rows)
    assert fused.shape == (5, 64) and not torch.allclose(fused, rows[:, :64])
    # each tap is RMS-normed first: scaling a layer's state leaves the fused feature as it was
    scaled = rows.clone()
    scaled[:, 64:128] *= 1000.0
    torch.testing.assert_close(drafter.fuse(scaled), fused, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="2 feature layers"):
        drafter.fuse(rows[:, :64])
    plain = EagleDrafter(EagleConfig.for_target(tiny_target)).eval()
    assert torch.equal(plain.fuse(rows[:, :64]), rows[:, :64]) and not hasattr(plain, "tap_fc")
    with pytest.raises(ValueError, match="0 feature layers"):
        plain.fuse(rows)


def test_eagle_drafter_incremental_equals_one_pass(tiny_target):
    """Feeding pairs in two chunks through the cache gives the same outputs as one causal pass."""
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target)).eval()
    emb, feat = torch.randn(1, 9, 64), torch.randn(1, 9, 64)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    full, _, _ = drafter(emb, feat, torch.arange(9), causal)
    cache = DraftCache.empty(drafter.config)
    first, k, v = drafter(emb[:, :5], feat[:, :5], torch.arange(5), causal[:5, :5])
    cache.append(k[0], v[0])
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[:, 5:] = torch.ones(4, 4, dtype=torch.bool).tril()
    second, _, _ = drafter(
        emb[:, 5:], feat[:, 5:], torch.arange(5, 9), mask, (cache.keys[None], cache.values[None])
    )
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 5


@pytest.mark.parametrize("native_ops", [False, True], ids=["torch-ops", "layer-ops"])
def test_eagle_drafting_step_computes_what_forward_does(tiny_target, native_ops):
    """The drafting pass (:meth:`EagleDrafter.step`: two sequences in one call, each attending over
    its own cache in place, one with a tree mask over scratch slots) gives forward()'s outputs,
    with torch's operations and with the C++ layer operations alike, and commits only true pairs."""
    if native_ops and native.load(NATIVE_SOURCE) is not None:
        pytest.skip("the C++ layer operations did not build here")
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target), native_ops=native_ops).eval()
    emb, feat = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    with torch.no_grad():
        want, _, _ = drafter(emb, feat, torch.arange(7), causal)
    caches = [DraftCache(drafter.config, capacity=2), DraftCache(drafter.config, capacity=2)]
    # catch-up: sequence 0 feeds 5 pairs, sequence 1 all 7, in one pass
    groups = [
        DraftRows(caches[0], 0, torch.arange(5), causal[:5, :5]),
        DraftRows(caches[1], 0, torch.arange(7), causal),
    ]
    out = drafter.step(torch.cat([emb[0, :5], emb[1]]), torch.cat([feat[0, :5], feat[1]]), groups)
    tol = 1e-3 if native_ops else 1e-5
    torch.testing.assert_close(out[:5], want[0, :5], rtol=tol, atol=tol)
    torch.testing.assert_close(out[5:], want[1], rtol=tol, atol=tol)
    caches[0].commit(5)
    caches[1].commit(7)
    assert (caches[0].length, caches[1].length) == (5, 7)  # grown past the capacity of 2
    # a tree level on sequence 0: two siblings at position 5, each seeing the cache and itself
    siblings = torch.zeros(2, 7, dtype=torch.bool)
    siblings[:, :5] = True
    siblings[0, 5] = siblings[1, 6] = True
    level = [DraftRows(caches[0], 5, torch.tensor([5, 5]), siblings)]
    tree = drafter.step(emb[0, 5:7], feat[0, 5:7], level)
    with torch.no_grad():
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[:, 5:] = torch.eye(2, dtype=torch.bool)
        positions = torch.tensor([0, 1, 2, 3, 4, 5, 5])
        full, _, _ = drafter(emb[:1], feat[:1], positions, torch.cat([causal[:5], mask]))
    torch.testing.assert_close(tree, full[0, 5:], rtol=tol, atol=tol)
    assert caches[0].length == 5  # the tree's keys stayed in scratch slots


def test_catch_up_pairs_are_the_same_bits_however_the_passes_group_them(tiny_target):
    """With quantized Linears and the C++ operations a true pair's key, value and output do not
    depend on the pairs beside it in a catch-up pass (what lets the prefix cache hand one request's
    pairs to another); a drafter with float Linears does not claim it."""
    if native.load(NATIVE_SOURCE) is not None or native.load(ATTENTION_SOURCE) is not None:
        pytest.skip("the C++ operations did not build here")
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target)).eval()
    assert not drafter.position_invariant  # float products through BLAS
    fuse_projections(quantize_model(drafter, "int8"))
    assert drafter.position_invariant
    emb, feat = torch.randn(23, 64), torch.randn(23, 64)

    def catch_up(passes: list[int]) -> tuple[DraftCache, torch.Tensor]:
        cache, outs, start = DraftCache(drafter.config, capacity=4), [], 0
        for n in passes:
            causal = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
            rows = DraftRows(cache, start, torch.arange(start, start + n), causal, catch_up=True)
            outs.append(drafter.step(emb[start : start + n], feat[start : start + n], [rows]))
            cache.commit(n)
            start += n
        return cache, torch.cat(outs)

    whole, whole_out = catch_up([23])
    parts, parts_out = catch_up([1, 4, 2, 5, 3, 1, 7])
    assert torch.equal(whole.keys, parts.keys) and torch.equal(whole.values, parts.values)
    assert torch.equal(whole_out, parts_out)


def test_a_failed_layer_ops_build_warns_and_drafts_with_torch_s_operations(tiny_target, monkeypatch):
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_target)).eval()
    emb, feat = torch.randn(4, 64), torch.randn(4, 64)

    def run() -> torch.Tensor:
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        rows = DraftRows(DraftCache(drafter.config), 0, torch.arange(4), causal)
        return drafter.step(emb, feat, [rows])

    drafter.native_ops = False
    want = run()
    drafter.native_ops = True
    fail_build(monkeypatch, NATIVE_SOURCE)
    with pytest.warns(UserWarning, match="EAGLE drafting keeps torch's operations"):
        got = run()
    assert torch.equal(got, want)


def test_unrolled_masks_see_what_a_draft_node_sees():
    masks = unrolled_masks(6, 3)
    assert [tuple(m.shape) for m in masks] == [(6, 6), (6, 12), (6, 18)]
    assert torch.equal(masks[0], torch.ones(6, 6, dtype=torch.bool).tril())
    # Pass 3 at position 4: true keys <= 2, pass-2 key at 3, its own pass-3 key at 4.
    row = masks[2][4]
    assert row[:6].nonzero().flatten().tolist() == [0, 1, 2]
    assert row[6:12].nonzero().flatten().tolist() == [3]
    assert row[12:].nonzero().flatten().tolist() == [4]
    # Every query sees at least itself (no empty softmax rows).
    assert all(bool(m.any(dim=1).all()) for m in masks)


def test_vocab_head_restricts_the_target_head(tiny_target):
    vocab = torch.tensor([5, 0, 77, 31])
    head = VocabHead(tiny_target, vocab)
    h = torch.randn(3, 64)
    full = tiny_target.lm_head(h)
    torch.testing.assert_close(head(h), full[:, vocab])
    assert head.to_target(torch.tensor([2, 0])).tolist() == [77, 5]
    mapping = head.target_to_draft(tiny_target.vocab_size)
    assert mapping[77] == 2 and mapping[1] == -1
    whole = VocabHead(tiny_target, None)
    torch.testing.assert_close(whole(h), full)
    assert whole.to_target(torch.tensor([9])).tolist() == [9]


def test_vocab_head_slices_an_int8_head_without_requantizing():
    model = quantize_int8_dynamic(copy.deepcopy(tiny_llama(0)))
    target = HFCausalLM(model, name="tiny-int8")
    vocab = torch.tensor([3, 50, 7])
    h = torch.randn(4, 64)
    head = VocabHead(target, vocab)
    assert head.linear is not None  # int8 rows, not a float copy
    torch.testing.assert_close(head(h), target.lm_head(h)[:, vocab], rtol=1e-5, atol=1e-5)
    # Training reads the de-quantized weights: close to the int8 head's products.
    weight = float_lm_head_weight(target)
    assert weight.shape == (96, 64)
    torch.testing.assert_close(h @ weight.T, target.lm_head(h), rtol=0.05, atol=0.05)


def test_vocab_head_slices_an_int4_head_without_requantizing(monkeypatch):
    """Where the int4 path's LM head is int4 (AVX2 CPUs), a draft vocabulary's head takes its rows
    as they are: the draft scores its tokens exactly as the target does."""
    from verispec.models import int4

    if not int4.cpu_supports_int4():
        pytest.skip("the int4 kernel needs AVX2 or AVX-512 VNNI")
    monkeypatch.setenv(int4.HEAD_ENV, "1")
    target = HFCausalLM(quantize_model(copy.deepcopy(tiny_llama(0)), "int4"), name="tiny-int4")
    assert isinstance(target.lm_head, int4.Int4Linear)
    vocab = torch.tensor([3, 50, 7])
    h = torch.randn(4, 64)
    for int4_heads in (True, False):
        head = VocabHead(target, vocab, int4=int4_heads)
        assert torch.equal(head(h), target.lm_head(h)[:, vocab])
    assert VocabHead(target, None).linear is target.lm_head
    weight = float_lm_head_weight(target)
    assert weight.shape == (96, 64)
    torch.testing.assert_close(h @ weight.T, target.lm_head(h), rtol=0.05, atol=0.05)
