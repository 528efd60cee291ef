"""The lean decoder forward gives transformers' forward's bits with torch's operations, and matches
it within rounding with the C++ layer operations: prompts, batched decode and verify rows, token
trees and sliding windows, on float, int8 and int4 weights. With the C++ operations a token's bits
do not depend on the rows beside it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.conftest import tiny_llama
from tests.models.failed_build import fail_build
from tests.models.test_fused import needs_int4
from verispec.errors import VerispecError
from verispec.models import lean, native
from verispec.models.fused import fuse_projections
from verispec.models.hf import HFCausalLM
from verispec.models.quant import quantize_model

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(3)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            **SMALL,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        )
    )  # fmt: skip  (q/k/v biases, one sliding layer)
    mistral = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=5))
    return {"llama": tiny_llama(5), "qwen2": qwen.eval(), "mistral": mistral.eval()}


MODELS = _models()
SCHEMES = ["none", "int8", pytest.param("int4", marks=needs_int4)]


def _pair(family: str, scheme: str, native_layers: bool = True) -> tuple[HFCausalLM, HFCausalLM]:
    """The same weights twice: one run by the lean forward (with the C++ layer operations or
    torch's, ``native_layers``), one by transformers'."""
    model = copy.deepcopy(MODELS[family])
    if scheme != "none":
        model = quantize_model(model, scheme)
        fuse_projections(model)  # as the loader runs it
    else:
        from verispec.models.attention import register

        model.set_attn_implementation(register())
    fast = HFCausalLM(model, name="lean", native_layers=native_layers)
    slow = HFCausalLM(model, name="transformers")
    slow.lean = False
    assert fast.lean
    return fast, slow


def _runs(family: str, scheme: str, native_layers: bool) -> dict[str, list[torch.Tensor]]:
    """Logits and hidden states of both forwards over prompts, batched decode and verify rows and a
    token tree (11 tensors each)."""
    fast, slow = _pair(family, scheme, native_layers)
    prompts = [[(5 * i + 3) % 96 for i in range(23)], [(11 * i + 1) % 96 for i in range(9)]]
    runs = {}
    for lm in (fast, slow):
        caches = [lm.new_cache(), lm.new_cache()]
        prefill = lm.forward_batch(caches, prompts, logits_to_keep=[0, 0], hidden_to_keep=[2, 2]).hidden
        steps = []
        for tokens in ([[4], [9, 10, 11]], [[12, 13], [14]]):  # decode and verify rows, batched
            out = lm.forward_batch(
                caches, tokens, logits_to_keep=[len(t) for t in tokens], return_hidden=True
            )
            steps += out.logits + out.hidden
        # a token tree (root, two children, a grandchild under the first) on row 0
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        start = caches[0].length
        tree = lm.forward_batch(
            caches[:1], [[20, 21, 22, 23]], logits_to_keep=[4],
            positions=[[start, start + 1, start + 1, start + 2]], tree_masks=[mask],
        )  # fmt: skip
        runs[lm.name] = [*prefill, *steps, *tree.logits]
    assert len(runs["lean"]) == len(runs["transformers"]) == 11
    return runs


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", sorted(MODELS))
def test_lean_forward_gives_transformers_bits(family, scheme):
    runs = _runs(family, scheme, native_layers=False)
    for got, want in zip(runs["lean"], runs["transformers"], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", sorted(MODELS))
def test_native_layer_ops_match_transformers_within_rounding(family, scheme):
    runs = _runs(family, scheme, native_layers=True)
    assert native.load(lean.NATIVE_SOURCE) is None  # the C++ operations are there to run
    # Quantized activations turn a last-bit difference into at most a step of their rounding.
    tol = 1e-4 if scheme == "none" else 2e-2
    for got, want in zip(runs["lean"], runs["transformers"], strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        if got.shape[-1] == 96:  # logits
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("scheme", SCHEMES[1:])  # float32 Linears (BLAS) are not batch-invariant
def test_native_layer_ops_keep_a_token_s_bits_whatever_rows_are_beside_it(scheme):
    fast, _ = _pair("qwen2", scheme, native_layers=True)
    prompt = [(7 * i + 2) % 96 for i in range(17)]
    alone_cache = fast.new_cache()
    fast.forward_batch([alone_cache], [prompt], logits_to_keep=[0])
    alone = fast.forward_batch([alone_cache], [[30]], logits_to_keep=[1]).logits[0]
    caches = [fast.new_cache(), fast.new_cache()]
    fast.forward_batch(caches, [prompt, prompt[:9]], logits_to_keep=[0, 0])
    # the same token first in a verify row of four, beside a second sequence's row
    beside = fast.forward_batch(caches, [[30, 31, 32, 33], [40, 41]], logits_to_keep=[4, 2]).logits[0]
    assert torch.equal(beside[:1], alone)


def test_a_failed_layer_ops_build_warns_and_keeps_torch_s_operations(monkeypatch):
    fast, slow = _pair("llama", "none")
    ids = torch.tensor([[(3 * i + 1) % 96 for i in range(12)]])

    def run(lm: HFCausalLM) -> torch.Tensor:
        cache = lm.new_cache()
        lm.forward(ids[:, :8], cache)
        return lm.forward(ids[:, 8:], cache, logits_to_keep=4).logits[0]

    want = run(slow)  # transformers' forward (this also loads the C++ attention, left as it is)
    assert fast.native_layers  # the default: asked for, but the build fails
    fail_build(monkeypatch, lean.NATIVE_SOURCE)
    with pytest.warns(UserWarning, match="layer_ops.cpp failed: no g"):
        got = run(fast)
    assert torch.equal(got, want)  # torch's operations: transformers' bits


def test_other_decoders_keep_transformers_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert not lean.supports(gpt2.transformer)
    gelu = Qwen2ForCausalLM(Qwen2Config(**{**SMALL, "num_hidden_layers": 1}, hidden_act="gelu"))
    assert not lean.supports(gelu.model)  # the MLP's activation is not the one lean computes
    assert lean.supports(MODELS["qwen2"].model)


@pytest.mark.parametrize("native_layers", [False, True], ids=["torch-ops", "native-ops"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_feature_layers_are_the_normed_inputs_of_those_layers(family, native_layers):
    """EAGLE-3's taps: each hidden row gains the normed input of every asked-for layer, the same
    values transformers' forward feeds that layer's attention (caught there by a hook); the logits
    and the last state do not change."""
    fast, slow = _pair(family, "none", native_layers)
    prompts = [[(5 * i + 3) % 96 for i in range(13)], [(11 * i + 1) % 96 for i in range(6)]]
    outs = {}
    for lm in (fast, slow):
        for layers in ((), (1, 0)):
            caches = [lm.new_cache(), lm.new_cache()]
            outs[lm.name, layers] = lm.forward_batch(
                caches, prompts, logits_to_keep=[3, 2], return_hidden=True, feature_layers=layers
            )
    tol = 1e-5 if native_layers else 0.0
    for name in ("lean", "transformers"):
        plain, tapped = outs[name, ()], outs[name, (1, 0)]
        for row in range(2):
            assert tapped.hidden[row].shape == (plain.hidden[row].shape[0], 3 * 64)
            assert torch.equal(tapped.hidden[row][:, :64], plain.hidden[row])
            assert torch.equal(tapped.logits[row], plain.logits[row])
            torch.testing.assert_close(
                tapped.hidden[row], outs["transformers", (1, 0)].hidden[row], rtol=tol, atol=tol
            )
    # layer 0's input norm reads the embeddings: check one tap against it directly
    embeds = slow.decoder.embed_tokens(torch.tensor(prompts[1][-2:]))
    want = slow.decoder.layers[0].input_layernorm(embeds)
    torch.testing.assert_close(outs["lean", (1, 0)].hidden[1][:, 128:], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(VerispecError, match=r"decoder layers 0\.\.1"):
        fast.forward_batch([fast.new_cache()], [[1, 2]], logits_to_keep=[1], feature_layers=(2,))


@pytest.mark.parametrize("native_layers", [False, True], ids=["torch-ops", "native-ops"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_raw_features_are_the_residual_stream_transformers_reports(family, native_layers):
    """EAGLE-3 drafters in the ecosystem's format read the layers' inputs before their norm, as
    transformers' ``output_hidden_states[i]`` gives them: lean (both operation sets) and
    transformers' own forward must hand over those values."""
    fast, slow = _pair(family, "none", native_layers)
    prompt = [(7 * i + 2) % 96 for i in range(5)]  # inside the sliding windows: one attention rule
    with torch.no_grad():  # (transformers' SDPA here: the same values up to rounding)
        states = slow.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[1][0], states[0][0]], dim=-1)  # layers (1, 0), in that order
    for lm in (fast, slow):
        out = lm.forward_batch(
            [lm.new_cache()],
            [prompt],
            logits_to_keep=[5],
            return_hidden=True,
            feature_layers=(1, 0),
            raw_features=True,
        )
        torch.testing.assert_close(out.hidden[0][:, 64:], want, rtol=1e-5, atol=1e-6)
