"""Compressor state write in one Triton kernel; twin of ``ops/ref/compress_state.py`` (same contract).

One program per (token, block of S columns): load the token's kv and gate columns from the projection,
widen to fp32, add the window-position bias to the gate and store both halves into the token's state row.
Pure data movement with one add: the result is bit-identical to the reference. The grid depends on T only,
so the op can be captured in a CUDA graph over a padded batch (padding tokens write a spare row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.compress_state import check_compress_state_args


@triton.jit
def _compress_state_kernel(proj_ptr, state_ptr, rows_ptr, ape_ptr, pos_ptr, col, S, m, stride_p, stride_s,
                           BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < S
    row = tl.load(rows_ptr + t).to(tl.int64)
    slot = tl.load(pos_ptr + t) % m
    src = proj_ptr + t.to(tl.int64) * stride_p + col + offs
    kv = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(src + S, mask=ok, other=0.0).to(tl.float32) + tl.load(ape_ptr + slot * S + offs, mask=ok)
    dst = state_ptr + row * stride_s + offs
    tl.store(dst, kv, mask=ok)
    tl.store(dst + S, gate, mask=ok)


def compress_state(proj: torch.Tensor, col: int, state: torch.Tensor, rows: torch.Tensor, ape: torch.Tensor,
                   positions: torch.Tensor) -> None:
    s = check_compress_state_args(proj, col, state, rows, ape, positions)
    assert proj.stride(1) == 1 and state.stride(1) == 1 and ape.is_contiguous(), "inner dims must be contiguous"
    t = proj.shape[0]
    if t == 0:
        return
    block = min(1024, triton.next_power_of_2(s))
    _compress_state_kernel[(t, triton.cdiv(s, block))](
        proj, state, rows.contiguous(), ape, positions.contiguous(), col, s, ape.shape[0], proj.stride(0),
        state.stride(0), BLOCK=block, num_warps=4)
