"""Both expert GEMMs of ``moe_experts.py`` in one launch: programs pull tiles from a queue, and a down tile
waits until its m-block's gate/up tiles are done (the ``TileConfig.one_launch`` form of kernels 1 and 2).

Why: in the two-launch form, kernel 1's last wave runs on a partly idle GPU (a gate/up tile streams 256-512 KB
of codes, tens of µs per program at decode sizes) and kernel 2 starts from nothing after it. Here the
programs that run out of gate/up tiles go on to the down tiles of m-blocks already finished, so the second
GEMM fills the first one's tail, and the launch between them goes. Each tile runs the same code
(``gate_up_tile`` / ``matmul_tile``) on the same data as in the two-launch form, so the results are the same
bits and batch invariance is untouched; only which program runs a tile, and when, differs.

Protocol: one program per tile; int32 counters per device and lane, all zero between calls:
  queue     a program's first act takes the next tile: tiles 0 .. B*n1 - 1 are gate/up tiles (m-block
            major), then B*n2 down tiles. Taken in the order programs start, not by block index, which the
            hardware does not promise to start in order;
  done[mb]  gate/up tiles of m-block mb finished (a release after the tile's h stores and a CTA barrier).
A down tile of m-block mb waits until done[mb] == n1 (acquire), then reads h through L2 (".cg").
No deadlock: by the time a program holds a down tile, every gate/up tile has been taken by a program that
is running, and gate/up tiles wait on nothing. The combine kernel, next in stream order, zeroes the
counters for the next call or graph replay (``reset_counters``).
One program per tile rather than a persistent loop over tiles: inside a loop the compiler keeps both tiles'
state live at once (239 registers for the 128-row decode tiles, 2 programs per SM; 179 without the loop,
and 168 with a cap and no spills, 3 programs per SM).
Where every tile starts at once (a single decode token: 384 tiles for 396 program slots) nothing is left to
fill, and the waiting programs only compete with the working ones: the table keeps two launches there. An
L2 prefetch of a waiting down tile's weights measured no gain (bench/results/README.md, run 62).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import lanes
from deepinfer.ops.triton.moe_tiles import block_rows, gate_up_tile, matmul_tile

MAX_BLOCKS = 1 << 16

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """[1 + MAX_BLOCKS] int32 (the queue, then done per m-block), zero between calls, per device and lane
    (``ops/lanes.py``: two calls on two streams must not share counters). Allocated on first use, which
    precedes any graph capture (capture always follows a warm-up run)."""
    key = (device, lanes.current())
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1 + MAX_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


@triton.jit(do_not_specialize=["num_blocks"])
def _experts_kernel(
    x_ptr, w13_ptr, s13_ptr, h_ptr, w2_ptr, s2_ptr, y_ptr, pair_ptr, expert_ptr, counter_ptr,
    num_blocks, H, I,
    stride_x, stride_we1, stride_wn1, stride_se1, stride_sn1, stride_h,
    stride_we2, stride_wn2, stride_se2, stride_sn2, stride_y,
    limit, topk,
    SCALE_U8: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr, BM: tl.constexpr,
    BN1: tl.constexpr, BN2: tl.constexpr, BK1: tl.constexpr, BK2: tl.constexpr,
    W_TILED1: tl.constexpr, S_TILED1: tl.constexpr, W_PLACED1: tl.constexpr,
    W_TILED2: tl.constexpr, S_TILED2: tl.constexpr, W_PLACED2: tl.constexpr,
):
    done_ptr = counter_ptr + 1
    n1 = tl.cdiv(I, BN1)
    n2 = tl.cdiv(H, BN2)
    up_tiles = num_blocks * n1
    t = tl.atomic_add(counter_ptr, 1, sem="relaxed")  # this program's tile, in the order programs start
    if t < up_tiles:
        mb = t // n1
        e, pair = block_rows(pair_ptr, expert_ptr, mb, BM)
        if e >= 0:
            gate_up_tile(x_ptr, w13_ptr, s13_ptr, h_ptr, e, pair, t % n1, H, I, stride_x, stride_we1, stride_wn1,
                         stride_se1, stride_sn1, stride_h, limit, topk, SCALE_U8, SPLIT, INTERPRET, BM, BN1, BK1,
                         W_TILED1, S_TILED1, W_PLACED1)
        tl.debug_barrier()  # every thread's h stores before the signal (the release covers them)
        tl.atomic_add(done_ptr + mb, 1, sem="release")
    else:
        u = t - up_tiles
        mb = u // n2
        nb = u % n2
        e, pair = block_rows(pair_ptr, expert_ptr, mb, BM)
        if e >= 0:
            while tl.atomic_add(done_ptr + mb, 0, sem="acquire") < n1:
                pass
            matmul_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, e, pair, nb, 0, I, H, stride_h, stride_we2, stride_wn2,
                        stride_se2, stride_sn2, stride_y, 1, I, 0, SCALE_U8, SPLIT, INTERPRET, BM, BN2, BK2, 1,
                        W_TILED2, S_TILED2, W_PLACED2, ".cg")


def launch_one(x, w13, s13, hid, w2, s2, y, pair_of_row, expert_of_block, limit: float, k: int, cfg,
               *, scale_u8: bool, split: int, interpret: bool, bk1: int, bk2: int, tiled, placed) -> torch.Tensor:
    """Kernels 1 and 2 of ``moe_experts_fp4_with_config`` as one launch; same arguments, same outputs.
    Returns the counters, which the caller's next kernel in stream order must zero (``reset_counters``)."""
    t, h = x.shape
    inter = hid.shape[1]
    num_blocks = expert_of_block.numel()
    if num_blocks > MAX_BLOCKS:
        raise ValueError(f"one_launch: {num_blocks} m-blocks, at most {MAX_BLOCKS}")
    (tiled1, s_tiled1, tiled2, s_tiled2), (placed1, placed2) = tiled, placed
    tiles = num_blocks * (triton.cdiv(inter, cfg.block_n1) + triton.cdiv(h, cfg.block_n2))
    counters = _counters(x.device)
    _experts_kernel[(tiles,)](
        x, w13, s13, hid, w2, s2, y, pair_of_row, expert_of_block, counters,
        num_blocks, h, inter,
        x.stride(0), w13.stride(0), h // 8, s13.stride(0), h // 32, hid.stride(0),
        w2.stride(0), inter // 8, s2.stride(0), inter // 32, y.stride(1),
        float(limit), k,
        SCALE_U8=scale_u8, SPLIT=split, INTERPRET=interpret, BM=cfg.block_m, BN1=cfg.block_n1, BN2=cfg.block_n2,
        BK1=bk1, BK2=bk2, W_TILED1=tiled1, S_TILED1=s_tiled1, W_PLACED1=placed1, W_TILED2=tiled2,
        S_TILED2=s_tiled2, W_PLACED2=placed2,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs,
    )
    return counters[: 1 + num_blocks]


@triton.jit
def reset_counters(counter_ptr, n):
    """Zero the ``n`` counters of the last ``_experts_kernel`` launch; called by one program of the kernel
    that follows it in stream order (the combine), so that zeroing costs no launch of its own."""
    for b0 in range(0, n, 1024):
        offs = b0 + tl.arange(0, 1024)
        tl.store(counter_ptr + offs, tl.zeros([1024], tl.int32), mask=offs < n)
