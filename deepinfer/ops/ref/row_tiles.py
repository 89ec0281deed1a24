"""Batch-invariant CPU GEMMs: every row is computed in a tile of a fixed number of rows.

A CPU BLAS picks its blocking, its packing and its threading from the whole problem, so one row of
``x @ w.T`` changes in its last bits with the number of rows M next to it (measured: row 0 alone vs in a
batch of 64 differs by ~8e-5 through a 4096x1024 fp32 weight). Cutting x into tiles of ``ROW_TILE`` rows,
zero-padding the last one, and running every tile as its own [ROW_TILE, K] x [K, N] product (one batched
GEMM over the tiles) makes each row's result a function of the row alone: every tile is the same problem,
so it gets the same kernel and the same reduction order over K, wherever the row sits and however many
rows there are (tests/unit/test_batch_invariant_ops.py checks every M and offset it tries bit for bit).

The cost is the padding (a decode step of one token computes ROW_TILE rows) and a batched GEMM in place
of one large one; the default mode keeps the plain ``F.linear``.
"""

from __future__ import annotations

import torch

ROW_TILE = 16  # rows per GEMM tile: the one tile shape every row of a batch-invariant GEMM goes through


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [ceil(M / ROW_TILE), ROW_TILE, K], the last tile padded with zero rows."""
    m, k = x.shape
    pad = -m % ROW_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    tiles = x.reshape(-1, ROW_TILE, k)
    # The rule this module exists for: the GEMM below only ever sees whole tiles of ROW_TILE rows.
    assert tiles.shape[1] == ROW_TILE and tiles.shape[0] * ROW_TILE == m + pad, (tuple(x.shape), ROW_TILE)
    return tiles


def tiled_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] -> [M, N] in x's dtype, row by row independent of M (fixed row tiles)."""
    assert x.dim() == 2 and weight_t.dim() == 2 and x.shape[1] == weight_t.shape[0], (
        f"tiled_matmul: x {tuple(x.shape)} and weight_t {tuple(weight_t.shape)} do not chain")
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, weight_t.shape[1])
    tiles = _tiles(x)
    out = torch.bmm(tiles, weight_t.unsqueeze(0).expand(tiles.shape[0], -1, -1))
    return out.reshape(-1, weight_t.shape[1])[:m]


def tiled_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for x [..., K], weight [N, K], computed in fixed row tiles."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], (
        f"tiled_linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    assert x.dtype == weight.dtype, f"tiled_linear: x is {x.dtype}, weight {weight.dtype} (no implicit casts)"
    lead = x.shape[:-1]
    out = tiled_matmul(x.reshape(-1, x.shape[-1]), weight.t())
    return out.reshape(*lead, weight.shape[0])


def tiled_grouped(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Block-diagonal projection x [G, T, in] -> [G, T, r], group g through weight rows [g*r, (g+1)*r),
    each group's rows in fixed row tiles (the batch-invariant twin of ``ops/ref/linear.dense_grouped``)."""
    g, _, k = x.shape
    assert weight.dim() == 2 and weight.shape[1] == k and weight.shape[0] % g == 0, (
        f"tiled_grouped: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    assert x.dtype == weight.dtype, f"tiled_grouped: x is {x.dtype}, weight {weight.dtype} (no implicit casts)"
    r = weight.shape[0] // g
    w = weight.view(g, r, k)
    return torch.stack([tiled_matmul(x[i], w[i].t()) for i in range(g)])


# ---- element-wise functions on whole vector blocks -------------------------------------------------------
# torch's CPU kernels run an element-wise function over a contiguous buffer in vector blocks and finish the
# last partial block with scalar code, and split a buffer of more than ``PIECE`` elements across threads at
# points that follow its length. The scalar (and vector) versions of sigmoid, SiLU, softplus, exp, cos, ...
# round differently, so an element's bits depended on where the buffer (the batch) ended. Measured here:
# sigmoid of row 0 of a [2, 24] tensor differs from the same row in a [483, 24] one.
LANE_BLOCK = 128  # elements: a multiple of every vector block torch uses (2 x 64 bytes for bf16 on AVX-512)
PIECE = 32768  # at::internal::GRAIN_SIZE: below it an element-wise kernel runs on one thread


def whole_lanes(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise ``fn``, computed on zero-padded whole LANE_BLOCKs, in PIECE-element
    pieces (each on one thread), so every element goes through the same vector code wherever it sits."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % LANE_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    pieces = [fn(p) for p in flat.split(PIECE)]
    assert all(p.numel() % LANE_BLOCK == 0 for p in pieces), "element-wise pieces must be whole lane blocks"
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[:n].view(x.shape)
