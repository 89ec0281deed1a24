"""e4m3 -> bf16 for the FP8 GEMM kernels (``fp8_linear.py``), by bit placement on the integer pipes instead of the
hardware's conversion unit; plain-form checks in tests/gpu/test_fp8_linear.py."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_to_bf16(w):
    """e4m3 -> bf16, exact, by bit placement on the integer pipes: the hardware conversion goes e4m3 -> f16
    -> bf16 through the quarter-rate conversion unit (two conversions per weight), a large share of a decode
    GEMV's time (the layer's decode GEMMs are 11% faster without it: bench/results run 44).

    bf16 bits (sign << 15) | (exponent,mantissa << 4) are the e4m3 value times 2^-120 for every code (e4m3
    subnormals become bf16 subnormals with the same mantissa), and one bf16 multiply by 2^120 restores it.
    Four codes per 32-bit word; for each pair of bytes (0, 1) and (2, 3): one byte permute puts each byte in
    the low byte of a 16-bit half and its sign, replicated (``prmt``'s sign mode), in the high byte; a shift
    by 4 then brings sign, exponent and mantissa to their bf16 places at once, one mask (0x87F0 per half)
    clears the rest, and a packed multiply rescales: 4 instructions per 2 weights (6 before the sign byte:
    decode GEMMs ~6% faster, bench/results run 47).
    """
    return tl.inline_asm_elementwise(_E4M3_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)


def _e4m3_pair_asm(out: int, selector: str) -> str:
    """PTX for one bf16 pair of ``e4m3_to_bf16``: bytes (selector) of the input word -> output register."""
    return f"prmt.b32 a, $2, 0, {selector}; shl.b32 a, a, 4; and.b32 a, a, 0x87F087F0; mul.rn.bf16x2 ${out}, a, k; "


# Bytes 0 and 1 -> output register 0 (the first two weights), bytes 2 and 3 -> register 1; k = bf16 2^120 x 2.
_E4M3_ASM = tl.constexpr("{ .reg .b32 a, k; mov.b32 k, 0x7B807B80; " + _e4m3_pair_asm(0, "0x9180")
                         + _e4m3_pair_asm(1, "0xB3A2") + "}")
# The same with k from the second input (one word in, two bf16 pairs out).
_E4M3_MUL_ASM = tl.constexpr("{ .reg .b32 a, k; mov.b32 k, $3; " + _e4m3_pair_asm(0, "0x9180")
                             + _e4m3_pair_asm(1, "0xB3A2") + "}")


@triton.jit
def to_bf16(w, BITS: tl.constexpr):
    """e4m3 -> bf16: by bit placement (``BITS``, the default) or the hardware conversion (benchmarks)."""
    if BITS:
        return e4m3_to_bf16(w)
    return w.to(tl.bfloat16)


@triton.jit
def e4m3_words_to_bf16(w, mul):
    """int32 words of four e4m3 codes -> (bf16 pair of bytes 0 and 1, bf16 pair of bytes 2 and 3) as int32
    bits: ``e4m3_to_bf16`` with its final multiply by ``mul`` (bits of a bf16 pair: 2^120 times a power-of-two
    block scale), so that the scale costs nothing."""
    return tl.inline_asm_elementwise(_E4M3_MUL_ASM, "=r,=r,r,r", [w, mul], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def halves(p):
    """int32 bits of a bf16 pair -> (low, high) bf16 (a register reinterpretation, no instruction)."""
    return tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=1)
