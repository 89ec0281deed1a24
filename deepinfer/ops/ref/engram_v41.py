"""DeepSeek-V4.1's Engram lookup (spec §2.2): the n-gram hash of each token's lookback and the gather of its table
rows from the stored FP8 codes. The twin of ``ops/triton/engram_v41.py``.

    hash_rows(lookback [Q, N] int64 (-1: before position 0), token_map [V], pad_id, multipliers [L, N],
              primes [L, (N-1)*heads], offsets [L, (N-1)*heads], heads) -> rows [Q, L, (N-1)*heads] int64
    gather_rows(codes [R, C] e4m3 (or its uint8 view), scales [R, C/32] UE8M0 bytes (uint8 or float8_e8m0fnu),
                rows [..., K] int64, dtype) -> [..., K*C] in dtype

``gather_rows`` dequantizes as the checkpoint loader does (``loader.dequantize``: e4m3 x 2^(e-127) in fp32), then
casts once, so its rows are the plain model's dequantized table rows bit for bit.
"""

from __future__ import annotations

import torch

from deepinfer.model.quant import dequant_fp8_block
from deepinfer.model.v41.names import ENGRAM_TABLE_BLOCK


def hash_rows(lookback: torch.Tensor, token_map: torch.Tensor, pad_id: int, multipliers: torch.Tensor,
              primes: torch.Tensor, offsets: torch.Tensor, heads: int) -> torch.Tensor:
    # A shift before position 0 is the pad id; positions only decrease with the shift, so once a shift is
    # blocked every longer one is too.
    tokens = torch.where(lookback < 0, pad_id, token_map[lookback.clamp_min(0)])
    products = tokens.unsqueeze(1) * multipliers  # [Q, layers, shifts]; < 2^63 by the multipliers' bound
    rolling, columns = products[..., 0], []
    for shift in range(1, multipliers.shape[-1]):
        rolling = torch.bitwise_xor(rolling, products[..., shift])
        first = (shift - 1) * heads
        columns.append(rolling.unsqueeze(-1) % primes[:, first:first + heads])
    return torch.cat(columns, dim=-1) + offsets


def gather_rows(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    flat = rows.reshape(-1)
    values = dequant_fp8_block(codes[flat], scales[flat], ENGRAM_TABLE_BLOCK)
    return values.to(dtype).reshape(*rows.shape[:-1], rows.shape[-1] * codes.shape[1])
