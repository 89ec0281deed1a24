"""Manifold-constrained hyper-connections (mHC): stream collapse, Sinkhorn-projected mixing, final head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.ref.norm import unweighted_rms_norm


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H] -> (collapsed [T, H], post [T, N] fp32, comb [T, N, N] fp32)."""
    t, n, _ = streams.shape
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp: one column normalisation, then (iters - 1) row/column rounds -> doubly stochastic.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * streams_j (comb applied transposed), in the stream dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse of the N streams [T, N, H] -> [T, H] with a sigmoid ``pre`` and a scalar scale."""
    t = streams.shape[0]
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
