"""Random-weight GGUF files laid out like a real Llama-3.1-8B Q4_K_M, for tests and the load benchmark.

A 7-8B GGUF is what users bring, and what has to load and decode on a small machine; but the real
file is 4.9 GB behind a licence, and no test can download it. What the load path and the kernels
depend on is the file's *layout*: its tensor names and shapes, its mix of block types, its metadata
and tokenizer. :func:`write_llama_gguf` writes exactly that layout with random contents, so the file
costs what the real one costs to load and to run, and any GGUF reader (gguf-py, transformers,
llama.cpp) accepts it.

The type mix is the one llama.cpp's quantizer (``llama_tensor_get_type``) gives a Llama for
``Q4_K_M``: Q4_K by default, Q6_K for ``output.weight`` and for ``attn_v`` and ``ffn_down`` in the
layers its ``use_more_bits`` rule picks (the first and last eighth of the layers and every third one
between), float32 norms. The blocks are written directly, not quantized from float weights: random
codes, with super-block scales picked so that the de-quantized weights have a standard deviation of
about ``weight_std`` (0.02, the usual initialisation) and a mean of about zero. At that scale every
projection keeps its input's magnitude within a small factor and each layer adds a bounded amount
to the residual stream (its input is normalised first), so activations stay finite through all 32
layers and the logits are ordinary numbers, not infinities that would make a timing meaningless.

The file is written tensor by tensor in chunks of rows, never held whole in memory, to a temporary
name that is renamed at the end: an interrupted run leaves no file that looks complete.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as Q

from verispec.models.rope_freqs import LLAMA_3_1, llama3_divisors, wavelengths

Q4_K_M_FILE_TYPE = int(LlamaFileType.MOSTLY_Q4_K_M)
"""``general.file_type`` of a Q4_K_M file (llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q4_K_M``)."""

CHUNK_BYTES = 32 << 20
"""Bytes of one tensor generated and written at a time: large enough for numpy to be fast, small
enough that writing the 8B file needs no more memory than a browser tab."""


_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
"""Llama 3.1's first special tokens, in its order; the rest are numbered reserved tokens."""

BOS_OFFSET = 0
EOS_OFFSET = _NAMED_SPECIALS.index("<|eot_id|>")
"""The instruct model's end of turn, which is what its GGUF names as EOS."""

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
"""llama.cpp's ``LLAMA_TOKEN_TYPE_NORMAL`` and ``LLAMA_TOKEN_TYPE_CONTROL``."""


@dataclass(frozen=True)
class LlamaShape:
    """The hyperparameters a Llama GGUF states in its metadata, and the vocabulary's layout."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    special_tokens: int
    """Control tokens at the end of the vocabulary (``<|begin_of_text|>`` ...), as in Llama 3."""
    context: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        block = GGML_QUANT_SIZES[Q.Q4_K][0]
        # K-quant blocks run along a row: every matrix's input width must be whole blocks.
        for field_name in ("hidden", "intermediate"):
            if getattr(self, field_name) % block:
                raise ValueError(f"{field_name} must be a multiple of {block} for K-quant blocks")
        if self.heads * self.head_dim != self.hidden or self.heads % self.kv_heads:
            raise ValueError("need heads * head_dim == hidden and heads a multiple of kv_heads")
        if self.special_tokens < len(_NAMED_SPECIALS) or self.vocab < 256 + self.special_tokens:
            raise ValueError(
                f"need at least {len(_NAMED_SPECIALS)} special tokens and room for the 256 byte tokens"
            )


LLAMA_3_1_8B = LlamaShape(
    name="llama-3.1-8b",
    hidden=4096,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
    special_tokens=256,
    context=4096,  # the model's own 131072 would only make readers size larger caches
)
"""Meta-Llama-3.1-8B's shapes; its Q4_K_M file is 4.92 GB."""

LLAMA_SMALL = LlamaShape(
    name="llama-small",
    hidden=256,
    layers=4,
    heads=4,
    kv_heads=2,
    head_dim=64,
    intermediate=768,
    vocab=512,
    special_tokens=16,
    context=4096,
)
"""The same structure at test size (about 1 MB): 4 layers, so that both the Q4_K and the Q6_K
layers of ``use_more_bits`` occur (layers 2 and 3 get Q6_K), and grouped-query attention."""

SHAPES = {shape.name: shape for shape in (LLAMA_3_1_8B, LLAMA_SMALL)}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose ``attn_v`` and ``ffn_down`` Q4_K_M stores as Q6_K.

    Written with C's integer division; the modulo never sees a negative operand because the first
    clause already holds for every layer below ``layers // 8``.
    """
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m_type(name: str, layers: int) -> Q:
    """The block type llama.cpp's ``Q4_K_M`` gives tensor ``name`` of a Llama with ``layers`` layers."""
    if name.endswith("_norm.weight") or name == "rope_freqs.weight":
        return Q.F32
    if name == "output.weight":
        return Q.Q6_K
    if name.startswith("blk.") and (".attn_v." in name or ".ffn_down." in name):
        return Q.Q6_K if use_more_bits(int(name.split(".")[1]), layers) else Q.Q4_K
    return Q.Q4_K


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its name, block type and shape in numpy order (rows, columns)."""

    name: str
    qtype: Q
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape of the raw bytes, one row of blocks per output channel (as gguf-py stores it)."""
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * type_size)


def tensor_plan(shape: LlamaShape) -> list[TensorPlan]:
    """Every tensor of the file, in the order llama.cpp's converter writes a Llama 3.1.

    ``rope_freqs.weight`` is the per-frequency divisor of Llama 3.1's long-context RoPE scaling,
    which llama.cpp stores as a tensor rather than metadata; a real 3.1 file carries it, so a loader
    must expect it.
    """
    kv = shape.kv_heads * shape.head_dim
    per_layer = [
        ("attn_norm", (shape.hidden,)),
        ("attn_q", (shape.hidden, shape.hidden)),
        ("attn_k", (kv, shape.hidden)),
        ("attn_v", (kv, shape.hidden)),
        ("attn_output", (shape.hidden, shape.hidden)),
        ("ffn_norm", (shape.hidden,)),
        ("ffn_gate", (shape.intermediate, shape.hidden)),
        ("ffn_up", (shape.intermediate, shape.hidden)),
        ("ffn_down", (shape.hidden, shape.intermediate)),
    ]
    names: list[tuple[str, tuple[int, ...]]] = [
        ("rope_freqs.weight", (shape.head_dim // 2,)),
        ("token_embd.weight", (shape.vocab, shape.hidden)),
    ]
    for layer in range(shape.layers):
        names += [(f"blk.{layer}.{part}.weight", dims) for part, dims in per_layer]
    names += [("output_norm.weight", (shape.hidden,)), ("output.weight", (shape.vocab, shape.hidden))]
    return [TensorPlan(name, q4_k_m_type(name, shape.layers), dims) for name, dims in names]


def llama3_rope_factors(shape: LlamaShape) -> np.ndarray:
    """Llama 3.1's RoPE scaling (factor 8, low/high frequency factors 1 and 4, 8192 original
    positions) as the per-frequency divisors llama.cpp's converter writes to ``rope_freqs.weight``."""
    return llama3_divisors(LLAMA_3_1, wavelengths(shape.rope_theta, shape.head_dim)).astype(np.float32)


# -- vocabulary -------------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level spelling: each byte as one printable character (space is ``Ġ``).

    Printable bytes spell themselves; the other 68 take the code points from 256 up, in order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return {b: spelling[b] for b in printable + [b for b in range(256) if b not in printable]}


def llama3_style_vocab(shape: LlamaShape, seed: int = 0) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a byte-level BPE vocabulary shaped like Llama 3's.

    The 256 byte tokens come first (in GPT-2's order, so token 0 is ``!`` as in the real
    vocabulary), then synthetic merged tokens, each the merge of two earlier tokens (a new stem of
    two letters or a space and a letter, a stem grown by a letter, or two stems joined), then the
    control tokens. Every merge joins two
    tokens that exist before it, and every merged token is new, which is all a BPE reader checks;
    the words themselves are random.
    """
    rng = np.random.default_rng([seed, 0x70CE])
    alphabet = _byte_alphabet()
    tokens = list(alphabet.values())
    known = set(tokens)
    letters = [alphabet[b] for b in range(256) if chr(b).isascii() and chr(b).isalpha()]
    space = alphabet[ord(" ")]
    merges: list[str] = []
    n_merged = shape.vocab - 256 - shape.special_tokens
    words: list[str] = []  # merged tokens so far: the stems later merges grow
    while len(merges) < n_merged:
        roll = rng.random()
        if roll < 0.1 or not words:  # a new stem: a letter after a space or after another letter
            left = space if roll < 0.06 else letters[rng.integers(len(letters))]
            right = letters[rng.integers(len(letters))]
        elif roll < 0.2:
            left, right = words[rng.integers(len(words))], words[rng.integers(len(words))].lstrip(space)
            if right not in known or not right:
                continue
        else:
            left, right = words[rng.integers(len(words))], letters[rng.integers(len(letters))]
        merged = left + right
        if merged in known or len(merged) > 16:
            continue
        known.add(merged)
        tokens.append(merged)
        words.append(merged)
        merges.append(f"{left} {right}")
    specials = list(_NAMED_SPECIALS) + [
        f"<|reserved_special_token_{i}|>" for i in range(3, 3 + shape.special_tokens - len(_NAMED_SPECIALS))
    ]
    types = [TOKEN_NORMAL] * len(tokens) + [TOKEN_CONTROL] * len(specials)
    return tokens + specials, types, merges


# -- blocks -----------------------------------------------------------------------------------------

_Q4K_SCALES = (32, 64)
"""Range of the 6-bit sub-block scales: the upper half, as a quantizer that sets the largest scale of
a super-block to 63 leaves most of them."""
_Q6K_SCALES = (64, 128)
"""Range of the int8 sub-block scales' magnitude (random sign): Q6_K sets the largest to 127."""


def _uniform_rms(low: int, high: int) -> float:
    """Root mean square of an integer uniform on [low, high)."""
    values = np.arange(low, high, dtype=np.float64)
    return float(np.sqrt(np.mean(values**2)))


def _code_std(bits: int) -> float:
    """Standard deviation of a uniform ``bits``-bit code."""
    return math.sqrt(((1 << bits) ** 2 - 1) / 12)


def q4_k_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """``n_blocks`` random Q4_K super-blocks (144 bytes each) whose values have about ``std`` and mean 0.

    A Q4_K value is ``d * scale * q - dmin * min`` with 4-bit codes q (mean 7.5): each sub-block's
    min is chosen to cancel its mean, with ``dmin = 8 d`` so that the 6-bit min stays in range.
    """
    d_base = std / (_uniform_rms(*_Q4K_SCALES) * _code_std(4))
    d = (d_base * rng.uniform(0.8, 1.2, n_blocks)).astype(np.float16)
    dmin = (d.astype(np.float32) * 8).astype(np.float16)
    sc = rng.integers(*_Q4K_SCALES, size=(n_blocks, 8), dtype=np.uint8)
    ratio = (d.astype(np.float32) / dmin.astype(np.float32))[:, None]
    mins = np.clip(np.rint(sc * 7.5 * ratio), 0, 63).astype(np.uint8)
    scales = np.empty((n_blocks, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    blocks = np.empty((n_blocks, 144), np.uint8)
    blocks[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 4:16] = scales
    blocks[:, 16:] = _random_bytes(rng, (n_blocks, 128))  # the codes: two 4-bit values per byte
    return blocks


def q6_k_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """``n_blocks`` random Q6_K super-blocks (210 bytes each) whose values have about ``std`` and mean 0.

    A Q6_K value is ``d * scale * (q - 32)`` with 6-bit codes and signed 8-bit scales; random signs
    centre it. At std 0.02 ``d`` falls in float16's subnormal range, as it does in real Q6_K files.
    """
    d_base = std / (_uniform_rms(*_Q6K_SCALES) * _code_std(6))
    d = (d_base * rng.uniform(0.8, 1.2, n_blocks)).astype(np.float16)
    magnitude = rng.integers(*_Q6K_SCALES, size=(n_blocks, 16)).astype(np.int16)
    sign = np.where(rng.random((n_blocks, 16)) < 0.5, -1, 1).astype(np.int16)
    blocks = np.empty((n_blocks, 210), np.uint8)
    blocks[:, :192] = _random_bytes(rng, (n_blocks, 192))  # low 4 bits (128 bytes), high 2 bits (64)
    blocks[:, 192:208] = (magnitude * sign).astype(np.int8).view(np.uint8)
    blocks[:, 208:210] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def _random_bytes(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return np.frombuffer(rng.bytes(shape[0] * shape[1]), np.uint8).reshape(shape)


_BLOCK_WRITERS: dict[Q, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    Q.Q4_K: q4_k_blocks,
    Q.Q6_K: q6_k_blocks,
}


def _tensor_chunks(
    plan: TensorPlan, shape: LlamaShape, rng: np.random.Generator, std: float
) -> Iterator[np.ndarray]:
    """The tensor's bytes as consecutive chunks of whole rows."""
    if plan.qtype == Q.F32:
        if plan.name == "rope_freqs.weight":
            yield llama3_rope_factors(shape)
        else:  # norm weights near 1: a loader that ignored them would show in a comparison
            yield rng.uniform(0.9, 1.1, plan.shape).astype(np.float32)
        return
    rows, row_bytes = plan.byte_shape
    blocks_per_row = row_bytes // GGML_QUANT_SIZES[plan.qtype][1]
    rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, rows, rows_per_chunk):
        n = min(rows_per_chunk, rows - start)
        yield _BLOCK_WRITERS[plan.qtype](rng, n * blocks_per_row, std).reshape(n, row_bytes)


# -- the file ---------------------------------------------------------------------------------------


def _add_metadata(writer: GGUFWriter, shape: LlamaShape, seed: int) -> None:
    arch = "llama"
    writer.add_name(f"synthetic {shape.name} Q4_K_M (random weights, seed {seed})")
    writer.add_file_type(Q4_K_M_FILE_TYPE)
    writer.add_quantization_version(2)
    writer.add_uint32(f"{arch}.context_length", shape.context)
    writer.add_uint32(f"{arch}.embedding_length", shape.hidden)
    writer.add_uint32(f"{arch}.block_count", shape.layers)
    writer.add_uint32(f"{arch}.feed_forward_length", shape.intermediate)
    writer.add_uint32(f"{arch}.attention.head_count", shape.heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", shape.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", shape.rms_eps)
    writer.add_uint32(f"{arch}.rope.dimension_count", shape.head_dim)
    writer.add_uint32(f"{arch}.vocab_size", shape.vocab)
    tokens, types, merges = llama3_style_vocab(shape, seed)
    special = shape.vocab - shape.special_tokens
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "llama-bpe")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", special + BOS_OFFSET)
    writer.add_uint32("tokenizer.ggml.eos_token_id", special + EOS_OFFSET)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", False)


def file_size(shape: LlamaShape = LLAMA_3_1_8B) -> int:
    """Bytes of tensor data the file holds (the metadata adds a few MB for the 8B's vocabulary)."""
    return sum(plan.nbytes for plan in tensor_plan(shape))


def write_llama_gguf(
    path: str | os.PathLike[str],
    *,
    shape: LlamaShape = LLAMA_3_1_8B,
    seed: int = 0,
    weight_std: float = 0.02,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight Llama GGUF with ``shape`` in Q4_K_M's type mix to ``path``; return it.

    The same ``seed`` gives the same bytes. ``progress(done, total)`` is called after each tensor
    with bytes of tensor data written so far.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    plans = tensor_plan(shape)
    writer = GGUFWriter(partial, "llama")
    try:
        _add_metadata(writer, shape, seed)
        for plan in plans:
            if plan.qtype == Q.F32:
                writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes)
            else:  # raw blocks: gguf-py takes their byte shape and the block type
                writer.add_tensor_info(
                    plan.name, plan.byte_shape, np.dtype(np.uint8), plan.nbytes, raw_dtype=plan.qtype
                )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None and len(writer.fout) == 1
        out = writer.fout[0]
        total = sum(plan.nbytes for plan in plans)
        done = 0
        for index, plan in enumerate(plans):
            # One stream per tensor: its bytes do not depend on how the others were chunked.
            rng = np.random.default_rng([seed, index])
            writer.write_padding(out, out.tell())  # each tensor starts aligned (32 bytes)
            written = 0
            for chunk in _tensor_chunks(plan, shape, rng, weight_std):
                chunk.tofile(out)
                written += chunk.nbytes
            if written != plan.nbytes:
                raise AssertionError(f"{plan.name}: wrote {written} bytes, planned {plan.nbytes}")
            done += written
            if progress is not None:
                progress(done, total)
        writer.write_padding(out, out.tell())
        writer.close()
        os.replace(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path
