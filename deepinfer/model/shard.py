"""Which part of a checkpoint tensor one rank owns, and where that part lies in the stored (quantized) tensors.

A sharded module says what it owns per parameter, and the loader reads only that part from disk
(``safe_open(...).get_slice``), never the whole tensor:
  * ``Shard(dim, index, count)``: the ``index``-th of ``count`` equal slices along ``dim`` of the weight's
    logical shape (rows: a column-parallel linear; columns: a row-parallel one). Set by a module as
    ``param_shards = {"weight": Shard(...)}`` (the module's parameter already has the slice's shape).
  * an owned expert range: ``FusedFP4Experts(..., owned=range(lo, hi))`` holds experts lo..hi-1 only, and
    every other expert's tensors are skipped (``SKIP``) without being read.
For FP8 and FP4 weights a slice of the logical [N, K] weight maps to a slice of the codes and of the scale
grid; it must start on a scale block boundary (128-row/128-column FP8 blocks, 32-input FP4 groups) so that
each rank's scales are whole, else the error names the tensor and the shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from deepinfer.model.quant import FP4_GROUP


@dataclass(frozen=True)
class Shard:
    dim: int
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count or self.dim < 0:
            raise ValueError(f"Shard: need dim >= 0 and 0 <= index < count, got {self}")

    def bounds(self, size: int, what: str) -> tuple[int, int]:
        if size % self.count:
            raise ValueError(f"{what}: dimension {self.dim} of size {size} does not split into {self.count} "
                             "equal shards")
        step = size // self.count
        return self.index * step, (self.index + 1) * step


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP: Final = _Skip()  # a selection: this rank holds no part of the tensor; it is not read
Selection = Shard | _Skip | None  # None: the whole tensor


def _index(dim: int, lo: int, hi: int) -> tuple[slice, ...]:
    return (*(slice(None),) * dim, slice(lo, hi))


def plain_index(shape: tuple[int, ...], shard: Shard | None, what: str) -> tuple[slice, ...]:
    """Index of the shard in a plain (unquantized) tensor; () for the whole tensor."""
    if shard is None:
        return ()
    if shard.dim >= len(shape):
        raise ValueError(f"{what}: cannot shard dimension {shard.dim} of a {len(shape)}-D tensor")
    return _index(shard.dim, *shard.bounds(shape[shard.dim], what))


def _per_scale(fmt: str, block: tuple[int, int], dim: int) -> int:
    return block[dim] if fmt == "fp8" else (1, FP4_GROUP)[dim]


def on_scale_blocks(fmt: str, shape: tuple[int, ...], block: tuple[int, int], shard: Shard, what: str) -> bool:
    """Whether ``shard`` of a logical [N, K] FP8/FP4 weight starts and ends on its scale blocks, so that the
    rank's codes come with whole scales (else it can only hold the dequantized slice: tiny test shapes).
    A shard that does not divide the dimension, or of another dimension, is an error, not a False."""
    if shard.dim > 1:
        raise ValueError(f"{what}: cannot shard dimension {shard.dim} of a 2-D weight")
    lo, hi = shard.bounds(shape[shard.dim], what)
    per_scale = _per_scale(fmt, block, shard.dim)
    return not (lo % per_scale or (hi % per_scale and hi != shape[shard.dim]))


def quantized_index(fmt: str, shape: tuple[int, ...], block: tuple[int, int], shard: Shard | None,
                    what: str) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """(codes index, scale index) of the shard of a logical [N, K] FP8 or FP4 weight."""
    if shard is None:
        return (), ()
    aligned = on_scale_blocks(fmt, shape, block, shard, what)
    lo, hi = shard.bounds(shape[shard.dim], what)
    per_scale = _per_scale(fmt, block, shard.dim)
    if not aligned:
        raise ValueError(f"{what}: shard {shard} splits dimension {shard.dim} at {lo}..{hi}, not on its "
                         f"{per_scale}-wide scale blocks")
    scale = _index(shard.dim, lo // per_scale, -(-hi // per_scale))
    if fmt == "fp4" and shard.dim == 1:  # two codes per byte along the input dimension
        return _index(1, lo // 2, hi // 2), scale
    return _index(shard.dim, lo, hi), scale


def whole_shape(part: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    """The logical shape of the tensor that ``shard`` of it has shape ``part``."""
    if shard is None:
        return part
    return tuple(n * shard.count if d == shard.dim else n for d, n in enumerate(part))
