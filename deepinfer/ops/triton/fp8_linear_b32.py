"""FP8 linear with 32x32-block scales (DeepSeek-V4.1's dense weights) in Triton; twin of
``ops/ref/fp8_linear.fp8_linear(..., block=(32, 32))``.

y[M, N] = x[M, K] @ (w_e4m3[N, K] * scale[n // 32, k // 32]).T with bf16/fp32 activations, fp32 accumulation.

V4's kernel (``fp8_linear.py``) multiplies each 128-wide K block's partial product by one scale per 128 output
rows; with 32x32 blocks that would be sixteen scales per 128x128 tile, so this kernel scales the weight tile
itself instead: UE8M0 scales are powers of two, and e4m3 times a power of two is exact in bf16, so the scaled
tile is the dequantized weight bit for bit and one bf16 MMA per K step does the rest (non-power-of-two scales
are refused: they would round there). Each weight byte is read once, from HBM, as the stored FP8 code: half the
bytes of the dequantized bf16 weight that a plain GEMM reads, which is what decode is bound by. Per K step a
row's BLOCK_K / 32 scales are loaded once and broadcast over their 32 columns (BLOCK_K a multiple of 32). fp32 activations run fp32 dots
(``input_precision="ieee"``), as do interpreted runs (Triton's CPU interpreter mis-converts fp32 -> bf16).

A first version: no split over K and no swap-AB for decode (V4's kernel has both); tile shapes are a function
of (M bucket, N) only, so results are run-to-run deterministic and independent of the batch's other rows'
values.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SCALE_BLOCK = 32
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])
def _fp8_b32_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, group_n,
                    stride_xg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Grouped (block-diagonal) products: output columns [g * group_n, (g + 1) * group_n) read input group g
    # (a tile never straddles two groups: group_n is a multiple of BLOCK_N). Plain: group_n = N, one group.
    x_group = x_ptr + ((pid_n * BLOCK_N) // group_n).to(tl.int64) * stride_xg
    x_rows = x_group + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (offs_n // 32).to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32)
        # One scale per row and 32 columns: [BLOCK_N, BLOCK_K / 32] loads, broadcast over each 32 columns.
        offs_ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_rows + offs_ks[None, :], mask=n_ok[:, None] & (offs_ks * 32 < K)[None, :], other=0.0)
        w = tl.reshape(tl.reshape(w, [BLOCK_N, BLOCK_K // 32, 32]) * s[:, :, None], [BLOCK_N, BLOCK_K])
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode-sized M takes narrow N tiles, for enough programs on the SMs."""
    if m <= 16:
        return 16, 32 if n <= 8192 else 64, 128
    if m <= 64:
        return 64, 64, 64
    return 128, 128, 64


def check_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x: expected 2-D bf16/fp32 [M, K], got {x.dtype} {tuple(x.shape)}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight: expected float8_e4m3fn [N, K={x.shape[1]}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    want = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"scale: expected fp32 {want} (one per 32x32 block), got {scale.dtype} {tuple(scale.shape)}")


def fp8_linear_b32(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2_scales: bool = True
                   ) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype; ``scale`` fp32 multipliers [cdiv(N, 32), cdiv(K, 32)], every one a power
    of two (``pow2_scales``: the caller's word for it, as UE8M0 scales are; checked nowhere on the device)."""
    check_args(x, weight, scale)
    if not pow2_scales:
        raise ValueError("pow2_scales: the 32x32-block kernel folds the scales into bf16 weights, exact only for "
                         "power-of-two scales; allowed: True (UE8M0 checkpoints)")
    x, weight, scale = x.contiguous(), weight.contiguous(), scale.contiguous()
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = _tiles(m, n)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_b32_kernel[grid](x, weight, scale, y, m, n, x.shape[1], x.stride(0), weight.stride(0), scale.stride(0),
                          y.stride(0), n, 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          DOT_FP32=x.dtype == torch.float32 or _INTERPRET)
    return y


def fp8_linear_b32_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2_scales: bool = True
                           ) -> torch.Tensor:
    """Block-diagonal, one launch: x [G, M, K] -> [G, M, r] (a view of an [M, G * r] result), group g =
    ``fp8_linear_b32(x[g], weight[g*r:(g+1)*r], scale[g*r/32:(g+1)*r/32])``, the same tiles hence the same bits
    as those G launches; r a multiple of 32 (``ops/ref/fp8_linear.fp8_linear_b32_grouped``)."""
    g, m, k = x.shape
    n = weight.shape[0]
    r = n // g
    check_args(x[0], weight, scale)
    if not pow2_scales:
        raise ValueError("pow2_scales: the 32x32-block kernel folds the scales into bf16 weights, exact only for "
                         "power-of-two scales; allowed: True (UE8M0 checkpoints)")
    if n % g or r % SCALE_BLOCK:
        raise ValueError(f"weight: {n} rows in {g} groups of a multiple of {SCALE_BLOCK} rows expected")
    bm, bn, bk = _tiles(m, r)  # a group's own tiles: the bits of its own launch
    if r % bn:  # a tile would straddle two groups (small test shapes): a launch per group
        return torch.stack([fp8_linear_b32(x[i], weight[i * r:(i + 1) * r], scale[i * r // 32:(i + 1) * r // 32])
                            for i in range(g)])
    x = x if x.stride(2) == 1 else x.contiguous()  # any group and row strides (wo_a's input is a transpose)
    weight, scale = weight.contiguous(), scale.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _fp8_b32_kernel[grid](x, weight, scale, y, m, n, k, x.stride(1), weight.stride(0), scale.stride(0),
                              y.stride(0), r, x.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                              DOT_FP32=x.dtype == torch.float32 or _INTERPRET)
    return y.view(m, g, r).transpose(0, 1)
