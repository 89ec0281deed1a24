"""The FP4 expert weights' device layout, host side: plain torch, importable without Triton (the CPU can lay
out, check and time the same bytes the Triton kernels read; ``ops/triton/fp4_codes.py`` decodes them).

The K step of a reduction (``block_k``), the tile-major layout the model stores on the device
(``tile_weights`` / ``expert_layout``), the bit order inside each 32-bit word of codes (``place_codes``)
and the permuted K order inside a step (``k_order``). Every function here is separable over experts (dim 0):
laying out a stack of experts at once gives, expert for expert, what laying out each alone gives.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.ops.ref.moe_experts import FP4_GROUP

# Rows per band of the tile-major weight layout (``tile_weights``): one wgmma M tile.
TILE_ROWS = 64
# Placed codes (``place_codes``) are int32 words: their bytes alone no longer hold whole codes, and the
# dtype tells the launcher which decoding the kernels need.
PLACED_DTYPE = torch.int32
# The decoding's bit masks and rotations (``fp4_codes.dequant_fp4``, which holds them as tl.constexpr).
PAIR_BITS = 0x81C081C0  # a bf16 pair's sign and low exponent / top mantissa bits: 6-8, 15 (+16)
ROT1, ROT2 = 10, 13  # the rotations that give pairs 1 and 2
MUL_SRC = 0x001B001B  # pair 3's bits: 0, 1, 3, 4 (+16) ...
MUL = 4 + 128 + 4096  # ... copied to +2, +7 and +12 by one multiply (no copies overlap)


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
    rows = TILE_ROWS
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
    if codes.shape[1] % TILE_ROWS:
        return (place_codes(codes) if placed else codes), scales
    tiled = tile_weights(codes)
    return (place_codes(tiled) if placed else tiled), tile_weights(scales, per_element=FP4_GROUP)


# ---- Placed codes: each word's 32 bits reordered so that ``dequant_fp4`` gets its four bf16 pairs from
# 8 integer ops instead of 15 (see there). A fixed permutation of the bits of every 32-bit word.


@functools.cache
def placed_from() -> tuple[int, ...]:
    """src[s] = the checkpoint word's bit that bit s of a placed word holds. Pair a (nibbles a and a + 4,
    see ``dequant_fp4``) needs nibble a's magnitude at bf16 bits 6..8 and its sign at 15, nibble a + 4's at
    22..24 and 31 (the bits of PAIR_BITS); the kernel takes the pair as move_a(word) & PAIR_BITS, so that
    bit t of the pair comes from bit move_a^-1(t) of the placed word."""
    targets = [t for t in range(32) if PAIR_BITS >> t & 1]
    mul_src = [s for s in range(32) if MUL_SRC >> s & 1]
    src = [-1] * 32
    for a in range(4):
        for t in targets:
            code_bit = 4 * (a + 4 * (t >= 16)) + (t % 16 - 6 if t % 16 != 15 else 3)
            if a == 3:  # the one multiply copy of a pair-3 bit that lands inside PAIR_BITS
                (s,) = [s for s in mul_src if t - s in (2, 7, 12)]
            else:
                s = (t - (0, ROT1, ROT2)[a]) % 32
            assert src[s] < 0, "placement is not a permutation"
            src[s] = code_bit
    assert sorted(src) == list(range(32))
    return tuple(src)


# Words a bit permutation rewrites per pass: bounds its temporaries (one int32 tensor of this size beside
# the output) while keeping a GPU's launches few (each pass is about 30).
_PASS_WORDS = 1 << 24


@functools.cache
def _bit_moves(src: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The permutation ``src`` as (shift, mask) moves: bit s of the output is bit src[s] of the input, and
    bits that move by the same amount move together (one shift and one mask); shift > 0 moves left
    (mask over the input's bits), shift < 0 right (mask over the output's bits, which also drops what an
    arithmetic shift brings in)."""
    moves: dict[int, int] = {}
    for s, b in enumerate(src):
        d = s - b
        moves[d] = moves.get(d, 0) | (1 << (b if d >= 0 else s))
    return tuple((d, m - (1 << 32) if m >= 1 << 31 else m) for d, m in sorted(moves.items()))


def _permute_bits(words: torch.Tensor, src: tuple[int, ...]) -> torch.Tensor:
    """int32 words -> int32 words whose bit s is bit src[s] of the input: a few shifts and masks per word,
    over every expert at once (in passes of ``_PASS_WORDS`` words)."""
    out = torch.empty_like(words)
    flat_in, flat_out = words.view(-1), out.view(-1)
    moves, step = _bit_moves(src), _PASS_WORDS
    temp = torch.empty(min(step, flat_in.numel()), dtype=words.dtype, device=words.device)
    for lo in range(0, flat_in.numel(), step):
        w, o = flat_in[lo:lo + step], flat_out[lo:lo + step]
        for i, (d, mask) in enumerate(moves):
            t = o if i == 0 else temp[: len(w)]  # the first move writes the output, the others are or-ed in
            if d >= 0:
                torch.bitwise_and(w, mask, out=t).bitwise_left_shift_(d)
            else:
                torch.bitwise_right_shift(w, -d, out=t).bitwise_and_(mask)
            if i:
                o.bitwise_or_(t)
    return out


def place_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes, int8 [E, ..., K/2] in the checkpoint or the tile-major layout -> int32 words
    [E, ..., K/8], the same four bytes per word, their 32 bits permuted (``placed_from``) so that each
    bf16 pair of ``dequant_fp4`` comes out of at most three integer ops. The same weights, the same
    sums: results are bit-identical to the unplaced codes. The permutation stays inside each word, so it
    commutes with ``tile_weights``; little-endian words, as the kernels read them."""
    if codes.dtype not in (torch.int8, torch.uint8) or codes.shape[-1] % 4:
        raise ValueError(f"place_codes: expected int8 [E, ..., K/2] with K % 8 == 0, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    return _permute_bits(codes.contiguous().view(torch.int32), placed_from())


def unplace_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of ``place_codes``: int32 placed words -> the int8 codes they came from."""
    src = placed_from()
    inv = [0] * 32
    for s, b in enumerate(src):
        inv[b] = s
    return _permute_bits(words.contiguous(), tuple(inv)).view(torch.int8)


def k_order(bk: int) -> torch.Tensor:
    """The input index each column of a dequantized [*, bk] tile holds (see ``dequant_fp4``)."""
    q = bk // 32
    col = torch.arange(bk)
    t, grp, i = col % 2, (col // 2) % q, col // (2 * q)
    return 32 * grp + 8 * (i // 4) + 4 * t + i % 4
