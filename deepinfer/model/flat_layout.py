"""FlatLayout: where one step's token ids and step-index tensors sit in a single flat int64 buffer.

One buffer per step means one host-to-device copy (and, for a CUDA-graph bucket, one static device twin
whose views the graph reads); ``covering`` recognises such views again when an index is moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

_ALIGN = 64  # segment starts in a flat buffer, in int64s: 512 bytes, as if each tensor were allocated alone


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class FlatLayout:
    """Where one step's token ids and StepIndex tensors sit in a single flat int64 buffer.

    Segments: ids [T], token_seq [T], positions [T], seq_end [B], then the window, state and history tables
    [B, width], ``table_stride`` apart. Each starts on a multiple of ``_ALIGN``, so kernels see pointers as
    aligned as separately allocated tensors. The host builds a step into such a buffer and ships it with
    one copy; a captured graph reads views of its device twin. Works on numpy arrays and torch tensors
    alike (1-D slices, and reshapes of contiguous ones, are views in both).
    """

    num_tokens: int
    num_seqs: int
    width: int  # table columns: cdiv(span, block_size)

    @staticmethod
    @lru_cache(maxsize=256)
    def for_span(num_tokens: int, num_seqs: int, span: int, block_size: int) -> "FlatLayout":
        """The layout for tables of ``span`` positions (one instance per shape: its offsets are cached)."""
        return FlatLayout(num_tokens, num_seqs, -(-span // block_size))

    @cached_property
    def _starts(self) -> tuple[int, int, int, int, int]:
        """Where token_seq, positions, seq_end and the window table start; the tables' stride."""
        at = _aligned(self.num_tokens)
        return at, 2 * at, 3 * at, 3 * at + _aligned(self.num_seqs), _aligned(self.num_seqs * self.width)

    @property
    def table_stride(self) -> int:
        return self._starts[4]

    @property
    def size(self) -> int:
        return self._starts[3] + 3 * self._starts[4]

    def ids(self, flat):
        return flat[: self.num_tokens]

    def split(self, flat) -> tuple:
        """(token_seq, positions, seq_end, window_table, state_table, history_table) as views of ``flat``."""
        t, b, w = self.num_tokens, self.num_seqs, self.width
        ts, pos, end, first, stride = self._starts
        return (flat[ts : ts + t], flat[pos : pos + t], flat[end : end + b],
                flat[first : first + b * w].reshape(b, w),
                flat[first + stride : first + stride + b * w].reshape(b, w),
                flat[first + 2 * stride : first + 2 * stride + b * w].reshape(b, w))

    def table_block(self, flat):
        """The three tables and the gaps between them, 1-D: row i of table p starts at p * table_stride +
        i * width (one fill and one scatter reach them all)."""
        return flat[self._starts[3] : self.size]

    def tensors(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """StepIndex's tensor fields as views of ``flat``: ``dataclasses.replace(index, **layout.tensors(buf))``
        re-points a host-built index at the device buffer it is copied to."""
        token_seq, positions, seq_end, window, state, history = self.split(flat)
        return {"token_seq": token_seq, "positions": positions, "window_table": window, "state_table": state,
                "history_table": history, "seq_end": seq_end}


def covering(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
    """A 1-D view over the part of one storage that holds all ``tensors`` and its storage offset, when they
    are contiguous int64 views of one buffer; else None."""
    ptr = tensors[0].untyped_storage().data_ptr()
    if not all(t.dtype == torch.int64 and t.is_contiguous() and t.untyped_storage().data_ptr() == ptr
               for t in tensors):
        return None
    lo = min(t.storage_offset() for t in tensors)
    hi = max(t.storage_offset() + t.numel() for t in tensors)
    return tensors[0].as_strided((hi - lo,), (1,), lo), lo
