"""The C++ layer operations (``kernels/layer_ops.cpp``): what torch computes, within rounding where
they sum or exponentiate and to the bit where they do not, row by row whatever the rows beside."""

from __future__ import annotations

import pytest
import torch

from verispec.models import native

_BUILD_ERROR = native.load("layer_ops.cpp")
pytestmark = pytest.mark.skipif(_BUILD_ERROR is not None, reason="layer_ops.cpp does not build here")
ops = torch.ops.verispec_layer if _BUILD_ERROR is None else None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("width", [1536, 1539, 5])  # whole vectors, a tail, only a tail
def test_rms_norm_is_transformers_norm_within_rounding(width):
    g = torch.Generator().manual_seed(width)
    x, w = torch.randn(6, width, generator=g) * 3, torch.randn(width, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), _rms(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    delta = torch.randn(6, width, generator=g)
    total, normed = ops.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, _rms(x + delta, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_a_row_s_bits_do_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 896, generator=g), torch.randn(896, generator=g)
    delta = torch.randn(40, 896, generator=g)
    alone = torch.cat([ops.rms_norm(x[i : i + 1], w, 1e-6) for i in range(40)])
    assert torch.equal(ops.rms_norm(x, w, 1e-6), alone)
    beside = ops.add_rms_norm(x, delta, w, 1e-6)[1][7:8]
    assert torch.equal(beside, ops.add_rms_norm(x[7:8], delta[7:8], w, 1e-6)[1])
    gate_up = torch.randn(40, 2 * 900, generator=g) * 4
    both = ops.silu_mul(gate_up[:, :900], gate_up[:, 900:])
    one = ops.silu_mul(gate_up[3:4, :900], gate_up[3:4, 900:])
    assert torch.equal(both[3:4], one)


def test_rotary_is_transformers_rotation_to_the_bit_on_the_rotated_heads_only():
    g = torch.Generator().manual_seed(1)
    rows, heads, kv, dim = 5, 12, 2, 128
    qkv = torch.randn(rows, (heads + 2 * kv) * dim, generator=g)
    cos, sin = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    got = qkv.clone()
    ops.rotary_(got, cos, sin, heads + kv)
    parts = qkv.view(rows, heads + 2 * kv, dim)
    qk = parts[:, : heads + kv]
    rotated = torch.cat((-qk[..., dim // 2 :], qk[..., : dim // 2]), dim=-1)
    want = qk * cos[:, None] + rotated * sin[:, None]  # transformers' apply_rotary_pos_emb
    assert torch.equal(got.view(rows, -1, dim)[:, : heads + kv], want)
    assert torch.equal(got.view(rows, -1, dim)[:, heads + kv :], parts[:, heads + kv :])  # values untouched


def test_an_element_of_silu_mul_does_not_depend_on_where_it_falls_in_a_row():
    """Rows of 24 take a 16-wide step then an 8-wide one with AVX-512 (8 + 8 + 8 with AVX2 alone), rows
    of 8 one 8-wide step: every element must get the same bits either way. In rows of 25 the first 24
    keep those bits and the last, left to the scalar loop, is silu's within rounding."""
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(6, 25, generator=g) * 6, torch.randn(6, 25, generator=g)
    whole = ops.silu_mul(gate[:, :24], up[:, :24])  # rows of a view, as gate/up halves are
    pieces = [ops.silu_mul(gate[:, i : i + 8], up[:, i : i + 8]) for i in (0, 8, 16)]
    assert torch.equal(whole, torch.cat(pieces, dim=1))
    tail = ops.silu_mul(gate, up)
    assert torch.equal(tail[:, :24], whole)
    want = torch.nn.functional.silu(gate[:, 24]) * up[:, 24]
    torch.testing.assert_close(tail[:, 24], want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: exp's range is clamped, silu stays finite
def test_silu_mul_is_torch_s_within_rounding(scale):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * 1003, generator=g) * scale
    gate, up = gate_up[:, :1003], gate_up[:, 1003:]  # strided views, as split gives them
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(ops.silu_mul(gate, up), want, rtol=2e-6, atol=1e-6)


def test_bad_input_is_a_clear_error():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        ops.rms_norm(x.double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight has 4 elements for rows of 8"):
        ops.rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="residual and delta differ"):
        ops.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.rotary_(torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 4), 3)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.silu_mul(torch.randn(8, 2).t(), torch.randn(2, 8))
