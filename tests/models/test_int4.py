"""The int4 fast path: the kernel against its reference, exact batch invariance, the packing, and
lossless speculation on top of it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import tiny_llama
from tests.models.test_quant import (
    AMX_MODES,
    assert_scores_alone_as_beside_drafts,
    assert_speculation_is_lossless,
    assert_weights_are_cached_and_reused,
    kernels,
)
from tests.test_engine import PROMPTS
from verispec.errors import VerispecError
from verispec.models import int4
from verispec.models.hf import HFCausalLM
from verispec.models.int4 import (
    GROUP,
    Int4Linear,
    dequantize,
    from_amx_layout,
    quantize_weight,
    to_amx_layout,
)
from verispec.models.quant import RowwiseInt8Linear, quantize_model, resolve_quantization

pytestmark = pytest.mark.skipif(
    not int4.cpu_supports_int4(), reason="the int4 kernel needs AVX2 or AVX-512 VNNI, which this CPU lacks"
)


LONG_PROMPT = [(7 * i + 3) % 97 for i in range(40)]


def _linear(n: int, k: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


KERNELS = ["decode", "many-row"] + (["amx"] if int4.amx_available() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    ("n", "k", "bias"),
    [(48, 64, True), (130, 576, False), (8, 300, True), (256, 1536, True), (37, 100, True)],
)
@pytest.mark.parametrize("rows", [3, 13, 40])
def test_kernel_matches_its_dequantized_weights(n, k, bias, kernel, rows):
    """Padding of inputs (to a whole group) and channels (to 4, and to the many-row kernel's tiles
    of 32 or AMX's of 16) is invisible; the only error left beside the weights' own is the 8-bit
    rounding of each activation row. 3, 13 and 40 rows: AMX's VNNI rows, one tile, three tiles."""
    linear = _linear(n, k, seed=n + k, bias=bias)
    q = Int4Linear.from_linear(linear, amx=kernel == "amx")
    x = torch.randn(rows, k)
    with int4.prompt_rows() if kernel == "many-row" else contextlib.nullcontext():
        got = q(x)
    assert got.shape == (rows, n)
    weight = dequantize(*q.parts(), (n, k))
    want = x @ weight.T + (linear.bias if bias else 0)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.02
    # And the 4-bit weights themselves are close to the float ones.
    assert ((weight - linear.weight).norm() / linear.weight.norm()) < 0.1


@pytest.mark.parametrize("amx", AMX_MODES)
def test_kernel_is_batch_invariant_to_the_bit(restore_torch_threads, amx):
    """A row's output is the same alone, in any prefix, at any position and at any thread count
    (on AMX: through VNNI products up to 5 rows, one tile of 16, a pass of two tiles (17-32 rows),
    or passes of 32 over tiles unpacked once, with a tail of 1-16 rows)."""
    q = Int4Linear.from_linear(_linear(100, 200, seed=1), amx=amx)
    total = 75
    rows = torch.randn(total, 200) * torch.logspace(-3, 3, total)[:, None]  # wildly different magnitudes
    together = q(rows)
    for m in range(1, total + 1):
        assert torch.equal(q(rows[:m]), together[:m])
        assert torch.equal(q(rows[-m:]), together[-m:])
    assert torch.equal(torch.cat([q(rows[i : i + 1]) for i in range(total)]), together)
    assert torch.equal(q(rows.flip(0)), together.flip(0))
    assert torch.equal(q(rows.view(1, total, 200))[0], together)
    torch.set_num_threads(1)  # the fixture gives the session its thread count back
    assert torch.equal(q(rows), together)


def test_many_row_kernel_keeps_rows_independent_and_close_to_the_decode_kernel(restore_torch_threads):
    """Prompt rows: each row's output is the same alone or among others (to the bit, any count,
    any position, any thread count), and within float rounding of the decode kernel's (AVX-512:
    a second kernel) or equal to it (AVX2: prompt rows take the decode kernel)."""
    q = Int4Linear.from_linear(_linear(70, 1000, seed=2), amx=False)
    rows = torch.randn(29, 1000) * torch.logspace(-2, 2, 29)[:, None]
    decode = q(rows)
    with int4.prompt_rows():
        together = q(rows)
        for m in (1, 5, 6, 7, 12, 13, 28):  # around the kernel's 6-row blocks
            assert torch.equal(q(rows[:m]), together[:m])
            assert torch.equal(q(rows[-m:]), together[-m:])
        assert torch.equal(q(rows.flip(0)), together.flip(0))
    if int4.kernel_isa() == "avx512-vnni":
        assert not torch.equal(together, decode)  # really the other kernel
    else:
        assert torch.equal(together, decode)
    assert ((together - decode).norm(dim=-1) / decode.norm(dim=-1)).max() < 1e-5
    assert torch.equal(q(rows), decode)  # and the block's end restores the decode kernel
    torch.set_num_threads(1)  # the fixture gives the session its thread count back
    with int4.prompt_rows():
        assert torch.equal(q(rows), together)


@pytest.mark.skipif(not int4.amx_available(), reason="the AMX kernels need a CPU with AMX-INT8")
def test_amx_runs_prompt_rows_as_decode_rows_and_close_to_the_vnni_kernel():
    """On AMX one kernel takes every row (so prompt rows need no kernel of their own), and it differs
    from the VNNI kernel only by float rounding (same codes, other order of additions)."""
    linear = _linear(70, 1000, seed=3)
    amx, vnni = (Int4Linear.from_linear(linear, amx=a) for a in (True, False))
    rows = torch.randn(29, 1000)
    decode = amx(rows)
    with int4.prompt_rows():
        assert torch.equal(amx(rows), decode)
    want = vnni(rows)
    assert ((decode - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-5


@pytest.mark.parametrize(("n", "k"), [(48, 64), (130, 576), (37, 100), (4, 1536)])
def test_the_amx_layout_holds_the_same_codes(n, k):
    """to_amx_layout and from_amx_layout are inverses (fusion reads a layer's parts back), padding
    the channels to AMX's 16 with zeros."""
    parts = quantize_weight(_linear(n, k, seed=k).weight)
    packed, scales, offsets = to_amx_layout(*parts)
    assert packed.shape[0] == scales.shape[0] == -(-n // 16)
    for got, want in zip(from_amx_layout(packed, scales, offsets, n), parts, strict=True):
        assert torch.equal(got, want)


def test_the_fitted_scales_never_lose_to_plain_rounding_and_clip_outliers():
    groups = 4
    weight = torch.randn(12, groups * GROUP)
    weight[0, 0] = 40.0  # one outlier: clipping it costs less than coarse steps for the rest
    packed, scales, offsets = quantize_weight(weight)
    err = (
        ((dequantize(packed, scales, offsets, tuple(weight.shape)) - weight) ** 2)
        .view(12, groups, GROUP)
        .sum(-1)
    )
    grouped = weight.view(12, groups, GROUP)
    lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    plain = ((((grouped - lo) / step).round() * step + lo - grouped) ** 2).sum(-1)  # min-max rounding
    assert (err <= plain * 1.01).all()  # 1%: the float16 rounding of the fitted scale and offset
    chosen_steps = scales.view(3, groups, 4).transpose(1, 2).reshape(12, groups).float()
    assert chosen_steps[0, 0] < step[0, 0, 0] and err[0, 0] < plain[0, 0]


@contextlib.contextmanager
def lm_head(kind: str) -> Iterator[None]:
    """Models converted inside this block get an int4 or int8 LM head, whatever the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(int4.HEAD_ENV, "1" if kind == "int4" else "0")
        yield


HEADS = ("int4", "int8")


@pytest.fixture(
    scope="module",
    params=[pytest.param((m.values[0], h), id=f"{m.id}-{h}-head") for m in AMX_MODES for h in HEADS],
)
def float_and_int4(request) -> tuple[HFCausalLM, HFCausalLM]:
    """Both LM heads the int4 path can have (the CPU picks one, ``VERISPEC_INT4_LM_HEAD`` either)."""
    amx, head = request.param
    model = tiny_llama(0)
    with kernels(amx), lm_head(head):
        quantized = quantize_model(copy.deepcopy(model), "int4")
    assert all(m.amx == amx for m in quantized.modules() if isinstance(m, Int4Linear))
    lm = HFCausalLM(quantized, name="int4")
    assert isinstance(lm.lm_head, Int4Linear if head == "int4" else RowwiseInt8Linear)
    return HFCausalLM(model, name="fp32"), lm


def test_every_linear_but_perhaps_the_head_is_int4(float_and_int4):
    _, q4 = float_and_int4
    linears = [m for m in q4.model.modules() if isinstance(m, Int4Linear | RowwiseInt8Linear)]
    int8 = [m for m in linears if isinstance(m, RowwiseInt8Linear)]
    assert int8 == ([q4.lm_head] if isinstance(q4.lm_head, RowwiseInt8Linear) else [])
    assert not any(type(m) is torch.nn.Linear for m in q4.model.modules())


def test_the_lm_head_is_int4_on_the_avx2_kernel_unless_chosen(monkeypatch):
    monkeypatch.delenv(int4.HEAD_ENV, raising=False)
    assert int4.int4_lm_head() == (int4.kernel_isa() == "avx2")
    monkeypatch.setattr(int4, "kernel_isa", lambda: "avx2")
    assert int4.int4_lm_head()
    monkeypatch.setattr(int4, "kernel_isa", lambda: "avx512-vnni")
    assert not int4.int4_lm_head()
    monkeypatch.setenv(int4.HEAD_ENV, "1")
    assert int4.int4_lm_head()
    monkeypatch.setenv(int4.HEAD_ENV, "0")
    assert not int4.int4_lm_head()
    monkeypatch.setenv(int4.HEAD_ENV, "yes")
    with pytest.raises(VerispecError, match="VERISPEC_INT4_LM_HEAD must be 0 or 1"):
        int4.int4_lm_head()


@pytest.mark.parametrize("amx", AMX_MODES)
def test_rows_of_an_int4_layer_give_its_outputs_to_the_bit(amx):
    """A draft vocabulary's head cut from an int4 LM head scores its tokens as the target does."""
    with kernels(amx):
        layer = Int4Linear.from_linear(_linear(70, 100, seed=3))
    ids = torch.tensor([5, 0, 69, 31, 2])  # 5 rows: the cut layer pads its channels to a block
    cut = layer.rows(ids)
    assert cut.out_features == 5 and cut.amx == amx
    for n in (1, 7):
        x = torch.randn(n, 100)
        assert torch.equal(cut(x), layer(x)[:, ids])
    torch.testing.assert_close(cut.dequantized(), layer.dequantized()[ids])


def test_a_cached_conversion_gains_the_other_lm_head(tmp_path, monkeypatch):
    """Switching heads converts only the head, adds it to the cache, and keeps the other one."""
    from safetensors import safe_open

    cache_file = tmp_path / "tiny.safetensors"
    with lm_head("int8"):
        quantize_model(tiny_llama(0), "int4", cache_file)
    with lm_head("int4"):
        fresh = HFCausalLM(quantize_model(tiny_llama(0), "int4", cache_file), name="fresh")
    with safe_open(cache_file, "pt") as f:
        keys = set(f.keys())
    assert {"lm_head.int8", "lm_head.int4", "model.layers.0.mlp.down_proj.int4"} <= keys
    monkeypatch.setattr(int4, "quantize_weight", lambda weight: pytest.fail("converted again"))
    with lm_head("int4"):
        cached = HFCausalLM(quantize_model(tiny_llama(0), "int4", cache_file), name="cached")
    with lm_head("int8"):
        assert isinstance(quantize_model(tiny_llama(0), "int4", cache_file).lm_head, RowwiseInt8Linear)
    ids = torch.tensor([PROMPTS[0]])
    assert isinstance(cached.lm_head, Int4Linear)
    assert torch.equal(
        fresh.forward(ids, fresh.new_cache()).logits, cached.forward(ids, cached.new_cache()).logits
    )


def test_int4_logits_stay_close_to_float32(float_and_int4):
    fp32, q4 = float_and_int4
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    want = fp32.forward(ids, fp32.new_cache(), logits_to_keep=0).logits[0]
    got = q4.forward(ids, q4.new_cache(), logits_to_keep=0).logits[0]
    assert (want.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.8
    assert torch.nn.functional.cosine_similarity(want, got, dim=-1).min() > 0.95


def test_int4_model_scores_a_token_identically_alone_or_beside_drafts(float_and_int4):
    assert_scores_alone_as_beside_drafts(float_and_int4[1])


def test_speculation_is_lossless_on_the_int4_path(float_and_int4):
    """int4 target with a float32 draft: greedy speculative output equals the int4 target's own."""
    assert_speculation_is_lossless(*float_and_int4)


def test_only_passes_that_keep_no_logits_take_the_many_row_kernel(float_and_int4, monkeypatch):
    """Prefill (no logits kept) runs the many-row kernel; decode and verify rows never do (on AMX
    the flag is set the same way, and one kernel takes both)."""
    _, q4 = float_and_int4
    seen: list[bool] = []
    forward = Int4Linear.forward

    def spy(self: Int4Linear, x: torch.Tensor) -> torch.Tensor:
        seen.append(int4._PROMPT_ROWS.get())
        return forward(self, x)

    monkeypatch.setattr(Int4Linear, "forward", spy)
    cache = q4.new_cache()
    q4.forward_batch([cache], [LONG_PROMPT[:-1]], logits_to_keep=[0])
    assert seen and all(seen)
    seen.clear()
    q4.forward_batch([cache], [[*LONG_PROMPT[-1:], 7, 8]], logits_to_keep=[3])
    assert seen and not any(seen)


def test_a_prompt_prefills_the_same_alone_or_beside_another(float_and_int4):
    """The engine batches prefills of different requests; a prompt's next-token scores must not
    depend on its neighbours (to the bit: the decode steps after it compare plain and speculative)."""
    _, q4 = float_and_int4
    other = [9, 4] * 30
    alone = q4.new_cache()
    q4.forward_batch([alone], [LONG_PROMPT[:-1]], logits_to_keep=[0])
    pair = [q4.new_cache(), q4.new_cache()]
    q4.forward_batch(pair, [other, LONG_PROMPT[:-1]], logits_to_keep=[0, 0])
    want = q4.forward_batch([alone], [LONG_PROMPT[-1:]], logits_to_keep=[1]).logits[0]
    got = q4.forward_batch([pair[1]], [LONG_PROMPT[-1:]], logits_to_keep=[1]).logits[0]
    assert torch.equal(got, want)


def test_speculation_is_lossless_on_the_int4_path_after_a_long_prompt(float_and_int4):
    """A prompt longer than any decode row (so prefill takes the many-row kernel and SDPA)."""
    assert_speculation_is_lossless(*float_and_int4, prompts=[LONG_PROMPT])


def test_int4_weights_are_cached_and_reused(tmp_path):
    assert_weights_are_cached_and_reused(tmp_path, "int4")


def test_int4_where_it_cannot_run_is_a_clear_error(monkeypatch):
    with pytest.raises(VerispecError, match="int4"):
        resolve_quantization("int4", "cuda", "float32")
    monkeypatch.setattr(int4, "cpu_supports_int4", lambda: False)
    with pytest.raises(VerispecError, match="AVX-512 VNNI"):
        Int4Linear.from_linear(_linear(8, 128, seed=0))
    monkeypatch.setattr(int4, "cpu_supports_int4", lambda: True)
    monkeypatch.setattr(int4.native, "load", lambda source: f"building {source} failed: no g++")
    with pytest.raises(VerispecError, match=r"int4_linear\.cpp failed: no g\+\+; use int8"):
        Int4Linear.from_linear(_linear(8, 128, seed=0))
