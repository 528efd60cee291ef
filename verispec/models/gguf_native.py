"""Load a GGUF model with its weights left in the file's own quantized blocks.

Why: the converted-model cache (:mod:`verispec.models.cache`) de-quantizes a GGUF to float32 once,
4 bytes a parameter: 9.5 GB and minutes of conversion for the bundled models, and an 8B model
cannot even be converted on a 24 GB machine. Here nothing of that size is built, in memory or on
disk: the file is memory-mapped, and each quantized weight matrix goes from its blocks in the file
to a :class:`~verispec.models.gguf_linear.GGUFLinear`, which runs them as they are.

How, so that everything downstream (:class:`~verispec.models.hf.HFCausalLM`, the lean forward,
EAGLE's feature taps) sees the same transformers model as the converted path:

- The config and tokenizer come from transformers' own GGUF support. Building them parses the
  file's whole vocabulary (10 s for the 1.5B's 150k tokens), so the few MB they save to are cached
  under ``<cache>/gguf-meta/<key>/``, keyed like the converted folders.
- The model is built from that config with its parameters on the meta device (no memory); buffers
  such as the rotary frequencies are computed as usual, or from the file's own per-frequency
  divisors where it has them (Llama 3's ``rope_freqs``, :mod:`verispec.models.rope_freqs`).
- Each tensor goes where transformers' GGUF loader puts it: its name map (gguf-py's, through
  ``get_gguf_hf_weights_map``) and its per-architecture tensor processor, which also adjusts small
  float tensors (Gemma's norms) exactly as it does when converting.
- A quantized Linear weight becomes a GGUFLinear over the tensor's blocks (q/k/v and gate/up one
  fused GGUFLinear each, packed from their tensors at once); the token embedding a
  :class:`~verispec.models.gguf_embedding.GGUFEmbedding` that de-quantizes only the rows it looks
  up; a tied LM head a GGUFLinear over the embedding's blocks. A type no kernel runs is refused by
  name, never re-rounded. Float (F32/F16/BF16) weight matrices become plain float Linears.
- Where a processor reorders a tensor's rows (llama.cpp permutes Llama's q/k rows for its rotary
  layout, and transformers permutes them back), the same reorder moves whole rows of blocks: a
  block never spans two rows, so this is exact. The reorder is found by running the processor on
  row indices, so it is transformers' own, whatever the architecture; a processor that does more
  than reorder rows (a transpose, a change of values) cannot apply to blocks, and is refused.
- Once a tensor is in its module, its pages of the map are handed back (:meth:`GGUFFile.release`),
  so a module that copies its blocks does not leave the file's bytes counted twice.

The tensor table is read by :func:`~verispec.models.gguf_file.read_gguf` (a fraction of a second,
where ``gguf.GGUFReader`` takes 9 s for the 1.5B's header).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import quants
from torch import nn

from verispec.config import ModelLoadConfig
from verispec.errors import VerispecError
from verispec.models import rope_freqs
from verispec.models.fused import GROUPS, install, joint_bias
from verispec.models.gguf_embedding import GGUFEmbedding
from verispec.models.gguf_file import GGUFFile, GGUFTensor, Q, read_gguf
from verispec.models.gguf_linear import GGUFLinear, check_type
from verispec.models.hf import HFCausalLM
from verispec.models.quant import resolve_quantization

FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.F64})
"""Types that hold values, not blocks: such a weight matrix becomes a plain float Linear."""

META_DONE = "verispec-source.json"
"""Written last into a metadata folder; its presence marks the folder complete."""


# --- loading -------------------------------------------------------------------------------------


def load_gguf(path: Path, name: str, cfg: ModelLoadConfig) -> HFCausalLM:
    """Load the GGUF model at ``path`` running its own blocks (CPU, float32 activations).

    No float32 copy of the weights is built: the quantized weights go from the memory-mapped
    file to the GGUF modules (see the module docstring). Raises VerispecError for a tensor type no
    kernel runs, naming it."""
    resolve_quantization("gguf", cfg.device, cfg.dtype)  # refuses CUDA and half precision
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    file = read_gguf(path)
    folder = _meta_folder(path)
    cached = (folder / META_DONE).is_file()
    with _one_metadata_parse():
        config = _load_config(folder if cached else None, path)
        divisors = rope_freqs.file_divisors(file)  # Llama 3's long-context RoPE: transformers drops it
        if divisors is not None:
            rope_freqs.state_in_config(config, divisors, required=False)
        model = _empty_model(config, path)
        _fill(model, file, config)
        if divisors is not None:
            rope_freqs.set_frequencies(model, divisors)
        # (q/k/v and gate/up were packed as one product each already: _pack_groups)
        _return_freed_pages()  # the packing's temporaries
        tokenizer = _load_tokenizer(folder if cached else None, path)
    if not cached:
        _remember(folder, config, tokenizer, path)
    from verispec.models.attention import register

    model.set_attn_implementation(register())
    lm = HFCausalLM(model.eval(), name=name, tokenizer=tokenizer)
    lm.quantization = "gguf"
    lm.load_seconds = time.perf_counter() - start
    return lm


def _return_freed_pages() -> None:
    """Give the pages freed during the load back to the system (glibc's ``malloc_trim``).

    glibc keeps freed heap pages mapped: when the blocks were packed in numpy and fused by copying,
    the 8B-shaped Q4_K_M file stayed at 8.1 GB of RSS after loading without the trim, 5.1 GB with it
    (the file is 4.9 GB). The kernel's packer leaves few temporaries; the trim stays for whatever
    the rest of the load frees. Elsewhere (no glibc) nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # musl and other C libraries: no malloc_trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _meta_folder(path: Path) -> Path:
    from verispec.models.cache import gguf_key
    from verispec.models.registry import cache_root

    return cache_root() / "gguf-meta" / gguf_key(path)


def _load_config(folder: Path | None, path: Path) -> Any:
    """The model's config: from the metadata folder, else from the file's metadata."""
    from transformers import AutoConfig

    try:
        if folder is not None:
            return AutoConfig.from_pretrained(folder)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:  # unsupported architecture, bad metadata, ...
        raise VerispecError(f"transformers could not load {path}: {exc}") from exc


def _load_tokenizer(folder: Path | None, path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        if folder is not None:
            return AutoTokenizer.from_pretrained(folder)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise VerispecError(f"transformers could not build the tokenizer of {path}: {exc}") from exc


@contextmanager
def _one_metadata_parse() -> Iterator[None]:
    """AutoConfig and AutoTokenizer each parse the file's whole metadata with transformers'
    ``load_gguf_checkpoint`` (10 s each for a 150k-token vocabulary, an object per string). While
    this lasts, that parse (without tensors) runs once per file and each caller gets its own copy
    of the result."""
    from transformers import modeling_gguf_pytorch_utils as utils

    parse = utils.load_gguf_checkpoint
    parsed: dict[str, Any] = {}

    def once(path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
        if return_tensors or args or kwargs:
            return parse(path, return_tensors, *args, **kwargs)
        if str(path) not in parsed:
            parsed[str(path)] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[str(path)])

    utils.load_gguf_checkpoint = once
    try:
        yield
    finally:
        utils.load_gguf_checkpoint = parse


def _remember(folder: Path, config: Any, tokenizer: Any, path: Path) -> None:
    """Save config and tokenizer (a few MB) into ``folder``, published whole by a rename."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
        for file in tmp.iterdir():
            file.chmod(0o644)
        (tmp / META_DONE).write_text(json.dumps({"gguf": str(path.resolve())}, indent=1))
        if folder.exists() and not (folder / META_DONE).is_file():
            shutil.rmtree(folder)  # an incomplete folder from elsewhere: not to be trusted
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / META_DONE).is_file():  # another process got there first: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter created inside lives on the meta device (no memory); buffers, such as the
    rotary frequencies computed in ``__init__``, stay real. Patches ``nn.Module.register_parameter``
    while it lasts (a model is built in one thread at load)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _empty_model(config: Any, path: Path) -> nn.Module:
    """The transformers model the converted path would load, its parameters on the meta device."""
    from transformers import AutoModelForCausalLM

    try:
        with _parameters_on_meta():
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as exc:  # a config no causal LM class takes
        raise VerispecError(f"transformers has no causal LM for {path}: {exc}") from exc


def _fill(model: nn.Module, file: GGUFFile, config: Any) -> None:
    """Put every tensor of ``file`` into ``model``: blocks into GGUF modules, floats into parameters.

    Raises VerispecError for a type no kernel runs, a tensor whose shape does not fit, or a
    parameter the file does not hold."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(config=config.to_dict())
    try:
        with _one_name_map():
            names = get_gguf_hf_weights_map(model, processor)  # gguf name -> transformers name
    except NotImplementedError as exc:
        raise VerispecError(f"{file.path}: gguf-py has no tensor names for this architecture: {exc}") from exc
    modules = dict(model.named_modules())
    blocks: dict[str, GGUFTensor] = {}  # module name -> its quantized weight, once its bias is in
    for tensor in file.tensors:
        if tensor.name not in names:
            continue  # nothing in the model for it (Llama 3's rope_freqs: see load_gguf)
        owner, _, leaf = names[tensor.name].rpartition(".")
        module = modules.get(owner)
        if tensor.qtype not in FLOAT_TYPES and leaf == "weight" and _takes_blocks(module):
            blocks[owner] = tensor
            continue
        for hf_name, value in _float_values(processor, tensor, names):
            owner, _, leaf = hf_name.rpartition(".")
            _set_tensor(modules[owner], leaf, value, hf_name)
        file.release(tensor)
    _pack_groups(modules, blocks, file, processor, names)
    for owner, tensor in blocks.items():
        model.set_submodule(owner, _block_module(modules[owner], tensor, processor, names))
        file.release(tensor)
    _tie_head(model, file, processor, names)
    file.release()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise VerispecError(f"{file.path} holds no tensor for the model's {', '.join(missing[:5])}{more}")


@contextmanager
def _one_name_map() -> Iterator[None]:
    """transformers' ``get_gguf_hf_weights_map`` builds gguf-py's name map afresh for every module
    it recurses into (30 ms each: 12 s for a 30-layer model). The map depends only on the
    architecture and the layer count and is not changed once built, so while this lasts one map
    per (architecture, layers) is built and shared."""
    import gguf

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


def _takes_blocks(module: nn.Module | None) -> bool:
    """Whether ``module`` is replaced by a GGUF module that keeps its weight's blocks: a Linear, or
    a plain Embedding (a subclass such as Gemma's scaled embedding does more in its forward, and
    keeps a float table)."""
    return isinstance(module, nn.Linear) or type(module) is nn.Embedding


def _block_module(module: nn.Module, tensor: GGUFTensor, processor: Any, names: dict[str, str]) -> nn.Module:
    """A GGUFLinear or GGUFEmbedding over ``tensor``'s blocks (rows reordered as transformers would)."""
    order = _checked_order(module, tensor, processor, names)
    if isinstance(module, nn.Embedding):
        data = tensor.data if order is None else np.ascontiguousarray(tensor.data[order])  # whole rows: exact
        return GGUFEmbedding(tensor.qtype, data, (module.num_embeddings, module.embedding_dim))
    return GGUFLinear(
        tensor.qtype, tensor.data, (module.out_features, module.in_features), module.bias, order
    )


def _checked_order(
    module: nn.Module, tensor: GGUFTensor, processor: Any, names: dict[str, str]
) -> np.ndarray | None:
    """``tensor``'s row order for ``module`` (None: as stored), once its type, shape and bias are
    checked against the module's."""
    embedding = isinstance(module, nn.Embedding)
    if not embedding:
        check_type(tensor.qtype, tensor.name)
    shape = (
        (module.num_embeddings, module.embedding_dim)
        if embedding
        else (module.out_features, module.in_features)
    )
    if tuple(tensor.shape) != shape:
        raise VerispecError(f"{tensor.name} is {tensor.shape} in the file where the model needs {shape}")
    bias = None if embedding else module.bias
    if bias is not None and bias.device.type == "meta":
        raise VerispecError(f"{tensor.name} has no bias tensor in the file where the model needs one")
    return _row_order(processor, tensor, names)


def _pack_groups(
    modules: dict[str, nn.Module],
    blocks: dict[str, GGUFTensor],
    file: GGUFFile,
    processor: Any,
    names: dict[str, str],
) -> None:
    """Pack each group of :data:`~verispec.models.fused.GROUPS` (q/k/v, gate/up) whose members are
    Linears of one block type and input size into one fused GGUFLinear, read straight from the
    file's blocks (as :func:`~verispec.models.fused.fuse_projections` fuses int8 and int4 layers),
    rather than packing the members apart and copying them into one (the 8B-shaped file: 8.1-8.3 s
    to load instead of 10.4-13.9).
    Packed members leave ``blocks``."""
    parents = {owner.rpartition(".")[0] for owner in blocks}
    for parent in sorted(parents):
        for group, fused_name in GROUPS.items():
            owners = [f"{parent}.{member}" if parent else member for member in group]
            members = [modules.get(owner) for owner in owners]
            if not all(
                owner in blocks and type(m) is nn.Linear for owner, m in zip(owners, members, strict=True)
            ):
                continue
            tensors = [blocks[owner] for owner in owners]
            if len({t.qtype for t in tensors}) != 1 or len({m.in_features for m in members}) != 1:
                continue
            sizes = [m.out_features for m in members]
            orders = [_checked_order(m, t, processor, names) for m, t in zip(members, tensors, strict=True)]
            order = _joint_order(orders, sizes)
            shape = (sum(sizes), members[0].in_features)
            linear = GGUFLinear(
                tensors[0].qtype, [t.data for t in tensors], shape, joint_bias(members), order
            )
            install(modules[parent], group, fused_name, linear, sizes)
            for owner, tensor in zip(owners, tensors, strict=True):
                del blocks[owner]
                file.release(tensor)


def _joint_order(orders: list[np.ndarray | None], sizes: list[int]) -> np.ndarray | None:
    """The members' row orders as one over their rows one after another (None: all as stored)."""
    if all(o is None for o in orders):
        return None
    starts = np.cumsum([0, *sizes[:-1]])
    parts = zip(starts, orders, sizes, strict=True)
    return np.concatenate([start + (np.arange(n) if o is None else o) for start, o, n in parts])


def _row_order(processor: Any, tensor: GGUFTensor, names: dict[str, str]) -> np.ndarray | None:
    """The row order transformers' tensor processor gives ``tensor`` (None: as stored).

    Found by processing the row indices instead of the values: a pure row reorder moves them the
    same way. Anything else (a transpose, a change of values, a tensor moved elsewhere) cannot be
    done on blocks and is refused."""
    rows = tensor.shape[0]
    index = np.arange(rows, dtype=np.float64)
    probe = np.stack([index, index + rows], axis=1)  # two columns: a transpose or a mix shows
    try:
        result = processor.process(
            weights=probe, name=tensor.name, tensor_key_mapping=names, parsed_parameters={"tensors": {}}
        )
        out = np.asarray(result.weights)
        order = out[:, 0].astype(np.int64)
        ok = (
            result.name == tensor.name
            and out.shape == probe.shape
            and np.array_equal(out[:, 1], out[:, 0] + rows)
            and np.array_equal(np.sort(order), np.arange(rows))
        )
    except (ValueError, IndexError, TypeError, KeyError):
        ok = False
    if not ok:
        raise VerispecError(
            f"{tensor.name}: transformers transforms this {tensor.qtype.name} tensor beyond reordering its "
            "rows when it loads this architecture, which cannot be done on its blocks; use --quantization "
            "auto, none, int8 or int4 for this model"
        )
    return None if np.array_equal(order, np.arange(rows)) else order


def _float_values(
    processor: Any, tensor: GGUFTensor, names: dict[str, str]
) -> list[tuple[str, torch.Tensor]]:
    """(transformers name, float32 value) for a tensor that becomes float parameters, exactly as
    transformers' GGUF loader makes them (de-quantize, its processor, float32); [] for a tensor
    the model has no place for (the loader skips those too)."""
    parsed: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}
    weights = quants.dequantize(tensor.data, tensor.qtype)
    result = processor.process(
        weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
    )
    out = [(name, value.to(torch.float32)) for name, value in parsed["tensors"].items()]
    if result.name in names:
        out.append((names[result.name], torch.from_numpy(np.copy(result.weights)).to(torch.float32)))
    return out


def _set_tensor(module: nn.Module, leaf: str, value: torch.Tensor, name: str) -> None:
    """Replace the (meta) parameter or buffer ``leaf`` of ``module`` by ``value``, same shape."""
    old = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
    if old is None:
        raise VerispecError(f"the file holds {name}, which the model has no place for")
    if tuple(old.shape) != tuple(value.shape):
        raise VerispecError(
            f"{name} is {tuple(value.shape)} in the file where the model needs {tuple(old.shape)}"
        )
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _tie_head(model: nn.Module, file: GGUFFile, processor: Any, names: dict[str, str]) -> None:
    """A head still empty is tied to the token embedding (the file has no ``output.weight``): a
    GGUFLinear over the embedding tensor's blocks (even where the embedding itself keeps a float
    table), or the embedding's float table where the file stores it in floats."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.weight.device.type != "meta":
        return
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return  # left empty: reported as missing
    embedding = model.get_input_embeddings()
    modules = {m: n for n, m in model.named_modules()}
    source = {hf: gguf for gguf, hf in names.items()}.get(f"{modules[embedding]}.weight")
    tensor = next((t for t in file.tensors if t.name == source), None)
    if tensor is None or tensor.qtype in FLOAT_TYPES:
        head.weight = embedding.weight
    else:
        model.set_submodule(modules[head], _block_module(head, tensor, processor, names))
