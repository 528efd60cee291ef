"""Per-sequence KV buffers and batched forwards: rollback, growth, independence of rows, windows, trees."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

from tests.conftest import tiny_llama
from verispec.models.hf import HFCausalLM
from verispec.models.kv import KVBuffer
from verispec.models.quant import quantize_int8_dynamic
from verispec.types import Draft
from verispec.verify.tree import tree_attention_inputs


def test_buffer_grows_trims_and_clones():
    buf = KVBuffer()
    key = torch.arange(2 * 70 * 3, dtype=torch.float32).reshape(2, 70, 3)
    buf.write(0, 0, key, -key)
    buf.advance(70)
    assert buf.layer(0)[0].shape[1] >= 70  # grew past the initial capacity, keeping the data
    torch.testing.assert_close(buf.layer(0)[0][:, :70], key)
    buf.trim(10)
    assert buf.length == 60
    with pytest.raises(ValueError):
        buf.trim(61)
    copy = buf.clone()
    copy.trim(60)
    assert buf.length == 60 and copy.length == 0
    assert buf.nbytes > 0


@pytest.fixture(scope="module")
def int8_lm() -> HFCausalLM:
    """int8 is the batch-invariant path: results are compared to the bit there (float32 GEMMs may
    round differently for a different number of rows)."""
    return HFCausalLM(quantize_int8_dynamic(tiny_llama(4)), name="int8")


def test_rows_of_a_batch_do_not_see_each_other(int8_lm):
    lm = int8_lm
    ids = list(range(1, 60))
    alone_cache = lm.new_cache()
    lm.forward(torch.tensor([ids[:30]]), alone_cache)
    alone = lm.forward(torch.tensor([ids[30:34]]), alone_cache, logits_to_keep=4).logits[0]
    caches = [lm.new_cache() for _ in range(3)]
    for cache, n in zip(caches, (5, 30, 50), strict=True):
        lm.forward(torch.tensor([ids[:n]]), cache)
    out = lm.forward_batch(
        caches, [[7], ids[30:34], ids[50:52]], logits_to_keep=[1, 4, 2], return_hidden=True
    )
    assert [tuple(x.shape) for x in out.logits] == [(1, 96), (4, 96), (2, 96)]
    assert out.hidden is not None and out.hidden[1].shape == (4, 64)
    assert torch.equal(out.logits[1], alone)
    assert [c.length for c in caches] == [6, 34, 52]


def test_packed_rows_hand_each_row_its_own_tail_and_cache_positions(int8_lm):
    """Rows of 1, 9 and 3 tokens lie side by side in one forward: each row's logits, hidden states
    and keys are those it gets alone, whichever rows sit before and after it."""
    lm, rows = int8_lm, [[5], list(range(10, 19)), [40, 41, 42]]
    alone = []
    for row in rows:
        cache = lm.new_cache()
        lm.forward(torch.tensor([[3, 4]]), cache)
        out = lm.forward_batch([cache], [row], logits_to_keep=[len(row)], hidden_to_keep=[min(2, len(row))])
        alone.append((out.logits[0], out.hidden[0], cache.layer(0)[0][:, : cache.length].clone()))
    caches = [lm.new_cache() for _ in rows]
    for cache in caches:
        lm.forward(torch.tensor([[3, 4]]), cache)
    out = lm.forward_batch(caches, rows, logits_to_keep=[len(r) for r in rows], hidden_to_keep=[1, 2, 2])
    for b, (logits, hidden, keys) in enumerate(alone):
        assert torch.equal(out.logits[b], logits)
        assert torch.equal(out.hidden[b], hidden[-out.hidden[b].shape[0] :])
        assert torch.equal(caches[b].layer(0)[0][:, : caches[b].length], keys)
    with pytest.raises(ValueError, match="at most its own tokens"):
        lm.forward_batch([lm.new_cache(), lm.new_cache()], [[1], [2, 3]], logits_to_keep=[2, 1])


def test_cached_decoding_matches_transformers_full_forward(tiny_target):
    ids = torch.tensor([list(range(3, 40))])
    want = tiny_target.model(input_ids=ids).logits[0].float()  # transformers' own attention path
    cache = tiny_target.new_cache()
    got = [tiny_target.forward(ids[:, :20], cache, logits_to_keep=20).logits[0]]
    got += [tiny_target.forward(ids[:, i : i + 1], cache).logits[0] for i in range(20, 37)]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def _sliding_models() -> list[tuple[str, object]]:
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"], max_position_embeddings=256,
        )
    )  # fmt: skip
    gemma = Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=6, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"],
        )
    )  # fmt: skip
    return [("qwen2", qwen.eval()), ("gemma3", gemma.eval())]


@pytest.mark.parametrize(("name", "model"), _sliding_models(), ids=lambda v: v if isinstance(v, str) else "")
def test_sliding_window_layers_match_transformers(name, model):
    """Keys older than the window are masked (kept in the buffer, so rollback past them works)."""
    ids = torch.tensor([[(7 * i) % 64 for i in range(30)]])
    model.set_attn_implementation("sdpa")
    want = model(input_ids=ids).logits[0].float()
    lm = HFCausalLM(model, name=name)
    cache = lm.new_cache()
    got = [lm.forward(ids[:, :4], cache, logits_to_keep=4).logits[0]]
    got += [lm.forward(ids[:, i : i + 2], cache, logits_to_keep=2).logits[0] for i in range(4, 30, 2)]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def test_a_token_tree_scores_each_branch_as_if_alone(int8_lm):
    """Root r with children a and b, and c under a: b must be scored as if a never existed."""
    lm = int8_lm
    prefix, r, a, b, c = [5, 6, 7], 11, 12, 13, 14

    def chain(tokens: list[int]) -> torch.Tensor:
        cache = lm.new_cache()
        lm.forward(torch.tensor([prefix]), cache)
        return lm.forward(torch.tensor([tokens]), cache, logits_to_keep=len(tokens)).logits[0]

    cache = lm.new_cache()
    lm.forward(torch.tensor([prefix]), cache)
    mask = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )  # rows: r, a, b, c
    depth = [0, 1, 1, 2]
    out = lm.forward_batch(
        [cache], [[r, a, b, c]], logits_to_keep=[4], positions=[[3 + d for d in depth]], tree_masks=[mask]
    ).logits[0]
    assert torch.equal(out[[0, 1, 3]], chain([r, a, c]))
    assert torch.equal(out[2], chain([r, b])[1])


def test_rolling_a_tree_back_to_its_accepted_path_equals_feeding_the_path(int8_lm):
    lm = int8_lm
    tree = Draft(tokens=torch.tensor([12, 13, 14]), parents=torch.tensor([-1, -1, 0]))  # r->{a, b}, a->c
    cache = lm.new_cache()
    lm.forward(torch.tensor([[5, 6, 7]]), cache)
    positions, mask = tree_attention_inputs(tree, start=3)
    lm.forward_batch(
        [cache], [[11, 12, 13, 14]], logits_to_keep=[4], positions=[positions], tree_masks=[mask]
    )
    cache.rollback(3, [0, 1, 3])  # keep r, a, c
    chain = lm.new_cache()
    lm.forward(torch.tensor([[5, 6, 7]]), chain)
    lm.forward(torch.tensor([[11, 12, 14]]), chain, logits_to_keep=3)
    assert cache.length == chain.length == 6
    after_tree = lm.forward(torch.tensor([[20]]), cache).logits
    assert torch.equal(after_tree, lm.forward(torch.tensor([[20]]), chain).logits)
