"""GGUF blocks run as they are: the weights the kernel multiplies by are gguf's own de-quantization
of the same blocks (per type, to the bit), its products match a float64 reference of the same
quantized activations, and each row's result is bit-identical alone or in a batch."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, quants
from gguf import GGMLQuantizationType as Q

from verispec.errors import VerispecError
from verispec.models import gguf_linear as gl
from verispec.models import native
from verispec.models.registry import BUNDLED, ensure_gguf

TYPES = sorted(gl.KERNEL_TYPES, key=lambda t: t.name)

pytestmark = pytest.mark.skipif(
    gl.kernel_error() is not None, reason="the GGUF kernel could not be built here"
)


def random_blocks(qtype: Q, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random codes with sane float16 scales: [rows, row_bytes] as GGUFReader gives a tensor."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = rows * (k // per_block)
    b = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)

    def f16(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, n).astype(np.float16).view(np.uint8).reshape(n, 2)

    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_1, Q.Q5_1):
        b[:, 0:2] = f16(1e-3, 1e-2)
    if qtype in (Q.Q4_1, Q.Q5_1):
        b[:, 2:4] = f16(-5e-2, 0.0)
    if qtype in (Q.Q4_K, Q.Q5_K):
        b[:, 0:2], b[:, 2:4] = f16(1e-4, 1e-3), f16(1e-4, 1e-3)
    if qtype == Q.Q6_K:
        b[:, 208:210] = f16(1e-4, 1e-3)
    if qtype == Q.Q3_K:
        b[:, 108:110] = f16(1e-4, 1e-3)
    return b.reshape(rows, -1)


def reference(x: torch.Tensor, w: np.ndarray, unit: int) -> torch.Tensor:
    """x @ w.T in float64 after the kernel's activation quantization (per row and unit of inputs,
    round(x * 127 / max|x|) in float32, half to even)."""
    xf = x.numpy().astype(np.float32)
    m, k = xf.shape
    xu = xf.reshape(m, k // unit, unit)
    amax = np.abs(xu).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(xu * inv), -127, 127)
    deq = (codes * (amax / np.float32(127)).astype(np.float64)).reshape(m, k)
    return torch.from_numpy(deq @ w.astype(np.float64).T)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_weights_multiplied_by_are_ggufs_own_dequantization(qtype: Q) -> None:
    rows, k = 37, 512
    blocks = random_blocks(qtype, rows, k)
    expected = quants.dequantize(blocks, qtype).reshape(rows, k)
    codes, factors = gl.unpack_blocks(qtype, blocks)
    assert np.array_equal(gl.dequantize_factors(qtype, codes, factors), expected)
    layer = gl.GGUFLinear(qtype, blocks, (rows, k))
    assert np.array_equal(layer.dequantized().numpy(), expected)  # read back from the kernel's arrays


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_a_float64_reference_of_the_quantized_activations(qtype: Q) -> None:
    rows, k = 45, 768
    blocks = random_blocks(qtype, rows, k, seed=1)
    bias = torch.randn(rows)
    layer = gl.GGUFLinear(qtype, blocks, (rows, k), bias)
    x = torch.randn(6, k) * torch.linspace(0.1, 3.0, k)  # uneven ranges across units
    unit = 256 if qtype in (Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    expected = reference(x, quants.dequantize(blocks, qtype).reshape(rows, k), unit) + bias.double()
    got = layer(x).double()
    assert got.shape == (6, rows)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    # Against the float input (not its quantization) it is close, as a sanity bound on the scales.
    exact = x.double() @ torch.from_numpy(quants.dequantize(blocks, qtype).reshape(rows, k)).double().T
    assert (got - bias.double() - exact).abs().max() <= 0.05 * exact.abs().max()


# Bytes of each "k" block that hold codes and group scales (not its float16 super-block scales).
_K_FIELDS = {Q.Q3_K: slice(0, 108), Q.Q4_K: slice(4, 144), Q.Q5_K: slice(4, 176), Q.Q6_K: slice(0, 208)}


@pytest.mark.parametrize("qtype", sorted(_K_FIELDS, key=lambda t: t.name), ids=lambda t: t.name)
def test_the_largest_codes_and_scales_do_not_overflow_the_integer_sums(qtype: Q) -> None:
    """ "k" types sum a whole super-block in int32 before one float conversion: with every code and
    group scale at its largest magnitude and every activation at +-127, the products still match."""
    rows, k = 20, 512
    # Q6_K's codes also at 0: its AVX-512 tile multiplies c - 32, largest in magnitude there
    for codes in (0xFF, 0x00) if qtype == Q.Q6_K else (0xFF,):
        blocks = random_blocks(qtype, rows, k, seed=5).reshape(rows * 2, -1)
        blocks[:, _K_FIELDS[qtype]] = 0xFF  # codes and 6-bit scales and mins at their maximum
        if qtype == Q.Q6_K:
            blocks[:, 0:192] = codes
            blocks[:, 192:208] = 0x80  # int8 group scales at -128
        blocks = blocks.reshape(rows, -1)
        layer = gl.GGUFLinear(qtype, blocks, (rows, k))
        x = torch.ones(3, k) * torch.tensor([[1.0], [-1.0], [0.5]])  # every activation code +-127
        expected = reference(x, quants.dequantize(blocks, qtype).reshape(rows, k), 256)
        got = layer(x).double()
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_a_row_scores_bit_identically_alone_and_in_any_batch(qtype: Q) -> None:
    rows, k = 50, 512
    layer = gl.GGUFLinear(qtype, random_blocks(qtype, rows, k, seed=2), (rows, k), torch.randn(rows))
    x = torch.randn(19, k)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for count in (2, 7, 8, 9, 16, 19):  # below, at and past the kernel's row block of 8
        assert torch.equal(layer(x[:count]), alone[:count])
    assert torch.equal(layer(x[5:14]), alone[5:14])  # wherever the row sits
    assert torch.equal(layer(x.view(1, 19, k)).view(19, rows), alone)  # leading dimensions kept


def test_unsupported_types_and_shapes_are_refused_by_name() -> None:
    blocks = np.zeros((4, GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8)
    with pytest.raises(VerispecError, match="Q2_K"):
        gl.GGUFLinear(Q.Q2_K, blocks, (4, 256))
    with pytest.raises(VerispecError, match=r"blk\.3\.ffn_up\.weight is stored as IQ4_XS"):
        gl.check_type(Q.IQ4_XS, "blk.3.ffn_up.weight")
    with pytest.raises(VerispecError, match="rows of blocks"):
        gl.GGUFLinear(Q.Q8_0, random_blocks(Q.Q8_0, 3, 64), (4, 64))


def test_no_rows_give_an_empty_result() -> None:
    layer = gl.GGUFLinear(Q.Q4_0, random_blocks(Q.Q4_0, 5, 64), (5, 64))
    assert layer(torch.empty(0, 64)).shape == (0, 5)


def test_a_real_files_tensors_unpack_exactly() -> None:
    """SmolLM2's file: Q4_1 layers and a Q8_0 embedding, as a real quantizer wrote them."""
    reader = GGUFReader(ensure_gguf(BUNDLED["smollm2-135m-instruct"]))
    seen = set()
    for tensor in reader.tensors:
        if tensor.tensor_type in seen or tensor.tensor_type not in gl.KERNEL_TYPES:
            continue
        seen.add(tensor.tensor_type)
        data = np.array(tensor.data[:64])  # 64 output rows are enough to see every field
        k = int(tensor.shape[0])
        layer = gl.GGUFLinear(tensor.tensor_type, data, (64, k))
        assert np.array_equal(
            layer.dequantized().numpy(), quants.dequantize(data, tensor.tensor_type).reshape(64, k)
        )
    assert seen == {Q.Q4_1, Q.Q8_0}


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_rows_cut_a_layer_to_some_channels_bit_identically(qtype: Q) -> None:
    rows, k = 70, 512
    layer = gl.GGUFLinear(qtype, random_blocks(qtype, rows, k, seed=3), (rows, k), torch.randn(rows))
    ids = torch.tensor([69, 0, 17, 16, 33, 5, 48])
    cut = layer.rows(ids)
    x = torch.randn(3, k)
    assert torch.equal(cut(x), layer(x)[:, ids])
    assert torch.equal(cut.dequantized(), layer.dequantized()[ids])


def test_one_layer_over_several_tensors_gives_the_separate_layers_outputs() -> None:
    """The loader's fused q/k/v and gate/up: one layer packed from the members' blocks, rows one
    after another (a member whose rows end inside a tile, as v's 20 here, does not shift the next),
    gives each member's outputs to the bit."""
    k = 512
    sizes = (64, 20, 32)
    blocks = [random_blocks(Q.Q4_K, n, k, seed=n) for n in sizes]
    biases = [torch.randn(n) for n in sizes]
    fused = gl.GGUFLinear(Q.Q4_K, blocks, (sum(sizes), k), torch.cat(biases))
    apart = [gl.GGUFLinear(Q.Q4_K, b, (n, k), bias) for b, n, bias in zip(blocks, sizes, biases, strict=True)]
    x = torch.randn(4, k)
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in apart], dim=-1))


_INSIDE = "VERISPEC_TEST_OTHER_GGUF_BUILD"
_OTHER_BUILD = """
import sys
from verispec.models import native
native.cpu_isa = lambda: {isa!r}  # build and load the kernel as on a CPU with only this
native.cpu_has_gfni = lambda: False
if not {avx_vnni!r}:
    native.cpu_has_avx_vnni = lambda: False
import pytest
checks = "products_match or bit_identically or real_file or overflow"
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-k", checks, {path!r}]))
"""


@pytest.mark.parametrize(
    ("isa", "avx_vnni"),
    [("avx512-vnni", False), ("avx2", True), ("avx2", False), (None, False)],
    ids=["avx512-no-gfni", "avx2-avx-vnni", "avx2", "scalar"],
)
def test_the_avx2_and_portable_builds_pass_the_same_checks(isa: str | None, avx_vnni: bool) -> None:
    """The AVX2 builds (with AVX-VNNI and without) and the portable one, compiled here as a CPU
    without AVX-512 (or without AVX2) would compile them, and the AVX-512 build without GFNI (Q6_K and
    Q3_K codes unpacked by shifts and a subtraction) pass the same checks: each build is its own
    consistent arithmetic."""
    import subprocess
    import sys

    if os.environ.get(_INSIDE):
        pytest.skip("already inside another build's run")
    if isa is not None and native.cpu_isa() is None:
        pytest.skip("this CPU cannot run the AVX2 build")
    if isa == "avx512-vnni" and not native.cpu_has_gfni():
        pytest.skip("this CPU has no GFNI, or no AVX-512: the suite's own build covers it")
    if avx_vnni and "avx_vnni" not in native._cpuinfo_words():
        pytest.skip("this CPU has no AVX-VNNI")
    script = _OTHER_BUILD.format(isa=isa, avx_vnni=avx_vnni, path=__file__)
    env = {**os.environ, _INSIDE: "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout


def assert_same_parts(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_packer_lays_blocks_out_as_the_reference_does(qtype: Q) -> None:
    for rows, k, seed in ((37, 512, 0), (16, 256, 1), (1, 1024, 2)):  # padded tiles, whole ones, one row
        blocks = random_blocks(qtype, rows, k, seed=seed)
        assert_same_parts(gl.pack_blocks(qtype, blocks, k), gl.pack_reference(qtype, blocks))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_several_tensors_pack_as_their_rows_one_after_another_in_any_order(qtype: Q) -> None:
    """A fused q/k/v: the members' rows (llama.cpp's q/k permutation undone by ``order``) packed
    into one layout are the reference's layout of those rows, concatenated and reordered."""
    members = [random_blocks(qtype, rows, 512, seed=rows) for rows in (24, 8, 13)]
    joint = np.concatenate(members)
    order = np.random.default_rng(0).permutation(len(joint))
    assert_same_parts(gl.pack_blocks(qtype, members, 512), gl.pack_reference(qtype, joint))
    assert_same_parts(gl.pack_blocks(qtype, members, 512, order), gl.pack_reference(qtype, joint[order]))
    with pytest.raises(RuntimeError, match="out of range"):
        gl.pack_blocks(qtype, members, 512, np.array([0, len(joint)]))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K], ids=lambda t: t.name)
def test_scales_float16_cannot_hold_are_refused_by_both_packers(qtype: Q) -> None:
    blocks = random_blocks(qtype, 3, 256)
    # Q4_0's offset -8 d and Q6_K's M = 32 d overflow float16
    huge = np.array([60000.0], dtype=np.float16).view(np.uint8)
    at = 208 if qtype == Q.Q6_K else 0
    blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])[1, at : at + 2] = huge
    for packer in (lambda: gl.pack_blocks(qtype, blocks, 256), lambda: gl.pack_reference(qtype, blocks)):
        with pytest.raises(VerispecError, match="do not fit float16 exactly"):
            packer()


def test_large_layers_are_packed_a_slice_of_rows_at_a_time() -> None:
    rows, k = gl._PACK_ROWS * 2 + 21, 256  # three slices of the reference, the last one padded
    blocks = random_blocks(Q.Q6_K, rows, k, seed=4)
    assert_same_parts(gl.pack_blocks(Q.Q6_K, blocks, k), gl.pack_reference(Q.Q6_K, blocks))
    layer = gl.GGUFLinear(Q.Q6_K, blocks, (rows, k))
    assert np.array_equal(layer.dequantized().numpy(), quants.dequantize(blocks, Q.Q6_K).reshape(rows, k))
    x = torch.randn(2, k)
    assert torch.equal(layer(x)[:, -21:], layer.rows(torch.arange(rows - 21, rows))(x))


def mapping_of(address: int) -> dict[str, str] | None:
    """/proc/self/smaps' fields of the mapping that holds ``address`` (None: no mapping does)."""
    fields: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            if fields is not None:
                return fields
            start, end = (int(a, 16) for a in head.split("-"))
            fields = {} if start <= address < end else None
        elif fields is not None:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="no transparent huge pages here (not Linux)",
)
def test_packed_weights_are_on_memory_asked_for_huge_pages_and_go_with_their_layer() -> None:
    """The packer's arrays are in mappings advised for 2 MB pages (VmFlags "hg"): a small layer's in
    a chunk shared with others, a big one's (over 32 MB) in its own, unmapped when the layer goes."""
    small = gl.GGUFLinear(Q.Q4_K, random_blocks(Q.Q4_K, 64, 512), (64, 512))
    big = gl.GGUFLinear(Q.Q4_K, random_blocks(Q.Q4_K, 8448, 8192, seed=1), (8448, 8192))
    for address in (small.codes.data_ptr(), big.codes.data_ptr()):
        fields = mapping_of(address)
        assert fields is not None and "hg" in fields["VmFlags"].split()
    address = big.codes.data_ptr()
    assert address % (2 << 20) == 0  # its own chunk starts on a 2 MB boundary
    x = torch.randn(3, 8192)
    assert torch.equal(big(x), reference_of(big, x))
    del big
    assert mapping_of(address) is None


def reference_of(layer: gl.GGUFLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's outputs from copies of its arrays in ordinary memory."""
    parts = {name: value.clone() for name, value in layer.parts().items()}
    copy = gl.GGUFLinear.from_parts(layer.qtype, parts, (layer.out_features, layer.in_features), None)
    return copy(x)
