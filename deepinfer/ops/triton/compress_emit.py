"""Compressor emit (gather, pool, RMSNorm, RoPE, store) in one Triton kernel; twin of ``ops/ref/compress_emit.py``.

Same signature and contract as the reference (see its module docstring)::

  compress_emit(state, slot_rows, entry_rows, out, norm_weight, eps, cos, sin, overlap) -> None

One program per token (grid = (T,)), and a token that closes no window (entry_rows[t] < 0) returns at once:
the launch shape depends on T only and nothing is read back to the host, so the op can be captured in a CUDA
graph over a padded batch. A program owns the whole entry (all W <= 512 channels, BLOCK_W = next_pow2(W)),
so the RMSNorm and the RoPE pairs need no cross-program step. It walks the window's NS slots in chunks of
BLOCK_S rows x BLOCK_W channels (about 4K fp32 values per tile, a function of (NS, W) only):
  pass 1  per-channel max of the gate;
  pass 2  per-channel sum of exp(gate - max);
  pass 3  weight = exp(gate - max) / sum rounded to out.dtype, product kv (rounded to out.dtype) x weight
          rounded to out.dtype, accumulated in fp32 in slot order and rounded to out.dtype once;
then RMSNorm (fp32 variance, fp32 weight multiply, one rounding) and the interleaved RoPE on the last
rope_dim channels (fp32 rotation of the rounded entry with the model-dtype cos/sin, one rounding). These are
the reference's rounding steps one for one: ``pool_windows`` multiplies two model-dtype tensors (the exact
product, rounded), and torch sums a bf16 tensor in fp32 and rounds once. Three passes rather than an online
softmax keep the sum exactly the reference's sum of exp(gate - final max); the gate tile of passes 2 and 3
is re-read from L1/L2. Slot rows are loaded, never dotted: no tl.dot anywhere.

Differences from the reference, all at fp32 rounding level (~1e-7 relative): tl.exp and tl.math.rsqrt are
the hardware approximations (a few fp32 ulps), the sums run in a different order, and the compiler may fuse
the RoPE multiply-adds. In bf16 these change a rounded weight, product or output by one bf16 ulp now and then.
Deterministic: a fixed reduction order per shape, no atomics, and a token's result does not depend on the
rest of the batch. Empty slots (-1) are masked loads with a large negative gate, so they get weight exactly
0; a channel with every slot empty (never the case for a real window) pools to 0 rather than NaN.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.compress_emit import check_compress_emit_args
from deepinfer.ops.triton.rounding import round_to

# Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest even: see ``ops/triton/rounding.py``.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Gate of an empty slot: finite, so max/exp never see (-inf) - (-inf); exp(NEG_INIT - max) == 0 exactly.
NEG_INIT: tl.constexpr = tl.constexpr(-1.0e30)
# fp32 values per [BLOCK_S, BLOCK_W] tile: 32 per thread at 4 warps, two tiles (kv, gate) live in pass 3.
TILE_ELEMS = 4096




@triton.jit
def _slot_tile(state_ptr, slot_base, s0, NS, HALF, W, stride_state, offs_s, offs_w, w_mask):
    """Pointers to the kv columns of slots [s0, s0 + BLOCK_S) and the mask of present (slot, channel) pairs.

    Slots at or past HALF read the second kv half (CSA "Cb": columns [W:2W]); the gate sits S columns on.
    """
    slots = s0 + offs_s
    rows = tl.load(slot_base + slots, mask=slots < NS, other=-1)
    ok = (rows >= 0)[:, None] & w_mask[None, :]
    col = tl.where(slots >= HALF, W, 0)
    ptrs = state_ptr + rows.to(tl.int64)[:, None] * stride_state + (col[:, None] + offs_w[None, :])
    return ptrs, ok


@triton.jit
def _compress_emit_kernel(
    state_ptr, slot_ptr, entry_ptr, out_ptr, nw_ptr, cos_ptr, sin_ptr,
    W, S, NS, HALF, ROPE_OFF, eps,
    stride_state, stride_slot, stride_out, stride_cos, stride_sin,
    BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    erow = tl.load(entry_ptr + t)
    if erow < 0:  # closes no window (or padding): read nothing, write nothing
        return
    DT: tl.constexpr = out_ptr.dtype.element_ty
    offs_w = tl.arange(0, BLOCK_W)
    offs_s = tl.arange(0, BLOCK_S)
    w_mask = offs_w < W
    slot_base = slot_ptr + t * stride_slot

    mx = tl.full([BLOCK_W], NEG_INIT, tl.float32)
    for s0 in range(0, NS, BLOCK_S):
        ptrs, ok = _slot_tile(state_ptr, slot_base, s0, NS, HALF, W, stride_state, offs_s, offs_w, w_mask)
        mx = tl.maximum(mx, tl.max(tl.load(ptrs + S, mask=ok, other=NEG_INIT), axis=0))
    den = tl.zeros([BLOCK_W], tl.float32)
    for s0 in range(0, NS, BLOCK_S):
        ptrs, ok = _slot_tile(state_ptr, slot_base, s0, NS, HALF, W, stride_state, offs_s, offs_w, w_mask)
        g = tl.load(ptrs + S, mask=ok, other=NEG_INIT)
        den += tl.sum(tl.exp(g - mx[None, :]), axis=0)
    acc = tl.zeros([BLOCK_W], tl.float32)
    for s0 in range(0, NS, BLOCK_S):
        ptrs, ok = _slot_tile(state_ptr, slot_base, s0, NS, HALF, W, stride_state, offs_s, offs_w, w_mask)
        g = tl.load(ptrs + S, mask=ok, other=NEG_INIT)
        kv = round_to(tl.load(ptrs, mask=ok, other=0.0), DT, INTERPRET)
        wgt = round_to(tl.exp(g - mx[None, :]) / den[None, :], DT, INTERPRET)
        # The product of two model-dtype values is exact in fp32; rounding it is the model-dtype multiply.
        acc += tl.sum(round_to(kv * wgt, DT, INTERPRET), axis=0)
    pooled = round_to(acc, DT, INTERPRET)  # padded channels (>= W) are exactly 0 and add nothing below

    # RMSNorm: fp32 variance over the W real channels, fp32 weight multiply, one rounding.
    var = tl.sum(pooled * pooled, axis=0) / W
    nw = tl.load(nw_ptr + offs_w, mask=w_mask, other=0.0).to(tl.float32)
    y = round_to(nw * (pooled * tl.math.rsqrt(var + eps)), DT, INTERPRET)

    # Interleaved RoPE: pair p = channels (2p, 2p+1); pairs from ROPE_OFF on rotate by angle p - ROPE_OFF.
    # Pairs before it get cos 1, sin 0, which leaves them bit-identical (already rounded, rounded again).
    ev, od = tl.split(tl.reshape(y, [BLOCK_W // 2, 2]))
    offs_p = tl.arange(0, BLOCK_W // 2)
    j = offs_p - ROPE_OFF
    r_mask = (j >= 0) & (offs_p < W // 2)
    c = tl.load(cos_ptr + t * stride_cos + j, mask=r_mask, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * stride_sin + j, mask=r_mask, other=0.0).to(tl.float32)
    res = tl.reshape(tl.join(ev * c - od * sn, od * c + ev * sn), [BLOCK_W])
    res = round_to(res, DT, INTERPRET)  # exact from here: the store's cast only narrows the container
    tl.store(out_ptr + erow.to(tl.int64) * stride_out + offs_w, res.to(DT), mask=w_mask)


def tiles(ns: int, w: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_W) from the shapes only (never from T), so the reduction order is fixed per layer."""
    block_w = triton.next_power_of_2(w)
    block_s = max(1, min(triton.next_power_of_2(ns), TILE_ELEMS // block_w))
    return block_s, block_w


def compress_emit(state: torch.Tensor, slot_rows: torch.Tensor, entry_rows: torch.Tensor, out: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  overlap: bool) -> None:
    """Write the entry of every window closed by a token of the batch into ``out`` (see module docstring)."""
    w, ns, rope_dim = check_compress_emit_args(state, slot_rows, entry_rows, out, norm_weight, cos, sin, overlap)
    t = slot_rows.shape[0]
    if t == 0:
        return
    assert state.stride(1) == 1 and out.stride(1) == 1, "state and out need unit stride along channels"
    assert cos.dtype == sin.dtype, (cos.dtype, sin.dtype)
    # No-ops for the usual contiguous inputs (tiny tensors otherwise); nothing here syncs with the device.
    slot_rows, entry_rows = slot_rows.contiguous(), entry_rows.contiguous()
    cos, sin, norm_weight = cos.contiguous(), sin.contiguous(), norm_weight.contiguous()
    block_s, block_w = tiles(ns, w)
    _compress_emit_kernel[(t,)](
        state, slot_rows, entry_rows, out, norm_weight, cos, sin,
        w, 2 * w if overlap else w, ns, ns // 2 if overlap else ns, (w - rope_dim) // 2, float(eps),
        state.stride(0), slot_rows.stride(0), out.stride(0), cos.stride(0), sin.stride(0),
        BLOCK_S=block_s, BLOCK_W=block_w, INTERPRET=_INTERPRET, num_warps=4,
    )
