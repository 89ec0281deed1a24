"""Manifold-constrained hyper-connections (mHC): stream collapse, Sinkhorn-projected mixing, final head."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.ops.ref.norm import unweighted_rms_norm
from deepinfer.ops.ref.pointwise import direct

# The batch-invariant table (ops/ref/batch_invariant.py) passes its own GEMM, short-axis sum, norm and
# element-wise application (ops/ref/pointwise.py) into
# the same formulas; these defaults are the plain reference's.
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AxisSum = Callable[[torch.Tensor, int], torch.Tensor]


def _sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.sum(dim=dim)


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    linear: Linear = F.linear,
    axis_sum: AxisSum = _sum,
    norm: Callable[[torch.Tensor, float], torch.Tensor] = unweighted_rms_norm,
    pointwise=direct,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H] -> (collapsed [T, H], post [T, N] fp32, comb [T, N, N] fp32)."""
    t, n, _ = streams.shape
    flat = norm(streams.reshape(t, -1).float(), norm_eps)
    mixes = linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = pointwise(torch.sigmoid, pre_w * pre_s + pre_b) + hc_eps
    post = 2 * pointwise(torch.sigmoid, post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp: one column normalisation, then (iters - 1) row/column rounds -> doubly stochastic.
    comb = comb / (axis_sum(comb, -2).unsqueeze(-2) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (axis_sum(comb, -1).unsqueeze(-1) + hc_eps)
        comb = comb / (axis_sum(comb, -2).unsqueeze(-2) + hc_eps)
    collapsed = axis_sum(pre.unsqueeze(-1) * streams, 1).to(streams.dtype)
    return collapsed, post, comb


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * streams_j (comb applied transposed), in the stream dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float,
    *, linear: Linear = F.linear, axis_sum: AxisSum = _sum,
    norm: Callable[[torch.Tensor, float], torch.Tensor] = unweighted_rms_norm, pointwise=direct,
) -> torch.Tensor:
    """Final collapse of the N streams [T, N, H] -> [T, H] with a sigmoid ``pre`` and a scalar scale."""
    t = streams.shape[0]
    flat = norm(streams.reshape(t, -1).float(), norm_eps)
    mixes = linear(flat, fn.float())
    pre = pointwise(torch.sigmoid, mixes * scale.float() + base.float()) + hc_eps
    return axis_sum(pre.unsqueeze(-1) * streams, 1).to(streams.dtype)
