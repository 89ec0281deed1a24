"""DeepSeek-V4.1's mHC coefficients (spec §2.3): the twin of ``ops/triton/mhc_v41.py``.

    mix_logits(streams [T, N, H], fn [(2 + N) N, N H], base, scale [3], norm_eps) -> logits [T, (2 + N) N] fp32:
        the flat streams projected by fn, times their inverse RMS, then base + that * [scale0 x N, scale1 x N,
        scale2 x N^2] (one fused multiply-add)

    logits [T, (2 + N) N] fp32 -> pre = sigmoid(l[:N]) + eps, post = 2 sigmoid(l[N:2N]),
                                  comb = Sinkhorn(l[2N:] as [N, N]), all fp32

Sinkhorn as V4 (architecture §2.2): softmax over each row plus eps, one column normalisation, then
(iters - 1) rounds of row and column normalisation; on the reference path that is ~4 launches a round, 20
rounds, twice per layer (``ops/triton/mhc_v41.py`` does a site in one launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mix_logits(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float
               ) -> torch.Tensor:
    n = streams.shape[1]
    flat = streams.flatten(1).float()
    mixes = F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n))).float()
    return torch.addcmul(base.float(), mixes, scales)  # one fused multiply-add, as the reference kernel


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., N, N] -> doubly stochastic (up to eps): softmax rows + eps, column-normalise, then (iters - 1)
    row/column rounds."""
    x = logits.softmax(dim=-1) + eps
    x = x / (x.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(dim=-1, keepdim=True) + eps)
        x = x / (x.sum(dim=-2, keepdim=True) + eps)
    return x


def mix_finish(logits: torch.Tensor, n: int, iters: int, hc_eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, (2 + n) n] fp32 -> (pre [T, n], post [T, n], comb [T, n, n]), fp32."""
    pre = torch.sigmoid(logits[:, :n]) + hc_eps
    post = 2 * torch.sigmoid(logits[:, n:2 * n])
    return pre, post, sinkhorn(logits[:, 2 * n:].unflatten(-1, (n, n)), iters, hc_eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j * X_j in fp32 -> streams' dtype; [T, N, H], [T, N] -> [T, H]."""
    return (pre.unsqueeze(-1) * streams.float()).sum(1).to(streams.dtype)


def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * X_j in fp32 -> out's dtype; [T, H], [T, N, H], [T, N], [T, N, N]
    -> [T, N, H]."""
    update = post.unsqueeze(-1) * out.unsqueeze(-2)
    mixed = (comb.unsqueeze(-1) * streams.unsqueeze(-2)).sum(1)
    return (update + mixed).to(out.dtype)
