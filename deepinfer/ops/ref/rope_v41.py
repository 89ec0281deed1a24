"""DeepSeek-V4.1's rotary embedding from angles (spec §2.4 step 2): adjacent pairs (2i, 2i+1) of the *last* rope
channels rotated by a complex multiply in fp32 and cast back once, as the reference does (separate real
multiplies round some values differently, which can cross a later FP8/FP4 bin). The twin of
``ops/triton/rope_v41.py``; the angles come from ``model/v41/rope.angles``.
"""

from __future__ import annotations

import torch


def apply_rope(values: torch.Tensor, ang: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * ang.shape[-1] channels of values [T, C] or [T, heads, C] (conjugate if inverse)."""
    rot = ang.shape[-1] * 2
    pairs = torch.view_as_complex(values[..., -rot:].float().unflatten(-1, (-1, 2)).contiguous())
    turn = torch.polar(torch.ones_like(ang), ang)
    if values.dim() == 3:
        turn = turn.unsqueeze(1)
    if inverse:
        turn = turn.conj()
    rotated = torch.view_as_real(pairs * turn).flatten(-2).to(values.dtype)
    return torch.cat((values[..., :-rot], rotated), dim=-1)
