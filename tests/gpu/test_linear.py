"""Triton bf16 linear (decode-sized M) against its reference twin (``torch.nn.functional.linear``)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.ref.linear import linear as ref_linear
from tests.gpu.conftest import rel_err

SMALL = [(1, 64, 128), (3, 100, 200), (16, 130, 256), (9, 64, 384)]
V4 = [(1, 256, 4096), (8, 256, 4096), (1, 2624, 4096), (16, 2624, 4096), (12, 1024, 4096), (5, 1000, 1000)]


def _check(m, n, k, device, seed):
    from deepinfer.ops.triton import linear as tri

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    want = ref_linear(x.float(), w.float())  # fp32 spec
    got = tri.linear(x.to(device), w.to(device))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got.float().cpu(), want) <= 1e-2  # one bf16 rounding of the output dominates
    return tri, x, w, got


@pytest.mark.interpret_ok
@pytest.mark.parametrize("m, n, k", SMALL)
def test_small_shapes(m, n, k, device) -> None:
    _check(m, n, k, device, seed=m + n + k)


@pytest.mark.parametrize("m, n, k", V4)
def test_v4_shapes_and_repeats(m, n, k, device) -> None:
    """V4 router and side-projection shapes; repeated calls (split-K tickets reset) give the same bits, and
    the result is within bf16 rounding of cuBLAS."""
    tri, x, w, got = _check(m, n, k, device, seed=n + k)
    assert m <= tri.MAX_M  # the Triton kernel, not the cuBLAS fallback
    assert torch.equal(got, tri.linear(x.to(device), w.to(device)))
    if device == "cuda":
        assert rel_err(got.float(), torch.nn.functional.linear(x.cuda(), w.cuda()).float()) <= 1e-2


@pytest.mark.interpret_ok
def test_large_m_and_other_dtypes_fall_back(device) -> None:
    from deepinfer.ops.triton import linear as tri

    x = torch.randn(tri.MAX_M + 1, 64).bfloat16().to(device)
    w = torch.randn(32, 64).bfloat16().to(device)
    assert torch.equal(tri.linear(x, w), torch.nn.functional.linear(x, w))
    x32, w32 = x.float(), w.float()
    assert torch.equal(tri.linear(x32[:2], w32), torch.nn.functional.linear(x32[:2], w32))
