"""``mhc_fused.hc_post_pre`` (one site's hc_post and the next site's hc_pre, two launches) vs the reference,
and its batch invariance.

The new streams pass the hc_post checks of test_mhc_kernels.py (a bf16 element matches the reference or is
one ulp off where the 4-term mix sums in another order). The pre half is checked against the reference
hc_pre *of the kernel's own new streams* with hc_pre's tolerances (so a rare ulp in a stream does not count
twice): the fused kernel runs the mixes kernel's tiles and steps (tf32x3, 32-column steps per 128-column
chunk) on the values it stores.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.ops.ref import mhc as ref  # noqa: E402
from deepinfer.ops.triton import mhc as tri  # noqa: E402
from deepinfer.ops.triton import mhc_fused  # noqa: E402
from tests.gpu.conftest import poison_scratch_exact_fp32, rel_err  # noqa: E402
from tests.gpu.test_mhc_kernels import EPS, ITERS, _case, _check_collapsed, _post_case, _post_failures  # noqa: E402


@pytest.fixture(autouse=True)
def _poison_and_no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_scratch_exact_fp32(monkeypatch, tri)


def _inputs(T, N, H, dtype, device, seed):
    streams, out, post, comb = _post_case(T, N, H, dtype, device, seed)
    _, fn, base, scale = _case(T, N, H, dtype, seed + 7, device)
    return streams, out, post, comb, fn, base, scale


def _fused(streams, out, post, comb, fn, base, scale):
    res = torch.full_like(streams, float("nan"))
    col = torch.full(streams[:, 0].shape, float("nan"), dtype=streams.dtype, device=streams.device)
    got = mhc_fused.hc_post_pre(streams, out, post, comb, fn, base, scale, ITERS, EPS, EPS, result=res,
                                collapsed=col)
    assert got[0].data_ptr() == res.data_ptr() and got[1].data_ptr() == col.data_ptr()
    for r in got:
        assert torch.isfinite(r).all(), "unwritten or non-finite output"
    return got


def _check(T, N, H, dtype, device, seed=0):
    args = _inputs(T, N, H, dtype, device, seed)
    streams, out, post, comb, fn, base, scale = args
    got = _fused(*args)
    want_new = ref.hc_post(streams, out, post, comb)
    assert _post_failures(got[0], want_new, streams, out, post, comb) == []
    want = ref.hc_pre(got[0], fn, base, scale, ITERS, EPS, EPS)
    _check_collapsed(got[1], want[0], got[0])
    for g, w in zip(got[2:], want[1:]):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert rel_err(g, w) <= 1e-5, rel_err(g, w)
    return args, got


SMALL = [  # (T, N, H, K_CHUNK): several chunks per stream, N not a power of two, T > BLOCK_T, one chunk
    (1, 4, 256, 64), (5, 4, 192, 64), (3, 3, 128, 32), (70, 2, 64, 32), (2, 4, 128, 128),
]


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T, N, H, k_chunk", SMALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_pre_small(T, N, H, k_chunk, dtype, device, monkeypatch) -> None:
    monkeypatch.setattr(tri, "K_CHUNK", k_chunk)
    monkeypatch.setattr(tri, "BLOCK_H", 32)
    _check(T, N, H, dtype, device, seed=T + H)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("case", ["ragged_h", "in_place"])
def test_post_pre_falls_back(case, device, monkeypatch) -> None:
    """H not a multiple of K_CHUNK, or the result written over the input: hc_post then hc_pre (same math)."""
    monkeypatch.setattr(tri, "K_CHUNK", 64)
    H = 72 if case == "ragged_h" else 128
    args = _inputs(5, 4, H, torch.bfloat16, device, 3)
    streams, out, post, comb, fn, base, scale = args
    res = streams.clone() if case == "in_place" else None
    got = mhc_fused.hc_post_pre(res if res is not None else streams, out, post, comb, fn, base, scale, ITERS,
                                EPS, EPS, result=res)
    new = tri.hc_post(streams, out, post, comb)
    assert torch.equal(got[0], new)
    for g, w in zip(got[1:], tri.hc_pre(new, fn, base, scale, ITERS, EPS, EPS)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("T", [1, 3, 32, 128, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_pre_v4_shapes(T, dtype, device) -> None:
    _check(T, 4, 4096, dtype, device, seed=T)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant(dtype, device, monkeypatch) -> None:
    """A token's outputs do not depend on the batch around it (alone, in a batch, permuted): bitwise."""
    interp = device == "cpu"
    if interp:  # two token blocks, two chunks per stream
        monkeypatch.setattr(tri, "K_CHUNK", 64)
        monkeypatch.setattr(tri, "BLOCK_T", 16)
    T, N, H = (19, 4, 128) if interp else (300, 4, 4096)
    args = _inputs(T, N, H, dtype, device, 5)
    batch = _fused(*args)
    per_token = args[:4]
    for lo, hi in ((0, 1), (5, 6), (T - 1, T), (3, 5)):
        part = _fused(*(a[lo:hi] for a in per_token), *args[4:])
        for a, b in zip(part, batch):
            assert torch.equal(a, b[lo:hi])
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(8)).to(device)
    shuffled = _fused(*(a[perm] for a in per_token), *args[4:])
    for a, b in zip(shuffled, batch):
        assert torch.equal(a, b[perm])
