"""The int8 fast path: conversion, closeness to float32, and lossless speculation on top of it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_llama
from tests.test_engine import PROMPTS, make_engine
from verispec.errors import VerispecError
from verispec.models import int4
from verispec.models.hf import HFCausalLM
from verispec.models.quant import (
    RowwiseInt8Linear,
    quantize_int8_dynamic,
    quantize_model,
    resolve_quantization,
)

AMX_MODES = [pytest.param(False, id="vnni")] + (
    [pytest.param(True, id="amx")] if int4.amx_available() else []
)
"""The kernels a CPU runs: fbgemm / VNNI everywhere, and verispec's AMX kernels where the CPU has AMX
(then both are tested, as ``VERISPEC_INT4_AMX=0`` can choose either)."""


@contextlib.contextmanager
def kernels(amx: bool) -> Iterator[None]:
    """Layers made inside this block run the AMX kernels (``amx``) or the others."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(int4.AMX_ENV, "1" if amx else "0")
        yield


@pytest.fixture(scope="module", params=AMX_MODES)
def float_and_int8(request) -> tuple[HFCausalLM, HFCausalLM]:
    model = tiny_llama(0)
    with kernels(request.param):
        quantized = quantize_int8_dynamic(copy.deepcopy(model))
    assert quantized.lm_head.amx == request.param
    return HFCausalLM(model, name="fp32"), HFCausalLM(quantized, name="int8")


def test_every_linear_is_quantized_and_the_head_keeps_its_width(float_and_int8):
    fp32, int8 = float_and_int8
    assert not any(type(m) is torch.nn.Linear for m in int8.model.modules())
    assert isinstance(int8.lm_head, RowwiseInt8Linear)
    assert int8.vocab_size == fp32.vocab_size


def test_int8_logits_stay_close_to_float32(float_and_int8):
    fp32, int8 = float_and_int8
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    want = fp32.forward(ids, fp32.new_cache(), logits_to_keep=0).logits[0]
    got = int8.forward(ids, int8.new_cache(), logits_to_keep=0).logits[0]
    agreement = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
    assert torch.nn.functional.cosine_similarity(want, got, dim=-1).min() > 0.98


def test_speculation_is_lossless_on_the_int8_path(float_and_int8):
    """int8 target with a float32 draft: greedy speculative output equals the int8 target's own."""
    assert_speculation_is_lossless(*float_and_int8)


def assert_speculation_is_lossless(
    fp32: HFCausalLM, quantized: HFCausalLM, prompts: list[list[int]] = PROMPTS
) -> None:
    """Greedy speculation with ``fp32`` drafting for ``quantized`` equals ``quantized``'s own output."""
    plain = make_engine(quantized, None, None)
    spec = make_engine(quantized, fp32, "draft", k=4)
    accepted = 0
    for prompt in prompts:
        got = spec.generate(prompt, max_new_tokens=30)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=30).token_ids
        accepted += got.stats.num_accepted
    assert accepted > 0


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "expected"),
    [
        ("auto", "cpu", "float32", "int8"),
        ("auto", "cuda", "float32", "none"),
        ("auto", "cpu", "bfloat16", "none"),
        ("none", "cpu", "float32", "none"),
        ("int8", "cpu", "float32", "int8"),
    ],
)
def test_resolve_quantization(requested, device, dtype, expected):
    assert resolve_quantization(requested, device, dtype) == expected


@pytest.mark.parametrize(("device", "dtype"), [("cuda", "float32"), ("cpu", "bfloat16")])
def test_int8_where_it_cannot_run_is_a_clear_error(device, dtype):
    with pytest.raises(VerispecError, match="int8"):
        resolve_quantization("int8", device, dtype)


@pytest.mark.parametrize("amx", AMX_MODES)
def test_rowwise_int8_linear_is_batch_invariant_to_the_bit(amx):
    """A token's output must not depend on the tokens verified beside it (else greedy drifts); 70
    rows: on AMX one tile of 16 rows, a pass of two (17-32), passes of 32 with a tail."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(100, 70)
    quantized = RowwiseInt8Linear(*RowwiseInt8Linear.quantize_weight(linear), linear.bias, amx=amx)
    rows = torch.randn(70, 100) * torch.logspace(-3, 3, 70)[:, None]  # wildly different magnitudes
    together = quantized(rows)
    alone = torch.cat([quantized(rows[i : i + 1]) for i in range(70)])
    assert torch.equal(together, alone)
    for m in (5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65):
        assert torch.equal(quantized(rows[-m:]), together[-m:])
    reference = linear(rows)
    assert ((together - reference).norm(dim=-1) / reference.norm(dim=-1)).max() < 0.05


@pytest.mark.parametrize("amx", AMX_MODES)
def test_rowwise_int8_linear_gives_its_int8_weights_back(amx):
    """Fusion and the heads' vocabulary read the int8 weights back, whichever kernel holds them."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(130, 37)  # neither a multiple of the AMX tile's 16 channels nor of 64 inputs
    weight, scales = RowwiseInt8Linear.quantize_weight(linear)
    got_weight, got_scales = RowwiseInt8Linear(weight, scales, None, amx=amx).int8_parts()
    assert torch.equal(got_weight, weight) and torch.equal(got_scales, scales)


@pytest.mark.skipif(not int4.amx_available(), reason="the AMX kernels need a CPU with AMX-INT8")
def test_the_amx_int8_kernel_is_as_close_to_float32_as_fbgemm():
    torch.manual_seed(2)
    linear = torch.nn.Linear(1536, 1000)
    parts = RowwiseInt8Linear.quantize_weight(linear)
    x = torch.randn(8, 1536)
    want = linear(x)
    errors = [
        ((RowwiseInt8Linear(*parts, linear.bias, amx=amx)(x) - want).norm(dim=-1) / want.norm(dim=-1)).max()
        for amx in (False, True)
    ]
    assert errors[1] < 0.02 and errors[1] < 1.2 * errors[0]


def test_int8_model_scores_a_token_identically_alone_or_beside_drafts(float_and_int8):
    assert_scores_alone_as_beside_drafts(float_and_int8[1])


def assert_scores_alone_as_beside_drafts(model: HFCausalLM) -> None:
    """The quantized model is batch-invariant to the bit in decode and verify steps (the engine
    prefills every prompt but its last token in one identical call, with or without speculation)."""
    prompt = [i % 90 + 3 for i in range(137)]  # long enough for stock attention to change block sizes

    def after_prefill(step: list[int]) -> torch.Tensor:
        cache = model.new_cache()
        model.forward(torch.tensor([prompt[:-1]]), cache)
        return model.forward(torch.tensor([step]), cache, logits_to_keep=len(step)).logits[0]

    alone = after_prefill([prompt[-1]])[0]
    assert torch.equal(alone, after_prefill([prompt[-1], 5, 6, 7])[0])
    assert torch.equal(alone, after_prefill([prompt[-1], *range(10, 40)])[0])
    # And tokens verified at depth 1 and 2 score as they do when decoded one by one.
    cache = model.new_cache()
    model.forward(torch.tensor([prompt[:-1]]), cache)
    decoded = [model.forward(torch.tensor([[t]]), cache).logits[0, -1] for t in (prompt[-1], 5, 6)]
    verified = after_prefill([prompt[-1], 5, 6, 7])
    for depth in range(3):
        assert torch.equal(decoded[depth], verified[depth])


def test_int8_weights_are_cached_and_reused(tmp_path):
    assert_weights_are_cached_and_reused(tmp_path, "int8")


def assert_weights_are_cached_and_reused(tmp_path: Path, scheme: str) -> None:
    """The second start reads the cache and never the float weights (zeroed here to prove it)."""
    cache_file = tmp_path / scheme / "tiny.safetensors"
    first = HFCausalLM(quantize_model(tiny_llama(0), scheme, cache_file), name="first")
    assert cache_file.is_file()
    model = tiny_llama(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.zero_()
    second = HFCausalLM(quantize_model(model, scheme, cache_file), name="second")
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(
        first.forward(ids, first.new_cache()).logits, second.forward(ids, second.new_cache()).logits
    )
