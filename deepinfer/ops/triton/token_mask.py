"""Grammar token masks applied to logits in place, one launch; twin of ``ops/ref/token_mask.py`` (same
signature, same result bit for bit: only -inf is ever written).

One program per (constrained row, block of words): it reads each of its words once, expands them to bits in
registers and stores -inf at the cleared bits only (a masked store; allowed logits are neither read nor
written), so a row costs ceil(V/32) words read plus one write per forbidden token, and rows not in ``rows``
cost nothing. The unfused reference expands the bits through a [R, W, 32] int32 temporary and a bool copy
(~66 MB and several launches at R = 128, V = 129,280).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 64  # 2,048 tokens per program: 16 per thread at 4 warps


@triton.jit
def _token_mask_kernel(logits_ptr, words_ptr, rows_ptr, vocab, num_words, stride_l, stride_w,
                       BLOCK_W: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    words = tl.load(words_ptr + r.to(tl.int64) * stride_w + w, mask=w < num_words, other=-1)
    bit = tl.arange(0, 32)
    clear = ((words[:, None] >> bit[None, :]) & 1) == 0  # [BLOCK_W, 32]; sign-extending shift keeps bit k
    tok = w[:, None] * 32 + bit[None, :]
    ninf = tl.full((BLOCK_W, 32), float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + tok, ninf, mask=clear & (tok < vocab))


def token_mask(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    v = logits.shape[1]
    assert words.dtype == torch.int32 and words.dim() == 2 and words.shape[1] * 32 >= v, (words.dtype, words.shape, v)
    assert rows.shape == (len(words),), (rows.shape, words.shape)
    assert logits.stride(1) == 1 and words.stride(1) == 1, "token_mask: rows must be contiguous"
    if not len(words):
        return
    need = triton.cdiv(v, 32)  # words past the vocabulary hold no token: no program for them
    grid = (len(words), triton.cdiv(need, BLOCK_WORDS))
    _token_mask_kernel[grid](logits, words, rows, v, need, logits.stride(0), words.stride(0),
                             BLOCK_W=BLOCK_WORDS, num_warps=4)
