"""Cache storage tensors allocated from a CacheLayout, and row addressing by absolute position."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deepinfer.kv.spec import FLOAT32, POOLS, CacheLayout, TensorSpec


class KVStorage:
    """One flat tensor [(num_blocks(pool) + 1) * rows_per_block, width] per (layer, cache tensor); a packed
    tensor (``TensorSpec.packed``) is uint8 [..., row bytes] instead, its codes and scales in one row.

    The extra block past the last real one is never handed out: padding tokens of a fixed-shape (CUDA
    graph) step write their rows there (``spare_row``) so that they can never touch a sequence's rows.
    """

    def __init__(
        self,
        layout: CacheLayout,
        num_blocks: Mapping[str, int],
        model_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        missing = [p for p in POOLS if p not in num_blocks]
        if missing:
            raise ValueError(f"num_blocks: missing pools {missing}")
        self.layout = layout
        self.num_blocks = dict(num_blocks)
        self.model_dtype = model_dtype
        self.tensors: dict[tuple[str, str], torch.Tensor] = {}
        self.specs: dict[tuple[str, str], TensorSpec] = {}
        for spec in layout.layers:
            for t in spec.tensors:
                self.specs[(spec.key, t.name)] = t
                rows = (self.num_blocks[t.pool] + 1) * layout.rows_per_block(t)
                if t.packed is not None:
                    dtype, width = torch.uint8, t.packed.row_bytes(t.width)
                else:
                    dtype, width = (torch.float32 if t.dtype == FLOAT32 else model_dtype), t.width
                self.tensors[(spec.key, t.name)] = torch.zeros(rows, width, dtype=dtype, device=device)
        # Whether some tensor keeps packed bytes: its writer hands unrounded values (``model/v41/cache_rows.py``).
        self.packed = any(t.packed is not None for t in self.specs.values())

    def get(self, layer_key: str, name: str) -> torch.Tensor:
        return self.tensors[(layer_key, name)]

    def spec(self, layer_key: str, name: str) -> TensorSpec:
        return self.specs[(layer_key, name)]

    def copy_block(self, pool: str, src: int, dst: int) -> None:
        """Copy block ``src`` of ``pool`` onto block ``dst``, every tensor of every layer (a prefix hit's
        private copy of a cached block that its replay rewrites)."""
        for spec in self.layout.layers:
            for t in spec.tensors:
                if t.pool == pool:
                    n = self.layout.rows_per_block(t)
                    rows = self.tensors[(spec.key, t.name)]
                    rows[dst * n:(dst + 1) * n] = rows[src * n:(src + 1) * n]

    def spare_row(self, pool: str) -> int:
        """First row of the spare block of ``pool`` for per-position (stride-1) tensors."""
        return self.num_blocks[pool] * self.layout.block_size


def rows_for(
    block_table: Sequence[int], indices: torch.Tensor, layout: CacheLayout, spec: TensorSpec
) -> torch.Tensor:
    """Flat storage rows of ``indices`` (positions for stride-1 tensors, entry numbers otherwise)."""
    per_block = layout.rows_per_block(spec)
    table = torch.as_tensor(block_table, dtype=torch.long, device=indices.device)
    block_idx = indices // per_block
    if indices.numel() and int(block_idx.max()) >= len(table):
        raise IndexError(f"{spec.name}: row {int(indices.max())} is past the sequence's block table")
    blocks = table[block_idx]
    if indices.numel() and int(blocks.min()) < 0:
        raise IndexError(f"{spec.name}: a needed block of pool {spec.pool!r} was released")
    return blocks * per_block + indices % per_block
