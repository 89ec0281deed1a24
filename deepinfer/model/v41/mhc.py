"""Single-pass ("lagged") mHC (spec §2.3).

Each sublayer site computes (pre, post, comb) from the streams entering it, but its collapse uses the
``pre`` computed by the *previous* site (layer 0: a one-hot on stream 0); its own ``pre`` is carried, in
fp32, to the next site. Unlike V4 (``ops/ref/mhc.hc_pre``), the coefficient projection comes before the
RMS scaling, and there is no ``hc_head``: the final collapse uses the last FFN site's ``pre``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.ops.table import REF, OpTable


@dataclass(frozen=True, slots=True)
class Mix:
    """One site's fp32 coefficients: pre/post [T, N], comb [T, N, N] (comb[j, k]: stream j into stream k)."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


def mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
        hc_eps: float, norm_eps: float, ops: OpTable = REF) -> Mix:
    """streams [T, N, H] -> the site's coefficients, all fp32: project the flat streams, then scale by their
    inverse RMS; logits = base + mixes * [scale0 x N, scale1 x N, scale2 x N^2] (``ops.v41_mix_logits``);
    sigmoids and the Sinkhorn by ``ops.v41_mix_finish`` (``ops/ref/mhc_v41.py``; a few kernels on CUDA)."""
    logits = ops.v41_mix_logits(streams, fn, base, scale, norm_eps)
    return Mix(*ops.v41_mix_finish(logits, streams.shape[1], iters, hc_eps))


def collapse(streams: torch.Tensor, pre: torch.Tensor, ops: OpTable = REF) -> torch.Tensor:
    """sum_j pre_j * X_j in fp32 -> streams' dtype; [T, N, H], [T, N] -> [T, H] (``ops.v41_collapse``)."""
    return ops.v41_collapse(streams, pre)


def expand(out: torch.Tensor, streams: torch.Tensor, m: Mix, ops: OpTable = REF) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * X_j in fp32 -> out's dtype; [T, H], [T, N, H] -> [T, N, H]
    (``ops.v41_expand``)."""
    return ops.v41_expand(out, streams, m.post, m.comb)


def one_hot_pre(tokens: int, n: int, device: torch.device) -> torch.Tensor:
    """Layer 0's carried ``pre``: all weight on stream 0 (the streams start as identical copies)."""
    pre = torch.zeros(tokens, n, dtype=torch.float32, device=device)
    pre[:, 0] = 1
    return pre


def add_site_parameters(module: nn.Module, site: str, n: int, h: int) -> None:
    """A site's checkpoint parameters on ``module``: ``hc_{site}_fn`` [(2 + n) n, n h], ``_base``, ``_scale`` [3]."""
    rows = (2 + n) * n
    setattr(module, f"hc_{site}_fn", nn.Parameter(torch.zeros(rows, n * h, dtype=torch.float32)))
    setattr(module, f"hc_{site}_base", nn.Parameter(torch.zeros(rows, dtype=torch.float32)))
    setattr(module, f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))


def site_mix(module: nn.Module, site: str, streams: torch.Tensor, iters: int, hc_eps: float, norm_eps: float,
             ops: OpTable = REF) -> Mix:
    """The coefficients of ``module``'s site ``site`` (parameters from ``add_site_parameters``)."""
    fn, base, scale = (getattr(module, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
    return mix(streams, fn, base, scale, iters, hc_eps, norm_eps, ops)
