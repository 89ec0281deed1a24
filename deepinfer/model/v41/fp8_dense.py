"""V4.1's dense FP8 weights kept as stored on a device: e4m3 codes with one power-of-two (UE8M0) scale per
32x32 block, run by the op table's ``fp8_linear_b32`` (``ops/triton/fp8_linear_b32.py``: the scale folded into
each bf16 weight tile exactly; the reference dequantizes). A drop-in for the plain model's ``Linear`` there:
``forward`` and ``grouped`` (``wo_a``'s block-diagonal product), the same values up to the order of the fp32
sums."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model.quant import scale_to_float
from deepinfer.ops.table import OpTable

BLOCK = 32


class FP8Dense32(nn.Module):
    def __init__(self, out_features: int, in_features: int, ops: OpTable, device: torch.device | str = "meta"
                 ) -> None:
        super().__init__()
        self.register_buffer("weight_fp8", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                       device=device))
        self.register_buffer("weight_scale", torch.empty(-(-out_features // BLOCK), -(-in_features // BLOCK),
                                                         dtype=torch.float32, device=device))
        self.ops = ops

    @property
    def out_features(self) -> int:
        return self.weight_fp8.shape[0]

    def load(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        """The stored codes and their 32x32-block scales (UE8M0 bytes, or fp32 powers of two)."""
        if tuple(data.shape) != tuple(self.weight_fp8.shape) or tuple(scale.shape) != tuple(self.weight_scale.shape):
            raise ValueError(f"FP8Dense32.load: codes {tuple(data.shape)} / scales {tuple(scale.shape)} do not fit "
                             f"{tuple(self.weight_fp8.shape)} / {tuple(self.weight_scale.shape)}")
        multipliers = scale_to_float(scale).float()
        if not bool((torch.frexp(multipliers).mantissa == 0.5).all()):
            raise ValueError("FP8Dense32.load: the scales must be powers of two (UE8M0), as the kernel folds them "
                             "into bf16 weights exactly")
        self.weight_fp8.copy_(data)
        self.weight_scale.copy_(multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.ops.fp8_linear_b32(x.reshape(-1, shape[-1]).contiguous(), self.weight_fp8, self.weight_scale,
                                    pow2_scales=True)
        return y.reshape(*shape[:-1], y.shape[-1])

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [G, T, in] -> [G, T, out/G]: group g uses weight rows [g*r, (g+1)*r)."""
        g = x.shape[0]
        r = self.out_features // g
        if r % BLOCK == 0:  # every group holds whole scale blocks: one launch (``ops.fp8_linear_b32_grouped``)
            return self.ops.fp8_linear_b32_grouped(x, self.weight_fp8, self.weight_scale, pow2_scales=True)
        outs = []  # the groups' rows straddle scale blocks (tiny test configs): each group's rows dequantized
        for i in range(g):
            rows = slice(i * r, (i + 1) * r)
            s = self.weight_scale.repeat_interleave(BLOCK, 0)[rows].repeat_interleave(BLOCK, 1)
            w = self.weight_fp8[rows].float() * s[:, : x.shape[-1]]
            outs.append((x[i].float() @ w.t()).to(x.dtype))
        return torch.stack(outs)
