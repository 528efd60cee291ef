"""Reading a GGUF file's header and tensor table, its tensors left as views of a memory map.

Why not ``gguf.GGUFReader``: it builds an object per vocabulary string, 9 s for the 1.5B's header
against a fraction of a second here, where the vocabulary (the tokenizer's business) is skipped.
The arrays are the ones GGUFReader gives (same dtype, shape and bytes; the tests check it), so a
tensor's blocks go from the file to a kernel (:mod:`verispec.models.gguf_native`) as they are.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from verispec.errors import VerispecError

Q = GGMLQuantizationType

_VALUE_DTYPES = {
    Q.F32: np.float32,
    Q.F16: np.float16,
    Q.F64: np.float64,
    Q.I8: np.int8,
    Q.I16: np.int16,
    Q.I32: np.int32,
    Q.I64: np.int64,
}
"""Types GGUFReader hands out as typed arrays of values; every other type comes as uint8 rows."""

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file, its data a view of the memory-mapped file."""

    name: str
    qtype: Q
    shape: tuple[int, ...]
    """In torch order (out_features, in_features for a weight matrix)."""
    data: np.ndarray
    """As ``gguf.GGUFReader`` gives it: uint8 ``[..., row_bytes]`` for block types and BF16, a
    typed array of ``shape`` for F32/F16/F64 and the integer types."""
    start: int
    """Where ``data`` starts in the file."""


@dataclass
class GGUFFile:
    """A GGUF file's scalar metadata and tensors (array metadata, such as the vocabulary, is
    skipped: it is the tokenizer's business)."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    mapping: mmap.mmap

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def release(self, tensor: GGUFTensor | None = None) -> None:
        """Drop the pages of ``tensor`` (None: of the whole file) from this process's memory.

        A module that copies its blocks (the kernel's layout) leaves the pages it read mapped here,
        counted in the resident size beside the copy until the map goes. Dropped pages are
        re-read from the file if anything still reads them (the map is private and never written,
        so they read back the same), as the embedding does, a few rows at a time."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # not Linux: the OS decides
            return
        start, end = (
            (0, len(self.mapping)) if tensor is None else (tensor.start, tensor.start + tensor.data.nbytes)
        )
        start -= start % mmap.PAGESIZE
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_gguf(path: Path) -> GGUFFile:
    """Parse ``path``'s header and tensor table; the tensors are views of a copy-on-write map of
    the file (writable for torch, never written back, read from disk only where used).

    Raises VerispecError for a file that is not a whole little-endian GGUF v2/v3 file."""
    try:
        with path.open("rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise VerispecError(f"{path} is not a readable GGUF file: {exc}") from exc
    blob = np.frombuffer(mapping, dtype=np.uint8)
    try:
        metadata, entries, data_start = _parse_header(memoryview(blob), path)
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise VerispecError(
            f"{path} is not a readable GGUF file (truncated or corrupt download?): {exc}"
        ) from exc
    tensors = [_tensor(path, blob, data_start, *entry) for entry in entries]
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, mapping=mapping)


def _parse_header(
    buf: memoryview, path: Path
) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """The scalar metadata, (name, torch shape, type id, offset) per tensor, and where data starts."""
    if bytes(buf[:4]) != b"GGUF":
        raise VerispecError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise VerispecError(f"{path} is GGUF version {version}{hint}; verispec reads v2 and v3 files")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _value(buf, pos + 4, kind)
    entries = []
    for _ in range(tensor_count):
        name, pos = _string(buf, pos)
        (ndims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndims}Q", buf, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndims)
        pos += 4 + 8 * ndims + 12
        entries.append((name, tuple(reversed(dims)), type_id, offset))  # ggml lists the fastest dim first
    alignment = int(metadata.get("general.alignment", 32))
    return metadata, entries, -(-pos // alignment) * alignment


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise IndexError("a string runs past the end of the file")
    return bytes(buf[pos + 8 : end]).decode("utf-8"), end


def _value(buf: memoryview, pos: int, kind: int) -> tuple[Any, int]:
    """One metadata value and the offset after it; an array is skipped and stands as its length."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind == GGUFValueType.STRING:
        return _string(buf, pos)
    if kind != GGUFValueType.ARRAY:
        raise IndexError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALARS:
        return count, pos + count * struct.calcsize(_SCALARS[item])
    if item == GGUFValueType.STRING:  # the vocabulary: walk the lengths, decode nothing
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return count, pos
    for _ in range(count):  # nested arrays
        _, pos = _value(buf, pos, item)
    return count, pos


def _tensor(
    path: Path,
    blob: np.ndarray,
    data_start: int,
    name: str,
    shape: tuple[int, ...],
    type_id: int,
    offset: int,
) -> GGUFTensor:
    try:
        qtype = Q(type_id)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise VerispecError(
            f"{path}: tensor {name} has ggml type {type_id}, which gguf-py does not know"
        ) from None
    if shape[-1] % block:
        raise VerispecError(f"{path}: tensor {name} has rows of {shape[-1]}, not whole {qtype.name} blocks")
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    row_bytes = shape[-1] // block * size
    start = data_start + offset
    end = start + rows * row_bytes
    if end > blob.shape[0]:
        raise VerispecError(
            f"{path} is not a readable GGUF file (truncated or corrupt download?): tensor {name} "
            f"ends at byte {end:,} of a {blob.shape[0]:,}-byte file"
        )
    data = blob[start:end]
    if qtype in _VALUE_DTYPES:
        data = data.view(_VALUE_DTYPES[qtype]).reshape(shape)
    else:
        data = data.reshape(*shape[:-1], row_bytes)
    return GGUFTensor(name=name, qtype=qtype, shape=shape, data=data, start=start)
