"""Fused projections: one quantized product for q/k/v and for gate/up, bit-identical to the separate
Linears, whatever the call order, and in a whole model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import tiny_llama
from tests.test_engine import PROMPTS
from verispec.models import int4
from verispec.models.fused import FusedLinear, FusedPart, fuse_projections
from verispec.models.hf import HFCausalLM
from verispec.models.int4 import Int4Linear
from verispec.models.quant import RowwiseInt8Linear, quantize_model

needs_int4 = pytest.mark.skipif(not int4.cpu_supports_int4(), reason="the int4 kernel needs AVX2 or AVX-512")
KINDS = [
    pytest.param(RowwiseInt8Linear, id="int8"),
    pytest.param(Int4Linear, id="int4", marks=needs_int4),
]


def _attention(kind: type, sizes: tuple[int, int, int], biases: tuple[bool, bool, bool]) -> nn.Module:
    torch.manual_seed(sum(sizes))
    parent = nn.Module()
    for name, n, bias in zip(("q_proj", "k_proj", "v_proj"), sizes, biases, strict=True):
        setattr(parent, name, kind.from_linear(nn.Linear(96, n, bias=bias)))
    return parent


@pytest.mark.parametrize("kind", KINDS)
def test_fused_parts_equal_the_separate_linears_to_the_bit(kind):
    parent = _attention(kind, (64, 32, 36), (True, False, True))
    separate = copy.deepcopy(parent)
    assert fuse_projections(parent) == 1
    assert isinstance(parent.q_proj, FusedPart) and isinstance(parent.qkv_proj, FusedLinear)
    for rows in ((1,), (1, 5), (3, 9)):
        x = torch.randn(*rows, 96) * 3
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(parent, name)(x), getattr(separate, name)(x)), (name, rows)


@needs_int4
def test_int4_channels_padded_inside_the_group_are_not_fused():
    parent = _attention(Int4Linear, (64, 30, 32), (False, False, False))  # k's last block is padded
    assert fuse_projections(parent) == 0
    assert isinstance(parent.k_proj, Int4Linear)


@pytest.mark.skipif(not int4.amx_available(), reason="the AMX kernels need a CPU with AMX-INT8")
def test_int4_amx_layers_fuse_in_their_own_layout_where_their_tiles_line_up():
    """AMX layers are concatenated as they are (no round trip through the VNNI layout); a layer
    that is not a whole number of 16-channel tiles is not fused inside, one that is may be, and the
    fused product equals the separate ones to the bit."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(int4.AMX_ENV, "1")
        padded = _attention(Int4Linear, (64, 36, 32), (False, False, False))  # 36: whole VNNI blocks only
        aligned = _attention(Int4Linear, (64, 48, 36), (True, False, True))
    assert fuse_projections(padded) == 0
    separate = copy.deepcopy(aligned)
    assert fuse_projections(aligned) == 1
    assert aligned.qkv_proj.linear.amx
    x = torch.randn(5, 96)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(aligned, name)(x), getattr(separate, name)(x)), name


def test_mixed_kinds_are_not_fused():
    parent = _attention(RowwiseInt8Linear, (64, 32, 32), (False, False, False))
    parent.v_proj = nn.Linear(96, 32)
    assert fuse_projections(parent) == 0


def test_a_part_recomputes_for_a_new_or_changed_input_and_drops_the_product_after_use():
    parent = _attention(RowwiseInt8Linear, (64, 32, 32), (True, True, True))
    separate = copy.deepcopy(parent)
    fuse_projections(parent)
    group: FusedLinear = parent.qkv_proj
    calls = 0
    forward = group.linear.forward

    def counting(x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return forward(x)

    group.linear.forward = counting  # type: ignore[method-assign]
    x, y = torch.randn(2, 96), torch.randn(2, 96)
    assert torch.equal(parent.k_proj(x), separate.k_proj(x))  # any order
    assert torch.equal(parent.q_proj(x), separate.q_proj(x))
    assert torch.equal(parent.q_proj(y), separate.q_proj(y))  # a new input before v took its part
    x.mul_(2)  # changed in place: the same tensor object, new values
    assert torch.equal(parent.q_proj(x), separate.q_proj(x))
    assert calls == 3
    parent.k_proj(x)
    parent.v_proj(x)
    assert calls == 3 and group._parts == () and group._input is None  # all taken: nothing held


@pytest.mark.parametrize("scheme", ["int8", pytest.param("int4", marks=needs_int4)])
def test_a_fused_model_gives_the_unfused_logits_to_the_bit(scheme):
    model = tiny_llama(0)
    unfused = HFCausalLM(quantize_model(copy.deepcopy(model), scheme), name="unfused")
    quantized = quantize_model(copy.deepcopy(model), scheme)
    fuse_projections(quantized)  # as the loaders do
    fused = HFCausalLM(quantized, name="fused")
    assert sum(isinstance(m, FusedLinear) for m in fused.model.modules()) == 4  # 2 layers x 2 groups
    assert not any(isinstance(m, FusedLinear) for m in unfused.model.modules())
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    want = unfused.forward(ids, unfused.new_cache(), logits_to_keep=0).logits
    assert torch.equal(fused.forward(ids, fused.new_cache(), logits_to_keep=0).logits, want)
    step = [[3], [7, 8, 9]]  # decode and verify rows after each prompt, batched
    caches = {m: [m.new_cache(), m.new_cache()] for m in (unfused, fused)}
    for m, pair in caches.items():
        m.forward_batch(pair, [PROMPTS[0], PROMPTS[1]], logits_to_keep=[0, 0])
    want_rows = unfused.forward_batch(caches[unfused], step, logits_to_keep=[1, 3]).logits
    got_rows = fused.forward_batch(caches[fused], step, logits_to_keep=[1, 3]).logits
    assert all(torch.equal(g, w) for g, w in zip(got_rows, want_rows, strict=True))
