"""The batch-invariant attention matches transformers' SDPA and ignores what else is in the batch."""

from __future__ import annotations

import copy

import torch

from tests.conftest import tiny_llama
from verispec.models.attention import register
from verispec.models.hf import HFCausalLM


def test_rowwise_attention_matches_sdpa():
    sdpa = HFCausalLM(tiny_llama(3), name="sdpa")
    rowwise_model = copy.deepcopy(sdpa.model)
    rowwise_model.set_attn_implementation(register())
    rowwise = HFCausalLM(rowwise_model, name="rowwise")
    ids = torch.tensor([list(range(1, 90))])
    want = sdpa.forward(ids, sdpa.new_cache(), logits_to_keep=0).logits
    got = rowwise.forward(ids, rowwise.new_cache(), logits_to_keep=0).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # And with a cache: a verify step of 5 tokens on top of 80 cached ones.
    cache_a, cache_b = sdpa.new_cache(), rowwise.new_cache()
    sdpa.forward(ids[:, :80], cache_a)
    rowwise.forward(ids[:, :80], cache_b)
    torch.testing.assert_close(
        rowwise.forward(ids[:, 80:85], cache_b, logits_to_keep=5).logits,
        sdpa.forward(ids[:, 80:85], cache_a, logits_to_keep=5).logits,
        rtol=1e-4,
        atol=1e-4,
    )
