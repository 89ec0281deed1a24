"""The device build's Engram table held as stored (``model/v41/engram_table.py``): the scales kept as UE8M0 bytes
from either stored form, and rows gathered through the reference op table equal to the plain loader's dequantized
table rows bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.quant import dequant_fp8_block, scale_to_float
from deepinfer.model.v41.engram_table import FP8Table, scale_bytes
from deepinfer.model.v41.names import ENGRAM_TABLE_BLOCK
from deepinfer.ops.table import REF


def _stored(rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, dim), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes, as a loaded table has none
    scales = torch.randint(100, 150, (rows, dim // 32), generator=g, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


def test_scale_bytes_from_ue8m0_and_fp32_powers_of_two() -> None:
    stored = torch.tensor([[0, 1, 127, 254]], dtype=torch.uint8)
    assert torch.equal(scale_bytes(stored.view(torch.float8_e8m0fnu)), stored)
    # 2^-127 is an fp32 subnormal: byte 0, as the loader decodes it.
    powers = torch.tensor([[2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127]])
    assert torch.equal(scale_bytes(powers), stored)
    with pytest.raises(ValueError, match="powers of two"):
        scale_bytes(torch.tensor([[0.75]]))
    with pytest.raises(ValueError, match="255"):
        scale_bytes(torch.tensor([[255]], dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_rows_equal_the_dequantized_table(dtype) -> None:
    codes, scales = _stored(64, 96, seed=1)
    table = FP8Table(64, 96, REF, device="cpu")
    table.load(codes, scales)
    plain = dequant_fp8_block(codes, scales, ENGRAM_TABLE_BLOCK).to(dtype)  # what the plain loader holds
    rows = torch.tensor([[5, 63, 0], [5, 5, 17]])  # repeated, out of order, both ends
    assert torch.equal(table.gather(rows, dtype), plain[rows].flatten(-2))
    from_fp32 = FP8Table(64, 96, REF, device="cpu")
    from_fp32.load(codes, scale_to_float(scales))  # a checkpoint that stores fp32 multipliers
    assert torch.equal(from_fp32.weight_scale, table.weight_scale)
    with pytest.raises(ValueError, match="do not fit"):
        table.load(codes[:, :64], scales[:, :2])
