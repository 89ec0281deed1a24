"""FP8 block-scaled linear (the DeepGEMM role), reference twin of ``ops/triton/fp8_linear.py``.

weight: float8_e4m3fn [N, K]; scale: fp32 [ceil(N/bn), ceil(K/bk)] (the checkpoint's UE8M0 exponents
already decoded to 2^(e-127)); activations stay in their dtype (no activation quantization), so the result
equals ``x @ dequant(weight).T`` computed in x's dtype with fp32 accumulation.
"""

from __future__ import annotations

import torch


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    n, k = weight.shape
    bn, bk = block
    s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * s


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype."""
    w = dequant_weight(weight, scale, block)
    return (x.float() @ w.t()).to(x.dtype)
