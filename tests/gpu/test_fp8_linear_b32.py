"""Triton FP8 linear with 32x32-block scales (DeepSeek-V4.1's dense weights) against its reference twin.

The weights are quantized with UE8M0 (power-of-two) 32x32 scales as a V4.1 checkpoint stores them. The kernel
folds each scale into its bf16 weight tile exactly, so it differs from the reference (fp32 from the
dequantized weight) only by the order of the fp32 sums and, for bf16 activations, the output's rounding:
fp32 within 1e-5 relative, bf16 within 2^-8 (one output rounding).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.quant import quant_fp8_block, ue8m0_to_float
from deepinfer.ops.ref.fp8_linear import fp8_linear as ref_fp8_linear
from tests.gpu.conftest import rel_err

BLOCK = (32, 32)


def _weights(n: int, k: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 2, : k // 3] *= 40  # blocks of other exponents: every 32x32 block's own scale matters
    q, s = quant_fp8_block(w, BLOCK)
    return q.to(device), ue8m0_to_float(s).float().to(device)


def _check(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int) -> None:
    from deepinfer.ops.triton.fp8_linear_b32 import fp8_linear_b32

    w, s = _weights(n, k, seed, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    out = fp8_linear_b32(x, w, s)
    ref = ref_fp8_linear(x.float(), w, s, block=BLOCK)  # fp32 spec
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 2**-8)


SMALL = [(1, 64, 96), (3, 96, 200), (17, 160, 64), (40, 32, 320), (70, 200, 128), (130, 96, 96)]
# V4.1-Flash: wq_a, wq_b, wkv, wo_b, shared-expert w1/w3 and w2, indexer wq_b, at decode and prefill M.
FLASH = [(m, n, k) for m in (1, 8, 128, 4096) for n, k in ((1280, 5120), (32768, 1280), (512, 5120),
                                                           (5120, 8192), (2304, 5120), (5120, 2304), (4096, 1280))]


@pytest.mark.interpret_ok
@pytest.mark.parametrize("m, n, k", SMALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_shapes(m, n, k, dtype, device) -> None:
    _check(m, n, k, dtype, device, seed=m * 7 + n)


@pytest.mark.parametrize("m, n, k", FLASH)
def test_v41_flash_shapes_bf16(m, n, k, device) -> None:
    _check(m, n, k, torch.bfloat16, device, seed=n + k + m)


@pytest.mark.interpret_ok
def test_refusals_name_the_field(device) -> None:
    from deepinfer.ops.triton.fp8_linear_b32 import fp8_linear_b32

    w, s = _weights(64, 64, 0, device)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="^pow2_scales: .*allowed: True"):
        fp8_linear_b32(x, w, s, pow2_scales=False)
    with pytest.raises(ValueError, match=r"^scale: expected fp32 \(2, 2\)"):
        fp8_linear_b32(x, w, s[:1])


@pytest.mark.interpret_ok
def test_row_does_not_depend_on_the_other_rows(device) -> None:
    from deepinfer.ops.triton.fp8_linear_b32 import fp8_linear_b32

    w, s = _weights(96, 128, 3, device)
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(4)).to(device)
    other = x.clone()
    other[:5] = torch.randn(5, 128, generator=torch.Generator().manual_seed(5)).to(device)
    assert torch.equal(fp8_linear_b32(x, w, s)[7], fp8_linear_b32(other, w, s)[7])


def _check_grouped(g: int, m: int, r: int, k: int, dtype: torch.dtype, device: str, seed: int) -> None:
    """One grouped launch = the G per-group launches bit for bit (the same tiles), and the reference's values."""
    from deepinfer.ops.ref.fp8_linear import fp8_linear_b32_grouped as ref_grouped
    from deepinfer.ops.triton.fp8_linear_b32 import fp8_linear_b32, fp8_linear_b32_grouped

    w, s = _weights(g * r, k, seed, device)
    x = torch.randn(g, m, k, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    out = fp8_linear_b32_grouped(x, w, s)
    assert out.shape == (g, m, r) and out.dtype == dtype
    for i in range(g):
        one = fp8_linear_b32(x[i].contiguous(), w[i * r:(i + 1) * r], s[i * r // 32:(i + 1) * r // 32])
        assert torch.equal(out[i], one), f"group {i}"
    ref = ref_grouped(x.float(), w, s)
    assert rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 2**-8)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g, m, r, k", [(2, 3, 64, 96), (4, 17, 32, 64)])
def test_grouped_small(g, m, r, k, dtype, device) -> None:
    _check_grouped(g, m, r, k, dtype, device, seed=g * 11 + m)


@pytest.mark.parametrize("m", [1, 8, 128, 4096])
def test_grouped_v41_flash_wo_a(m, device) -> None:
    """V4.1-Flash's wo_a: 8 groups of 1024 outputs over 4096 inputs (64 heads x 512 / 8)."""
    _check_grouped(8, m, 1024, 4096, torch.bfloat16, device, seed=m)


@pytest.mark.interpret_ok
def test_grouped_refuses_groups_that_straddle_scale_blocks(device) -> None:
    from deepinfer.ops.triton.fp8_linear_b32 import fp8_linear_b32_grouped

    w, s = _weights(96, 64, 0, device)
    with pytest.raises(ValueError, match="^weight: 96 rows in 2 groups of a multiple of 32"):
        fp8_linear_b32_grouped(torch.randn(2, 3, 64, device=device), w, s)


@pytest.mark.interpret_ok
def test_grouped_reads_a_transposed_input(device) -> None:
    """wo_a's input is [T, G, K] seen as [G, T, K] (a transpose, not a copy): the same result as a copy."""
    from deepinfer.ops.triton.fp8_linear_b32 import fp8_linear_b32_grouped

    w, s = _weights(4 * 32, 64, 1, device)
    x = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(2)).to(device).transpose(0, 1)
    assert torch.equal(fp8_linear_b32_grouped(x, w, s), fp8_linear_b32_grouped(x.contiguous(), w, s))
