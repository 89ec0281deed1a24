"""DeepSeek-V4.1's ratio-r compressor pooling in one launch: the twin of ``ops/ref/compress_pool_v41.py``.

The reference is a launch per op, a KV source a step (the gather of the rows, the softmax, the product, the sum,
the cast). Here one program per entry and block of channels reads the entry's r state rows (``rows[e]``, R a
constexpr) and computes torch's softmax over them in its order, per channel in fp32: the max, exp(s - max)
(libdevice's: the expf torch's CUDA softmax calls), their sum from the first row on, an IEEE division; then the
weighted values summed from the first row on and one rounding to the output dtype. With no contraction into FMAs
(``enable_fp_fusion=False``) that is the reference's arithmetic step for step. Where torch's sums could take
another order (r > 2) or its exp is another function (the CPU's vectorised one; numpy's stands in for libdevice's
in the interpreter), fp32 results differ in the last bit now and then, which moves a rounded bf16 value rarely.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.ops.triton.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_MAX = 512  # channels per program: V4.1's D = 512 is one program an entry, 4 fp32 a thread at 4 warps


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter runs no libdevice
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _row(state_ptr, rows_ptr, e, j, stride_r, stride_s):
    """Entry e's j-th state row (int64: a pool's rows times 2D channels passes 2^31)."""
    return state_ptr + tl.load(rows_ptr + e * stride_r + j).to(tl.int64) * stride_s


@triton.jit
def _pool_kernel(state_ptr, rows_ptr, out_ptr, D, stride_s, stride_r, stride_o, R: tl.constexpr,
                 BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    # Three passes over the r rows as torch's softmax makes them: the max, the sum of exp(s - max) from row 0 on,
    # then the weighted values summed. The repeated loads are the same addresses (the compiler keeps one of each)
    # and the recomputed exp gives the same bits.
    mx = tl.load(_row(state_ptr, rows_ptr, e, 0, stride_r, stride_s) + D + offs, mask=ok, other=0.0)
    for j in tl.static_range(1, R):
        mx = tl.maximum(mx, tl.load(_row(state_ptr, rows_ptr, e, j, stride_r, stride_s) + D + offs, mask=ok,
                                    other=0.0))
    den = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(R):
        s = tl.load(_row(state_ptr, rows_ptr, e, j, stride_r, stride_s) + D + offs, mask=ok, other=0.0)
        den += _exp(s - mx, INTERPRET)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(R):
        row = _row(state_ptr, rows_ptr, e, j, stride_r, stride_s)
        p = tl.div_rn(_exp(tl.load(row + D + offs, mask=ok, other=0.0) - mx, INTERPRET), den)
        acc += tl.load(row + offs, mask=ok, other=0.0) * p
    DT: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + e * stride_o + offs, round_to(acc, DT, INTERPRET).to(DT), mask=ok)


def pool(state: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entry e of [E, D]: state rows ``rows[e]``' values weighted by the softmax of their scores over the r rows."""
    assert state.dtype == torch.float32 and state.dim() == 2 and state.shape[1] % 2 == 0, \
        f"state {state.dtype} {tuple(state.shape)}"
    assert rows.dim() == 2 and not rows.dtype.is_floating_point, f"rows {rows.dtype} {tuple(rows.shape)}"
    assert dtype in (torch.bfloat16, torch.float16, torch.float32), dtype
    # A pool's channels are contiguous; copying the pool to make them so would cost more than the op.
    assert state.stride(1) == 1, "state needs unit stride along channels"
    e, r, d = rows.shape[0], rows.shape[1], state.shape[1] // 2
    out = torch.empty((e, d), dtype=dtype, device=state.device)
    if e == 0 or d == 0:  # a step where no token closes an entry
        return out
    assert r >= 1, "an entry pools at least one row"
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    block = min(BLOCK_MAX, triton.next_power_of_2(d))
    _pool_kernel[(e, triton.cdiv(d, block))](
        state, rows, out, d, state.stride(0), rows.stride(0), out.stride(0), R=r, BLOCK=block, INTERPRET=_INTERPRET,
        num_warps=4, enable_fp_fusion=False)
    return out
