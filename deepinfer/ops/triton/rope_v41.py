"""DeepSeek-V4.1's rotary embedding from angles in one launch: the twin of ``ops/ref/rope_v41.py``.

The reference is ~10 launches a call (upcast, complex view, polar, multiply, real view, cast, a ``cat`` of the
nope and rope parts), and a V4.1 layer rotates 3 to 6 tensors (queries, window KV, the output's inverse, an
index source's queries, keys and entries). Here one program per token and block of heads reads the token's
fp32 angles, takes their cos and sin (libdevice's, the functions torch's CUDA cos / sin call), copies the nope
channels and rotates the last R: even' = e*c - o*s, odd' = o*c + e*s in fp32 (inverse: s -> -s), one rounding
to the activation dtype, as the reference's complex multiply (its products and sum rounded in fp32; CUDA's
complex multiply may contract them into an FMA, a last-bit fp32 difference before the one rounding). Out of
place: the input is not written.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TILE_ELEMS = 4096  # values per [BLOCK_H, BLOCK_W] tile (as ``rope_norm.py``'s)


@triton.jit
def _rope_kernel(x_ptr, ang_ptr, out_ptr, H, W, ROPE_OFF, stride_xt, stride_xh, stride_ot, stride_oh, stride_a,
                 INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    n_hb = tl.cdiv(H, BLOCK_H)
    t = (pid // n_hb).to(tl.int64)
    offs_h = ((pid % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    mask = (offs_h < H)[:, None] & (offs_w < W)[None, :]
    x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_w[None, :], mask=mask,
                other=0.0).to(tl.float32)
    # Pair p = channels (2p, 2p+1); pairs from ROPE_OFF on rotate by angle p - ROPE_OFF.
    ev, od = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_W // 2, 2]))
    p = tl.arange(0, BLOCK_W // 2)
    j = p - ROPE_OFF
    r_mask = (j >= 0) & (p < W // 2)
    a = tl.load(ang_ptr + t * stride_a + j, mask=r_mask, other=0.0)
    c = tl.cos(a)[None, :]
    s = tl.sin(a)[None, :]
    if INVERSE:
        s = -s
    e2 = tl.where(r_mask[None, :], ev * c - od * s, ev)
    o2 = tl.where(r_mask[None, :], od * c + ev * s, od)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    y = round_to(tl.reshape(tl.join(e2, o2), [BLOCK_H, BLOCK_W]), DT, INTERPRET)
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_w[None, :], y.to(DT), mask=mask)


def apply_rope(values: torch.Tensor, ang: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * ang.shape[-1] channels of values [T, C] or [T, heads, C] by ang [T, R/2] (fp32); a
    new tensor (values untouched)."""
    assert ang.dim() == 2 and ang.shape[0] == values.shape[0], f"ang {tuple(ang.shape)} values {tuple(values.shape)}"
    assert values.dtype in (torch.bfloat16, torch.float16, torch.float32), values.dtype
    t, w, r = values.shape[0], values.shape[-1], 2 * ang.shape[-1]
    assert w % 2 == 0 and 0 < r <= w, f"values {tuple(values.shape)}: {r} rope channels"
    if values.numel() == 0:  # a step with no such rows (e.g. no entry closes): nothing to rotate
        return torch.empty_like(values)
    x = values.reshape(t, -1, w)
    x = x if x.stride(2) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=values.dtype, device=values.device)
    ang = ang.float().contiguous()
    h = x.shape[1]
    if t * h:
        block_w = max(2, triton.next_power_of_2(w))
        block_h = max(1, min(triton.next_power_of_2(h), TILE_ELEMS // block_w))
        _rope_kernel[(t * triton.cdiv(h, block_h),)](
            x, ang, out, h, w, (w - r) // 2, x.stride(0), x.stride(1), out.stride(0), out.stride(1), ang.stride(0),
            INVERSE=inverse, BLOCK_H=block_h, BLOCK_W=block_w, INTERPRET=_INTERPRET,
            num_warps=min(16, max(4, block_h * block_w // 1024)), enable_fp_fusion=False)
    return out.view(values.shape)
