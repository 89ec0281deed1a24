"""DeepSeek-V4.1's rotary embedding from angles in one launch: the twin of ``ops/ref/rope_v41.py``.

The reference is ~10 launches a call (upcast, complex view, polar, multiply, real view, cast, a ``cat`` of the
nope and rope parts), and a V4.1 layer rotates 3 to 6 tensors (queries, window KV, the output's inverse, an
index source's queries, keys and entries). Here: the angles' cos and sin (fp32, two launches; the table the
reference's ``torch.polar`` builds) and one launch of V4's norm/RoPE kernel (``rope_norm.py``) with no norm,
out of place, which copies the nope channels and rotates the last R: even' = e*c - o*s, odd' = o*c + e*s in
fp32 (inverse: s -> -s), one rounding to the activation dtype, as the reference's complex multiply (its
products and sum rounded in fp32; CUDA's complex multiply may contract them into an FMA, a last-bit fp32
difference before the one rounding).
"""

from __future__ import annotations

import torch

from deepinfer.ops.triton import rope_norm


def apply_rope(values: torch.Tensor, ang: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * ang.shape[-1] channels of values [T, C] or [T, heads, C] by ang [T, R/2] (fp32); a
    new tensor (values untouched)."""
    assert ang.dim() == 2 and ang.shape[0] == values.shape[0], f"ang {tuple(ang.shape)} values {tuple(values.shape)}"
    rows = rope_norm._rows(values)
    out = torch.empty(rows.shape, dtype=values.dtype, device=values.device)
    ang = ang.float()
    rope_norm._launch(rows, out, None, torch.cos(ang), torch.sin(ang), 0.0, rope_norm.NORM_NONE,
                      2 * ang.shape[-1], inverse, 0, rows.shape[2])
    return out.view(values.shape)
