"""The random-weight Llama GGUF fixture: llama.cpp's Q4_K_M layout, sensible weights, readable tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
from collections import Counter

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants

from verispec.bench import synthetic_gguf as sg
from verispec.bench.synthetic_gguf import LLAMA_3_1_8B, LLAMA_SMALL, tensor_plan, write_llama_gguf


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", shape=LLAMA_SMALL, seed=0)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_8b_plan_is_llama_cpp_q4_k_m_of_llama_3_1_8b():
    plans = tensor_plan(LLAMA_3_1_8B)
    # What llama.cpp's loader prints for Meta-Llama-3.1-8B Q4_K_M: 292 tensors, f32 66, q4_K 193, q6_K 33.
    assert len(plans) == 292
    assert Counter(p.qtype for p in plans) == {Q.F32: 66, Q.Q4_K: 193, Q.Q6_K: 33}
    more_bits = [layer for layer in range(32) if sg.use_more_bits(layer, 32)]
    assert more_bits == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    by_name = {p.name: p for p in plans}
    assert by_name["token_embd.weight"].qtype == Q.Q4_K and by_name["token_embd.weight"].shape == (
        128256,
        4096,
    )
    assert by_name["output.weight"].qtype == Q.Q6_K
    assert by_name["blk.6.attn_v.weight"].qtype == Q.Q6_K and by_name["blk.6.attn_v.weight"].shape == (
        1024,
        4096,
    )
    assert by_name["blk.7.ffn_down.weight"].qtype == Q.Q4_K
    assert by_name["blk.7.ffn_down.weight"].shape == (4096, 14336)
    assert by_name["blk.7.attn_q.weight"].qtype == Q.Q4_K
    assert 4.90e9 < sg.file_size(LLAMA_3_1_8B) < 4.93e9  # the real file: 4.92 GB


def test_small_file_parses_with_the_planned_tensors_and_metadata(small_gguf):
    reader = GGUFReader(small_gguf)
    got = {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    assert got == {p.name: (p.qtype, p.shape) for p in tensor_plan(LLAMA_SMALL)}
    # both block types of a Q4_K_M layer occur at this size
    assert got["blk.0.attn_v.weight"][0] == Q.Q4_K and got["blk.3.attn_v.weight"][0] == Q.Q6_K
    assert got["blk.1.ffn_down.weight"][0] == Q.Q4_K and got["blk.2.ffn_down.weight"][0] == Q.Q6_K

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "llama" and field("general.file_type") == sg.Q4_K_M_FILE_TYPE
    assert field("llama.embedding_length") == 256 and field("llama.block_count") == 4
    assert field("llama.attention.head_count") == 4 and field("llama.attention.head_count_kv") == 2
    assert field("llama.rope.freq_base") == 500000.0 and field("llama.context_length") == 4096
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "llama-bpe"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == 512 and tokens[field("tokenizer.ggml.bos_token_id")] == "<|begin_of_text|>"
    assert tokens[field("tokenizer.ggml.eos_token_id")] == "<|eot_id|>"


def test_dequantized_weights_have_the_intended_scale(small_gguf):
    for tensor in GGUFReader(small_gguf).tensors:
        weights = quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.isfinite(weights).all(), tensor.name
        if tensor.tensor_type in (Q.Q4_K, Q.Q6_K):
            assert 0.018 < weights.std() < 0.022, tensor.name
            assert abs(weights.mean()) < 0.001, tensor.name
        elif tensor.name.endswith("_norm.weight"):
            assert weights.min() >= 0.9 and weights.max() <= 1.1
    rope = quants.dequantize(
        next(t for t in GGUFReader(small_gguf).tensors if t.name == "rope_freqs.weight").data, Q.F32
    )
    assert rope[0] == 1.0 and rope[-1] == 8.0  # high frequencies kept, the lowest divided by the factor


def test_large_blocks_keep_their_scale_too():
    rng = np.random.default_rng(0)
    for make, qtype in ((sg.q4_k_blocks, Q.Q4_K), (sg.q6_k_blocks, Q.Q6_K)):
        weights = quants.dequantize(make(rng, 4096, 0.02), qtype)
        assert abs(weights.std() - 0.02) < 0.0005 and abs(weights.mean()) < 0.0002, qtype.name


def test_same_seed_same_bytes_and_chunking_keeps_the_file_valid(tmp_path, small_gguf, monkeypatch):
    again = write_llama_gguf(tmp_path / "again.gguf", shape=LLAMA_SMALL, seed=0)
    assert _digest(again) == _digest(small_gguf)
    other = write_llama_gguf(tmp_path / "other.gguf", shape=LLAMA_SMALL, seed=1)
    assert _digest(other) != _digest(small_gguf)
    monkeypatch.setattr(sg, "CHUNK_BYTES", 5000)  # every matrix in several chunks
    chunked = write_llama_gguf(tmp_path / "chunked.gguf", shape=LLAMA_SMALL, seed=0)
    assert chunked.stat().st_size == small_gguf.stat().st_size
    for tensor in GGUFReader(chunked).tensors:
        if tensor.tensor_type != Q.F32:
            assert 0.018 < quants.dequantize(tensor.data, tensor.tensor_type).std() < 0.022


def test_an_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    def broken(plan, shape, rng, std):
        raise KeyboardInterrupt

    monkeypatch.setattr(sg, "_tensor_chunks", broken)
    with pytest.raises(KeyboardInterrupt):
        write_llama_gguf(tmp_path / "x.gguf", shape=LLAMA_SMALL)
    assert list(tmp_path.iterdir()) == []


def test_vocabulary_is_a_consistent_byte_level_bpe():
    tokens, types, merges = sg.llama3_style_vocab(LLAMA_SMALL)
    assert len(tokens) == len(types) == 512 and len(set(tokens)) == 512
    assert len(merges) == 512 - 256 - 16
    assert tokens[0] == "!" and "Ġ" in tokens[:256]
    index = {token: i for i, token in enumerate(tokens)}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ")
        merged = index[left + right]
        assert index[left] < merged and index[right] < merged and merged == 256 + rank
    assert types[:496] == [sg.TOKEN_NORMAL] * 496 and types[496:] == [sg.TOKEN_CONTROL] * 16


def test_shapes_refuse_widths_that_are_not_whole_k_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        sg.LlamaShape("bad", hidden=320, layers=1, heads=5, kv_heads=1, head_dim=64, intermediate=512,
                      vocab=512, special_tokens=16, context=64)  # fmt: skip


def test_transformers_reads_config_tokenizer_and_weights(small_gguf):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = small_gguf.parent, small_gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 768)
    assert config.vocab_size == 512 and config.rms_norm_eps == pytest.approx(1e-5)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = "def add(a, b):\n    return a + b  # ünïcode"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text and max(ids) < 512
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.eos_token == "<|eot_id|>"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.05


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_loads_tokenizes_and_runs_it(small_gguf):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(small_gguf), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == 512
    ids = llm.tokenize(b"def add(a, b): return a + b", add_bos=True)
    assert ids[0] == 496 and llm.detokenize(ids[1:]) == b"def add(a, b): return a + b"
    llm.eval(ids)
    assert np.isfinite(np.asarray(llm.scores[llm.n_tokens - 1])).all()
