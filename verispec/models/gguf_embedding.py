"""A token embedding whose table stays a GGUF tensor's blocks (the native GGUF path's, see
:mod:`verispec.models.gguf_native`): a lookup de-quantizes only the rows it looks up."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from gguf import quants
from torch import nn

from verispec.errors import VerispecError
from verispec.models.gguf_file import Q

ROW_CACHE_BYTES = 32 << 20
"""De-quantized embedding rows a :class:`GGUFEmbedding` keeps for its next lookups (~5k rows of
1536 floats)."""


class GGUFEmbedding(nn.Module):
    """An ``nn.Embedding`` whose table stays a GGUF tensor's blocks: a lookup de-quantizes only the
    rows it looks up.

    The 1.5B's table de-quantized is 151936 x 1536 floats (0.9 GB) to look up a few rows a step.
    Row r of the table is row r of the blocks (a block never spans two rows) and de-quantizing is
    element by element, so each row comes out exactly as in gguf's de-quantized table.
    """

    def __init__(self, qtype: Q, blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> None:
        """``blocks``: uint8 ``[num_embeddings, row_bytes]`` as GGUFReader gives the tensor's data
        (kept, not copied); ``shape``: (num_embeddings, embedding_dim)."""
        super().__init__()
        self.qtype = qtype
        self.num_embeddings, self.embedding_dim = shape
        data = blocks.numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
        self.register_buffer(
            "blocks", torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)), persistent=False
        )
        self._row_cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._capacity = max(64, ROW_CACHE_BYTES // (4 * self.embedding_dim))
        try:
            self._rows(
                torch.zeros(1, dtype=torch.long)
            )  # a type gguf cannot de-quantize fails here, not mid-request
        except NotImplementedError as exc:
            raise VerispecError(
                f"token embeddings stored as {qtype.name} cannot be de-quantized: {exc}"
            ) from exc

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids).numpy()
        values = quants.dequantize(rows, self.qtype)  # [n, embedding_dim] float32
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(-1, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).to(device=self.blocks.device, dtype=torch.long)
        if len(ids) > self._capacity // 4:  # a prompt: one de-quantization, nothing kept
            return self._rows(ids).view(*input_ids.shape, self.embedding_dim)
        return torch.stack(self._cached(ids.tolist())).view(*input_ids.shape, self.embedding_dim)

    def _cached(self, ids: list[int]) -> list[torch.Tensor]:
        """The rows of ``ids`` from a least-recently-used cache of de-quantized rows.

        Why: decoding and drafting look up a few rows a call, and gguf's de-quantization costs
        ~0.3 ms a call however few rows it gets (the EAGLE drafter's lookups were ~2% of a step on
        the 1.5B). A cached row is the same float32 values the de-quantization gave."""
        cache = self._row_cache
        missing = sorted({i for i in ids if i not in cache})
        if missing:
            for i, row in zip(missing, self._rows(torch.tensor(missing)), strict=True):
                cache[i] = row.clone()  # not a view: a view would keep its whole batch alive
        for i in ids:
            cache.move_to_end(i)
        rows = [cache[i] for i in ids]
        while len(cache) > self._capacity:
            cache.popitem(last=False)
        return rows

    def dequantized(self) -> torch.Tensor:
        """The whole float32 table [num_embeddings, embedding_dim] (4 bytes a parameter: for tests
        and tools, not for the forward)."""
        return self._rows(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"
