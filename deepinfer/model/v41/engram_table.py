"""An Engram table's two forms, one ``gather(rows, dtype)`` each: ``DenseTable``, the plain model's dequantized
tensor (the checkpoint's ``embed.weight`` name), and ``FP8Table``, the table kept as stored on a device: e4m3 codes with one UE8M0 scale byte per row and 32 columns, its
rows gathered and dequantized by the op table's ``v41_engram_gather`` (one launch on CUDA). V4.1-Flash's tables
are 384M rows x 256 per Engram layer: ~98 GB each as codes, twice that dequantized to bf16. A token reads 24
rows, so the gather is cheap and the codes are what must fit. The rows it returns equal the plain model's
dequantized table rows bit for bit (a code times a power of two is exact in fp32; one cast after it).

The scales are held as their bytes (uint8, ``float8_e8m0fnu``'s bits): a quarter of fp32 multipliers, which
would be ~12 GB a table. A checkpoint that stores fp32 multipliers has them turned into bytes, which needs
them to be powers of two in UE8M0's range."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model.quant import exponent_to_ue8m0, scale_to_float
from deepinfer.model.v41.names import ENGRAM_TABLE_BLOCK
from deepinfer.ops.table import OpTable

GROUP = ENGRAM_TABLE_BLOCK[1]


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Stored scales (UE8M0 bytes, or fp32 powers of two) -> UE8M0 bytes as uint8; 255 (NaN) is refused."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        if bool((scale.view(torch.uint8) == 255).any()):  # the kernel would read it as a number
            raise ValueError("UE8M0 scale: byte 255 encodes NaN; the checkpoint's scale tensor is corrupt")
        return scale.view(torch.uint8)
    mantissa, exponent = torch.frexp(scale_to_float(scale))
    if not bool((mantissa == 0.5).all()):
        raise ValueError("FP8Table.load: fp32 scales must be powers of two (UE8M0) to be held as their bytes")
    return exponent_to_ue8m0(exponent - 1).view(torch.uint8)


class DenseTable(nn.Module):
    """The table as one dense tensor, ``weight`` [rows, dim] (the plain model's, dequantized at load)."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype))

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [..., K] -> the rows side by side, [..., K * dim] in ``dtype``."""
        return self.weight[rows].flatten(-2).to(dtype)


class FP8Table(nn.Module):
    def __init__(self, rows: int, dim: int, ops: OpTable, device: torch.device | str = "meta") -> None:
        super().__init__()
        if dim % GROUP:
            raise ValueError(f"FP8Table: {dim} columns are not whole groups of {GROUP} (one scale each)")
        self.register_buffer("weight_fp8", torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.empty(rows, dim // GROUP, dtype=torch.uint8, device=device))
        self.ops = ops

    def load(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        """The stored codes and their scales (UE8M0 bytes, or fp32 powers of two)."""
        if tuple(data.shape) != tuple(self.weight_fp8.shape) or tuple(scale.shape) != tuple(self.weight_scale.shape):
            raise ValueError(f"FP8Table.load: codes {tuple(data.shape)} / scales {tuple(scale.shape)} do not fit "
                             f"{tuple(self.weight_fp8.shape)} / {tuple(self.weight_scale.shape)}")
        self.weight_fp8.copy_(data)
        self.weight_scale.copy_(scale_bytes(scale))

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [..., K] -> the dequantized rows side by side, [..., K * dim] in ``dtype``."""
        return self.ops.v41_engram_gather(self.weight_fp8, self.weight_scale, rows, dtype)
