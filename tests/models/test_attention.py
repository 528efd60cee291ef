"""The C++ rowwise attention: the attention's arithmetic (against float64), each position's bits
independent of what is computed beside it, and the same logits as the Python loop within rounding."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from tests.models.failed_build import fail_build
from verispec.models import attention, native
from verispec.models.hf import HFCausalLM

pytestmark = pytest.mark.skipif(
    native.load(attention.NATIVE_SOURCE) is not None, reason="the C++ attention did not build here"
)
H, HKV, D, CAPACITY = 6, 2, 16, 64


def _op(q, keys, values, start, window=0, tree=None):
    scale = q.shape[-1] ** -0.5
    return torch.ops.verispec_attention.rowwise_attention(q, keys, values, start, window, tree, scale)


def _reference(q, keys, values, key_lists):
    """float64 softmax attention of query s over the buffer positions key_lists[s]: [n, H, D]."""
    groups, scale = q.shape[0] // keys.shape[0], q.shape[-1] ** -0.5
    out = []
    for s, idx in enumerate(key_lists):
        k = keys[:, idx].double().repeat_interleave(groups, 0)  # [H, len, D]
        v = values[:, idx].double().repeat_interleave(groups, 0)
        p = (q[:, s : s + 1].double() @ k.transpose(1, 2) * scale).softmax(-1)
        out.append((p @ v)[:, 0])
    return torch.stack(out).float()


@pytest.fixture
def buffers():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(HKV, CAPACITY, D, generator=gen), torch.randn(HKV, CAPACITY, D, generator=gen)


@pytest.mark.parametrize("window", [0, 7])
def test_a_chain_attends_causally_within_the_window(buffers, window):
    keys, values = buffers
    start, n = 20, 5
    q = torch.randn(H, n, D)
    lists = []
    for s in range(n):
        seen = start + s + 1
        lists.append(list(range(max(0, seen - window) if window else 0, seen)))
    torch.testing.assert_close(_op(q, keys, values, start, window), _reference(q, keys, values, lists))


def test_a_tree_node_sees_the_prefix_and_its_ancestors_only(buffers):
    keys, values = buffers
    start = 10
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    q = torch.randn(H, 4, D)
    lists = [list(range(start)) + [start + j for j in range(4) if mask[s, j]] for s in range(4)]
    got = _op(q, keys, values, start, 0, mask)
    torch.testing.assert_close(got, _reference(q, keys, values, lists))
    # node 3 (path r, a, c) gives the bits of the chain r, a, c laid out after the prefix
    chain_keys, chain_values = keys.clone(), values.clone()
    for buf, src in ((chain_keys, keys), (chain_values, values)):
        buf[:, start : start + 3] = src[:, [start, start + 1, start + 3]]
    chain = _op(q[:, [0, 1, 3]].contiguous(), chain_keys, chain_values, start)
    assert torch.equal(got[[0, 1, 3]], chain)


def test_a_position_gives_the_same_bits_alone_or_beside_others(buffers):
    keys, values = buffers
    start, n = 30, 8
    q = torch.randn(H, n, D)
    together = _op(q, keys, values, start)
    for s in range(n):
        alone = _op(q[:, s : s + 1].contiguous(), keys, values, start + s)
        assert torch.equal(alone[0], together[s])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 2, 128), (14, 2, 64), (9, 3, 64)])
def test_real_head_shapes_across_key_blocks(heads, kv_heads, dim):
    """The Qwen2.5 1.5B / 0.5B and SmolLM2 head shapes (the vector paths' other chunkings), over
    key counts on both sides of the 16-key blocks of the AVX-512 path, against float64; and each
    position's bits alone as beside the others."""
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(kv_heads, 80, dim, generator=gen) for _ in range(2))
    start, n = 27, 6  # 28..33 keys each: a block and a tail of 12..15, two whole blocks, a tail of 1
    q = torch.randn(heads, n, dim, generator=gen)
    together = _op(q, keys, values, start)
    lists = [list(range(start + s + 1)) for s in range(n)]
    torch.testing.assert_close(together, _reference(q, keys, values, lists))
    for s in range(n):
        assert torch.equal(_op(q[:, s : s + 1].contiguous(), keys, values, start + s)[0], together[s])


def test_sharp_scores_against_float64():
    """Scores tens to hundreds apart: the vector paths' exp (a polynomial, 0 below -87.3) must
    still give float64's softmax, keys far below the top weighing nothing, with the last block of
    keys short of 8 (AVX2) and of 16 (AVX-512)."""
    gen = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(2, 64, 128, generator=gen) for _ in range(2))
    start, n = 40, 3  # 41..43 keys
    q = 30 * torch.randn(12, n, 128, generator=gen)  # scores spread over hundreds
    lists = [list(range(start + s + 1)) for s in range(n)]
    torch.testing.assert_close(_op(q, keys, values, start), _reference(q, keys, values, lists))


def test_the_model_scores_as_with_the_python_loop():
    lm = HFCausalLM(tiny_llama(2), name="float32")  # float weights: the difference is rounding only
    ids = [(3 * i + 1) % 96 for i in range(30)]

    def run() -> torch.Tensor:
        cache = lm.new_cache()
        lm.forward(torch.tensor([ids[:20]]), cache)
        return torch.cat(
            [lm.forward(torch.tensor([ids[i : i + 5]]), cache, logits_to_keep=5).logits[0] for i in (20, 25)]
        )

    native_logits = run()
    lm.native_attention = False
    python_logits = run()
    torch.testing.assert_close(native_logits, python_logits, rtol=1e-4, atol=1e-4)
    assert native_logits.argmax(-1).tolist() == python_logits.argmax(-1).tolist()


def test_a_failed_build_warns_once_and_keeps_the_python_loop(monkeypatch):
    lm = HFCausalLM(tiny_llama(2), name="float32")
    ids = torch.tensor([[(3 * i + 1) % 96 for i in range(12)]])

    def run() -> torch.Tensor:
        cache = lm.new_cache()
        lm.forward(ids[:, :8], cache)
        return lm.forward(ids[:, 8:], cache, logits_to_keep=4).logits[0]

    lm.native_attention = False
    want = run()
    lm.native_attention = True
    fail_build(monkeypatch, attention.NATIVE_SOURCE)
    with pytest.warns(UserWarning, match="rowwise_attention.cpp failed: no g"):
        got = run()
    assert torch.equal(got, want)
