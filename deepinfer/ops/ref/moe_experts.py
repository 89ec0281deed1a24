"""Routed FP4 experts of a DeepSeek-V4 MoE layer: the specification, twin of ``ops/triton/moe_experts.py``.

Given the router's choice (``topk_ids``, ``topk_weights``; routing itself stays in ``ops/ref/moe.py``),
out[t] = sum over slots j = 0..k-1, in slot order, in fp32, of
    topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]),
expert_e(x) = W2_e @ (silu(min(W1_e x, limit)) * clamp(W3_e x, -limit, limit)).

Weight layout (the checkpoint's, see ``model/quant.py``): FP4 e2m1 codes packed two per int8 along the input
dimension (low nibble = even element), one power-of-two scale per output row per 32 input elements.
    w13 [E, 2I, H/2] int8: rows 0..I-1 are W1 (gate), rows I..2I-1 are W3 (up);  s13 [E, 2I, H/32]
    w2  [E, H, I/2]  int8;                                                        s2  [E, H, I/32]
Scales are fp32 multipliers (2^(e-127) already decoded) or the raw UE8M0 bytes (``float8_e8m0fnu`` /
``uint8``); both mean the same weights. Duplicate ids in a row (hash routing can produce them) are two
independent slots. Everything is computed in fp32 from the exactly dequantized weights; the result is cast
to x.dtype once, at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.model.quant import dequant_fp4
from deepinfer.ops.ref.pointwise import direct

FP4_GROUP = 32


# The router's weights come in the logits' dtype; both implementations upcast them exactly to fp32.
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_moe_experts_args(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                           w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> tuple[int, int]:
    """Shape/dtype preconditions shared by both implementations; returns (E, I). Never syncs the device."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x: expected 2-D bf16/fp32 [T, H], got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.dtype != torch.int64 or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected int64 [T={t}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids: k must be at least 1")
    if topk_weights.dtype not in _WEIGHT_DTYPES or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected fp32/bf16/fp16 {tuple(topk_ids.shape)} (used as fp32), got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if w13.dtype != torch.int8 or w13.dim() != 3 or w13.shape[2] * 2 != h or w13.shape[1] % 2:
        raise ValueError(f"w13: expected int8 [E, 2I, H/2={h // 2}], got {w13.dtype} {tuple(w13.shape)}")
    e, two_i, _ = w13.shape
    i = two_i // 2
    if h % FP4_GROUP or i % FP4_GROUP:
        raise ValueError(f"H={h} and I={i} must be multiples of {FP4_GROUP} (one scale per 32 inputs)")
    if w2.dtype != torch.int8 or tuple(w2.shape) != (e, h, i // 2):
        raise ValueError(f"w2: expected int8 {(e, h, i // 2)}, got {w2.dtype} {tuple(w2.shape)}")
    for name, s, want in (("s13", s13, (e, two_i, h // FP4_GROUP)), ("s2", s2, (e, h, i // FP4_GROUP))):
        if tuple(s.shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {tuple(s.shape)}")
        if s.dtype not in (torch.float32, torch.uint8, torch.float8_e8m0fnu):
            raise ValueError(f"{name}: expected fp32 multipliers or UE8M0 bytes, got {s.dtype}")
    if s13.dtype != s2.dtype:
        raise ValueError(f"s13 ({s13.dtype}) and s2 ({s2.dtype}) must share one scale format")
    return e, i


def moe_experts_fp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                    limit: float, *, out: torch.Tensor | None = None, add: torch.Tensor | None = None,
                    before_add: Callable[[], None] | None = None,
                    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul,
                    pointwise=direct) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype (written into ``out`` when given). ``add`` [T, H] in x.dtype (the
    shared expert's output) is added after the rounding to x.dtype: ``routed + add`` as two tensors.
    ``before_add`` is called right before ``add`` is first read (the GPU path passes a stream join there:
    ``add`` may still be being computed on a side stream while the routed experts run). ``matmul`` runs each
    expert's [rows, K] x [K, N] products (the batch-invariant table passes its fixed-row-tile GEMM), ``pointwise``
    applies SiLU (``ops/ref/pointwise.py``)."""
    n_exp, inter = check_moe_experts_args(x, topk_ids, topk_weights, w13, s13, w2, s2)
    t, h = x.shape
    k = topk_ids.shape[1]
    if t and bool(((topk_ids < 0) | (topk_ids >= n_exp)).any()):
        raise ValueError(f"topk_ids: expert ids must lie in [0, {n_exp})")
    xf = x.float()
    per_slot = torch.zeros(t, k, h, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        w13_e = dequant_fp4(w13[e], s13[e])  # fp32 [2I, H], exact
        gate, up = matmul(xf[tok], w13_e.t()).split(inter, dim=-1)
        hid = pointwise(F.silu, gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        per_slot[tok, slot] = matmul(hid, dequant_fp4(w2[e], s2[e]).t()) * topk_weights[tok, slot, None].float()
    acc = per_slot[:, 0]
    for j in range(1, k):  # the combine: slot order, fp32
        acc = acc + per_slot[:, j]
    res = acc.to(x.dtype)
    if add is not None:
        if before_add is not None:
            before_add()
        res = res + add
    if out is None:
        return res
    out.copy_(res)
    return out
