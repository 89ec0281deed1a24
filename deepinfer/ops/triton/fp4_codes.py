"""Packed FP4 expert weights inside the Triton kernels: their layouts and their in-register decoding.

Used by ``moe_experts.py`` (the grouped GEMM). Host side: the K step of a reduction (``block_k``), the
permuted K order inside a step (``k_order``) and the tile-major layout the model stores on the device
(``tile_weights`` / ``expert_layout``) and the bit order inside each 32-bit word of codes (``place_codes``).
Kernel side: offsets of a step's tile in either layout, FP4 codes -> bf16 by bit placement
(``dequant_fp4``), activations in the same K order (``k_order_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.moe_experts import FP4_GROUP

# Rows per band of the tile-major weight layout (``tile_weights``): one wgmma M tile.
TILE_ROWS = tl.constexpr(64)
# Placed codes (``place_codes``) are int32 words: their bytes alone no longer hold whole codes, and the
# dtype tells the launcher which decoding the kernels need.
PLACED_DTYPE = torch.int32


def block_k(dim: int) -> int:
    """The reduction step over ``dim``: depends on the model shape only (fixed reduction order)."""
    return next(bk for bk in (128, 64, 32) if dim % bk == 0)


def tile_weights(w: torch.Tensor, per_element: int = 2) -> torch.Tensor:
    """Rows of K-ordered elements [E, N, K/per_element] (the checkpoint layout) -> the same elements
    tile-major, [E, N/64, K/BK, 64, BK/per_element]: each program's K step (64 rows x BK/per_element
    elements) becomes one contiguous block. Packed codes (int8, two inputs per element) by default;
    ``per_element=32`` tiles their scales (one per 32 inputs, UE8M0 bytes or fp32).

    Why: in the checkpoint layout a K step reads 64 bytes from each of 64 rows 2 KB apart; a streaming read
    in that pattern reached ~3.1 TB/s on the H200, the same bytes in contiguous 4 KB blocks ~4.4 TB/s
    (bench/kernels/bench_stream.py, bench/results/README.md run 29). A step's scales likewise become one
    256-byte block instead of 64 pieces of 4 bytes. Same values, same sums: results are bit-identical to the
    checkpoint layout. Needs N % 64 == 0.
    """
    rows = TILE_ROWS.value
    if w.dim() != 3 or w.shape[1] % rows:
        raise ValueError(f"tile_weights: expected [E, N, K/{per_element}] with N % {rows} == 0, "
                         f"got {tuple(w.shape)}")
    e, n, cols = w.shape
    bk = block_k(cols * per_element)
    return w.view(e, n // rows, rows, cols * per_element // bk, bk // per_element).transpose(2, 3).contiguous()


def expert_layout(codes: torch.Tensor, scales: torch.Tensor, placed: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op table's ``fp4_expert_layout``: codes and scales tile-major where the shape allows
    (N % 64 == 0), else as they are; the codes' bits pre-placed for decoding (``place_codes``, int32 words)
    unless ``placed`` is False."""
    if codes.shape[1] % TILE_ROWS.value:
        return (place_codes(codes) if placed else codes), scales
    tiled = tile_weights(codes)
    return (place_codes(tiled) if placed else tiled), tile_weights(scales, per_element=FP4_GROUP)


def logical_shape(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a stand-in with the checkpoint layout's shape and dtype, for argument checks; whether ``w`` is
    tiled). Placed codes (int32 words, ``place_codes``) stand in as the int8 bytes they replace."""
    if w.dtype == PLACED_DTYPE:
        w = torch.empty((), dtype=torch.int8, device=w.device).expand(*w.shape[:-1], w.shape[-1] * 4)
    if w.dim() != 5:
        return w, False
    e, bands, steps, rows, step_cols = w.shape
    return torch.empty((), dtype=w.dtype, device=w.device).expand(e, bands * rows, steps * step_cols), True


# ---- Placed codes: each word's 32 bits reordered so that ``dequant_fp4`` gets its four bf16 pairs from
# 8 integer ops instead of 15 (see there). A fixed permutation of the bits of every 32-bit word.
PAIR_BITS = tl.constexpr(0x81C081C0)  # a bf16 pair's sign and low exponent / top mantissa bits: 6-8, 15 (+16)
_ROT1, _ROT2 = tl.constexpr(10), tl.constexpr(13)  # the rotations that give pairs 1 and 2
_MUL_SRC = tl.constexpr(0x001B001B)  # pair 3's bits: 0, 1, 3, 4 (+16) ...
_MUL = tl.constexpr(4 + 128 + 4096)  # ... copied to +2, +7 and +12 by one multiply (no copies overlap)


def _placed_from() -> list[int]:
    """src[s] = the checkpoint word's bit that bit s of a placed word holds. Pair a (nibbles a and a + 4,
    see ``dequant_fp4``) needs nibble a's magnitude at bf16 bits 6..8 and its sign at 15, nibble a + 4's at
    22..24 and 31 (the bits of PAIR_BITS); the kernel takes the pair as move_a(word) & PAIR_BITS, so that
    bit t of the pair comes from bit move_a^-1(t) of the placed word."""
    targets = [t for t in range(32) if PAIR_BITS.value >> t & 1]
    mul_src = [s for s in range(32) if _MUL_SRC.value >> s & 1]
    src = [-1] * 32
    for a in range(4):
        for t in targets:
            code_bit = 4 * (a + 4 * (t >= 16)) + (t % 16 - 6 if t % 16 != 15 else 3)
            if a == 3:  # the one multiply copy of a pair-3 bit that lands inside PAIR_BITS
                (s,) = [s for s in mul_src if t - s in (2, 7, 12)]
            else:
                s = (t - (0, _ROT1.value, _ROT2.value)[a]) % 32
            assert src[s] < 0, "placement is not a permutation"
            src[s] = code_bit
    assert sorted(src) == list(range(32))
    return src


def _permute_bits(words: torch.Tensor, src: list[int]) -> torch.Tensor:
    """int32 words -> int32 words whose bit s is bit src[s] of the input; one 256-entry table per byte."""
    dst = [0] * 32
    for s, b in enumerate(src):
        dst[b] = s
    lut = torch.tensor([[sum(1 << dst[8 * j + i] for i in range(8) if v >> i & 1) for v in range(256)]
                        for j in range(4)], dtype=torch.int64)
    lut = torch.where(lut >= 2**31, lut - 2**32, lut).to(torch.int32).to(words.device)
    out = torch.empty_like(words)
    for e in range(words.shape[0]):  # one expert at a time: the byte indices are 8x the codes' size
        b = words[e].contiguous().view(torch.uint8).view(*words.shape[1:], 4).long()
        out[e] = lut[0][b[..., 0]] | lut[1][b[..., 1]] | lut[2][b[..., 2]] | lut[3][b[..., 3]]
    return out


def place_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes, int8 [E, ..., K/2] in the checkpoint or the tile-major layout -> int32 words
    [E, ..., K/8], the same four bytes per word, their 32 bits permuted (``_placed_from``) so that each
    bf16 pair of ``dequant_fp4`` comes out of at most three integer ops. The same weights, the same
    sums: results are bit-identical to the unplaced codes. The permutation stays inside each word, so it
    commutes with ``tile_weights``; little-endian words, as the kernels read them."""
    if codes.dtype not in (torch.int8, torch.uint8) or codes.shape[-1] % 4:
        raise ValueError(f"place_codes: expected int8 [E, ..., K/2] with K % 8 == 0, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    return _permute_bits(codes.contiguous().view(torch.int32), _placed_from())


def unplace_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of ``place_codes``: int32 placed words -> the int8 codes they came from."""
    src = _placed_from()
    inv = [0] * 32
    for s, b in enumerate(src):
        inv[b] = s
    return _permute_bits(words.contiguous(), inv).view(torch.int8)


def k_order(bk: int) -> torch.Tensor:
    """The input index each column of a dequantized [*, bk] tile holds (see ``dequant_fp4``)."""
    q = bk // 32
    col = torch.arange(bk)
    t, grp, i = col % 2, (col // 2) % q, col // (2 * q)
    return 32 * grp + 8 * (i // 4) + 4 * t + i % 4


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
