"""Packed FP4 expert weights inside the Triton kernels: their layouts and their in-register decoding.

Used by ``moe_experts.py`` (the grouped GEMM). Host side (plain torch, in ``ops/fp4_layout.py`` so that the
CPU can use it too; re-exported here): the K step of a reduction (``block_k``), the permuted K order inside
a step (``k_order``), the tile-major layout the model stores on the device (``tile_weights`` /
``expert_layout``) and the bit order inside each 32-bit word of codes (``place_codes``). Kernel side:
offsets of a step's tile in either layout, FP4 codes -> bf16 by bit placement (``dequant_fp4``),
activations in the same K order (``k_order_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import fp4_layout
from deepinfer.ops.fp4_layout import (  # noqa: F401  (the host side, re-exported for the kernels' callers)
    PLACED_DTYPE,
    block_k,
    expert_layout,
    k_order,
    place_codes,
    placed_from,
    tile_weights,
    unplace_codes,
)

# Rows per band of the tile-major weight layout (``fp4_layout.tile_weights``), as the kernels read it.
TILE_ROWS = tl.constexpr(fp4_layout.TILE_ROWS)


def logical_shape(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a stand-in with the checkpoint layout's shape and dtype, for argument checks; whether ``w`` is
    tiled). Placed codes (int32 words, ``place_codes``) stand in as the int8 bytes they replace."""
    if w.dtype == PLACED_DTYPE:
        w = torch.empty((), dtype=torch.int8, device=w.device).expand(*w.shape[:-1], w.shape[-1] * 4)
    if w.dim() != 5:
        return w, False
    e, bands, steps, rows, step_cols = w.shape
    return torch.empty((), dtype=w.dtype, device=w.device).expand(e, bands * rows, steps * step_cols), True


# ---- Placed codes (``fp4_layout.place_codes``): the decoding's masks and rotations, as the kernels read them.
PAIR_BITS = tl.constexpr(fp4_layout.PAIR_BITS)
_ROT1, _ROT2 = tl.constexpr(fp4_layout.ROT1), tl.constexpr(fp4_layout.ROT2)
_MUL_SRC = tl.constexpr(fp4_layout.MUL_SRC)
_MUL = tl.constexpr(fp4_layout.MUL)


@triton.jit
def _rotl(w, R: tl.constexpr):
    """Rotate uint32 left (one funnel shift, ``SHF.L.W``)."""
    return (w << R) | (w >> (32 - R))


@triton.jit
def _nibble_pairs(w, MAG_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """bf16 bit pairs of the nibbles a and a + 4 of each 32-bit word (see ``dequant_fp4``): a shift puts both
    magnitudes (bits 4a..4a+2 and 4a+16..) at bf16 bits 6..8 and 22..24, another both signs at 15 and 31."""
    mag = (w << MAG_SHIFT) if MAG_SHIFT >= 0 else (w >> -MAG_SHIFT)
    sign = w << SIGN_SHIFT
    return (mag & 0x01C001C0) | (sign & 0x80008000)


@triton.jit
def dequant_fp4(packed, scale, BN: tl.constexpr, BK: tl.constexpr, SCALE_U8: tl.constexpr,
                INTERPRET: tl.constexpr, PLACED: tl.constexpr = False):
    """Packed words int32 [BN, BK/8] (eight e2m1 codes per word, element 0 in the lowest nibble: the int8
    checkpoint layout read four bytes at a time; with ``PLACED``, their bits permuted by ``place_codes``)
    and scales [BN, BK/32] -> bf16 [BN, BK] with its columns in the kernels' K order (``k_order``): column
    2Q*i + 2q + t holds input 32q + 8(i // 4) + 4t + i % 4.

    Why that order: the MMA's register operand gives each thread pairs of adjacent columns, 8 apart, four
    threads side by side (the wgmma A fragment). In the natural order a thread's codes are scattered over
    the packed tile and are read from shared memory one byte per instruction; in this order each thread's
    32 weights of a row are one 16-byte run (one vector load, four words) and share one scale, and each bf16
    pair a thread holds is nibbles a and a + 4 of one word. The activations take the same order
    (``k_order_rows``), so the dot is the same sum, only its terms are added in another order, the same
    for every tile config and batch (BK depends on the model shape alone).

    Dequantization is done by bit placement, about two integer ops per weight, no table:
    * bf16 bits (sign << 15) | (magnitude << 6) put the e2m1 exponent in bf16's exponent field and its
      mantissa bit in bf16's top mantissa bit; that bf16 is the e2m1 value times 2^-126 for all 16 codes
      (0.5 becomes the bf16 subnormal 2^-127, which Hopper's bf16 multiply keeps).
    * Nibbles a and a + 4 of a word are 16 bits apart, like the halves of a bf16 pair, so one shift of the
      word places both magnitudes (6 - 4a) and one both signs (12 - 4a); two masks and an or finish the pair:
      15 integer ops per word.
    * ``PLACED`` codes (``place_codes``: the bits of each word permuted on the host, once) need 8: pair 0
      sits in place (one mask), pairs 1 and 2 are rotations of the word by 10 and 13 (a funnel shift and a
      mask each), pair 3's bits are masked and copied to three offsets at once by one multiply whose copies
      never overlap (so nothing carries), then masked again. No single move per pair can place all four
      (the pair's bit set does not tile the word under rotations or byte permutations), hence the multiply.
      In the decode tile this takes the gate/up loop from 461 to 348 instructions per K step.
    * One bf16 multiply by 2^126 * scale = 2^(e-1) then gives the exact weight. That factor must fit in
      bf16: scales <= 2 (UE8M0 bytes <= 128), far above any real expert weight's scale.
    """
    Q: tl.constexpr = BK // 32
    w = tl.reshape(packed, [BN, Q, 4]).to(tl.uint32, bitcast=True)
    if PLACED:
        p01 = tl.join(w & PAIR_BITS, _rotl(w, _ROT1) & PAIR_BITS)
        p23 = tl.join(_rotl(w, _ROT2) & PAIR_BITS, ((w & _MUL_SRC) * _MUL) & PAIR_BITS)
    else:
        p01 = tl.join(_nibble_pairs(w, 6, 12), _nibble_pairs(w, 2, 8))
        p23 = tl.join(_nibble_pairs(w, -2, 4), _nibble_pairs(w, -6, 0))
    pair = tl.reshape(tl.permute(tl.join(p01, p23), (0, 1, 2, 4, 3)), [BN, Q, 4, 4])  # (n, q, word, a)
    if SCALE_U8:  # 2^(e-1) as bf16 bits: exponent field e - 1 + 127
        e = scale.to(tl.uint8, bitcast=True).to(tl.uint32)
        m = ((e + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        m = (scale * 8.507059173023462e37).to(tl.bfloat16)  # scale * 2^126, exact for powers of two
    m = m[:, :, None, None]  # [BN, Q, 1, 1]: one scale per 32 inputs, i.e. per (row, q)
    if INTERPRET:
        # The interpreter neither multiplies bf16 tensors nor converts bf16 subnormals; the same bits read
        # as the upper half of an fp32 give the same (exact) values through numpy.
        lo = ((pair << 16).to(tl.float32, bitcast=True) * m.to(tl.float32)).to(tl.bfloat16)
        hi = ((pair & 0xFFFF0000).to(tl.float32, bitcast=True) * m.to(tl.float32)).to(tl.bfloat16)
    else:
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        lo, hi = lo * m, hi * m
    wt = tl.permute(tl.join(lo, hi), (0, 2, 3, 1, 4))  # (n, q, word, a, t) -> (n, word, a, q, t)
    return tl.reshape(wt, [BN, BK])


@triton.jit
def k_order_rows(a, BK: tl.constexpr, BM: tl.constexpr):
    """An activation tile [BK, BM] in input order -> its rows in ``dequant_fp4``'s column order."""
    Q: tl.constexpr = BK // 32
    a = tl.reshape(a, [Q, 4, 2, 4, BM])  # input 32q + 8 word + 4t + a
    return tl.reshape(tl.permute(a, (1, 3, 0, 2, 4)), [BK, BM])  # -> (word, a, q, t, m)


@triton.jit
def tile_offsets(offs_n, stride_n, COLS: tl.constexpr, TILED: tl.constexpr):
    """Offsets [BN, COLS] of rows ``offs_n``' first K step, COLS elements per row and step (packed words or
    scales); ``stride_n`` is the checkpoint layout's row stride. See ``tile_weights`` for the tiled layout."""
    cols = tl.arange(0, COLS)[None, :]
    if TILED:  # 64-row bands of stride_n * 64 elements; inside a band, step-major [64, COLS] blocks
        band, row = offs_n // TILE_ROWS, offs_n % TILE_ROWS
        return band[:, None] * (stride_n * TILE_ROWS) + row[:, None] * COLS + cols
    return offs_n[:, None] * stride_n + cols


@triton.jit
def tile_step(k0, BK: tl.constexpr, COLS: tl.constexpr, TILED: tl.constexpr):
    """Offset of the K step that starts at input k0 (a multiple of BK)."""
    if TILED:
        return (k0 // BK) * (TILE_ROWS * COLS)  # one [64, COLS] block per step
    return (k0 // BK) * COLS
