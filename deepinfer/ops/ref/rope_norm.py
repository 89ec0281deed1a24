"""Fused RMSNorm / RoPE entry points of the attention block; the specification of ``ops/triton/rope_norm.py``.

Each op is a composition of the existing reference functions (``ops/ref/norm.py``, ``ops/ref/rope.py``), so
the CPU path computes exactly what ``model/attention.py`` computes, and the Triton twins (same signatures)
are checked against these. Contract::

  rms_norm(x [..., C], weight [C], eps) -> [..., C]             weighted RMSNorm (every ``RMSNorm`` module)
  norm_rope_heads(q [T, H, D], cos, sin, eps) -> [T, H, D]       per-head unweighted RMSNorm, then RoPE (q)
  norm_rope(x [T, D], weight [D], eps, cos, sin) -> [T, D]       weighted RMSNorm, then RoPE (kv);
      with ``out=table [R, D], rows=[T]`` row t goes to table[rows[t]] (the window cache write), returns table
  rope(x [T, ..., D], cos, sin, inverse=False) -> [T, ..., D]    RoPE only (indexer q, output de-rotation)

and two pairs of them that the attention block runs back to back (one launch each on the GPU):

  latent_norms(xq [T, C+D], C, q_weight, q_eps, kv_weight, kv_eps, cos, sin, *, window, rows) -> q_res [T, C]
      rms_norm of the q latent (returned) and norm_rope of the kv row into ``window`` at ``rows``
  heads_norm_rope(q [T, H, D], cos, sin, eps, q_ix [T, Hi, Di]) -> (q, q_ix)
      norm_rope_heads of the attention heads, rope of the indexer heads (the same angles)

cos, sin are [T, R/2] in the activation dtype; RoPE rotates the interleaved pairs of the last R channels.
The Triton ``norm_rope_heads`` and ``rope`` write into their input and return it; callers must use the
returned tensor and must not rely on the input keeping its values (these twins return new tensors).
"""

from __future__ import annotations

import torch

from deepinfer.ops.ref.norm import rms_norm, unweighted_rms_norm
from deepinfer.ops.ref.rope import apply_rope

__all__ = ["rms_norm", "norm_rope_heads", "norm_rope", "rope", "latent_norms", "heads_norm_rope"]
# ``rms_norm`` is re-exported unchanged: the reference path's RMSNorm must keep its exact bits.


def norm_rope_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The q path: rsqrt factor per (token, head) in fp32, cast to q.dtype, multiply in q.dtype, then RoPE."""
    return apply_rope(unweighted_rms_norm(q, eps), cos, sin)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
              out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The kv path: ``apply_rope(rms_norm(x, weight, eps), cos, sin)``, rounded to x.dtype after each step.
    With ``rows`` the result's row t is written to ``out[rows[t]]`` and ``out`` is returned."""
    y = apply_rope(rms_norm(x, weight, eps), cos, sin)
    if rows is None:
        return y if out is None else out.copy_(y)
    return out.index_copy_(0, rows, y)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE on the last ``2 * cos.shape[-1]`` channels (``inverse=True``: the conjugate rotation)."""
    return apply_rope(x, cos, sin, inverse=inverse)


def latent_norms(xq: torch.Tensor, kv_col: int, q_weight: torch.Tensor, q_eps: float, kv_weight: torch.Tensor,
                 kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, *, window: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
    """The two norms of the attention block's first GEMM output: returns ``rms_norm(xq[:, :kv_col])`` and writes
    ``norm_rope(xq[:, kv_col:])`` into ``window`` at ``rows``."""
    norm_rope(xq[:, kv_col:], kv_weight, kv_eps, cos, sin, out=window, rows=rows)
    return rms_norm(xq[:, :kv_col], q_weight, q_eps)


def heads_norm_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, q_ix: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_rope_heads(q, cos, sin, eps), rope(q_ix, cos, sin))``."""
    return norm_rope_heads(q, cos, sin, eps), rope(q_ix, cos, sin)
