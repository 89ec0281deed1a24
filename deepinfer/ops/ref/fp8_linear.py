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
               block: tuple[int, int] = (128, 128), pow2_scales: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype. ``pow2_scales`` (every scale a power of two, as UE8M0 scales are) lets
    a kernel fold the scale into the weight exactly; the math is the same, so the reference ignores it."""
    w = dequant_weight(weight, scale, block)
    return (x.float() @ w.t()).to(x.dtype)


def fp8_linear_b32_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2_scales: bool = False
                           ) -> torch.Tensor:
    """32x32-block scales, block-diagonal: x [G, M, K] -> [G, M, r], group g = x[g] @ dequant(weight)[g*r:(g+1)*r].T
    (r = N / G, a multiple of 32: a group's rows hold whole scale blocks)."""
    g, r = x.shape[0], weight.shape[0] // x.shape[0]
    if weight.shape[0] % g or r % 32:
        raise ValueError(f"weight: {weight.shape[0]} rows in {g} groups of a multiple of 32 rows expected")
    return torch.stack([fp8_linear(x[i], weight[i * r:(i + 1) * r], scale[i * r // 32:(i + 1) * r // 32],
                                   block=(32, 32)) for i in range(g)])


def fp8_linear_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
                       pow2_scales: bool = False) -> torch.Tensor:
    """Block-diagonal: x [M, G*K] -> [M, G*r], group g = x[:, g*K:(g+1)*K] @ dequant(weight)[g*r:(g+1)*r].T."""
    w = dequant_weight(weight, scale).view(groups, -1, weight.shape[1])  # [G, r, K]
    xg = x.float().view(x.shape[0], groups, -1).transpose(0, 1)  # [G, M, K]
    return torch.bmm(xg, w.transpose(1, 2)).transpose(0, 1).reshape(x.shape[0], -1).to(x.dtype)
