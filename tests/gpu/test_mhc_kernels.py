"""Triton mHC kernels (``hc_pre``, ``hc_post``, ``hc_head``) vs ``ops/ref/mhc.py``, plus batch invariance.

Fresh fixed-seed inputs per case: streams with a per-token scale spread of 100x (the RMS factor matters),
fn ~ N(0, 1/K) so the mixes are O(1), comb scales up to 8 (peaked softmax before Sinkhorn).

Tolerances (rel_err = ||out - ref|| / ||ref||, NaN fails):
* post, comb (fp32 for every stream dtype): 1e-5. They differ from the reference in the 16384-term dot
  (tf32x3 on the GPU, in 32-column steps summed per 128-column chunk; the RMS factor applied after the
  dot, not before) and in the GPU's exp/sigmoid/rsqrt. The reference itself is ~2e-6 off float64 in the
  mixes; an emulation of the GPU mixes (tf32 split rounded to nearest, small parts truncated as the tensor
  core reads them, same step and chunk order) at V4 shapes with comb scale 8 gives rel_err ~6e-7 on comb
  and ~2e-7 on post, as an fp32 dot in another order does (plain tf32 gives ~4e-4 on comb: caught).
* collapsed, fp32 streams: 1e-5, same reasons. bf16 streams: the fp32 sum of pre_k * x_k differs from the
  reference by ~1e-7 relative before the single bf16 cast, so an element either matches or is one bf16 ulp
  off: elementwise |out - ref| <= 2^-7 * max(|out|, |ref|) (plus the fp32 error where the sum cancels),
  at most 1% of elements differ (measured 0.04% at V4 shapes), rel_err <= 1e-3.
* hc_post: the kernel rounds where the reference rounds (post, comb, post*out, the mix, the sum; FMA
  contraction is off, see the kernel module), so only the fp32 order of the 4-term mix of exact products
  differs. That moves the mix by a few fp32 ulps and flips its bf16 rounding only next to a rounding
  boundary, so an element matches or is one ulp off in the mix and one in the sum: elementwise
  |out - ref| <= 2^-6 * (|post*out| + sum_j comb*|x_j|) (a bf16 ulp is <= 2^-7 relative; the magnitude
  sum covers cancellation). bf16: at most 1% of elements differ (measured 4e-6; a dropped intermediate
  rounding changes 20-35%, as the FMA contraction of post*out did on the H200: rel_err 1.7e-3), hence
  rel_err <= 2^-7 * sqrt(1%) ~ 8e-4 <= 1e-3. fp32: rel_err <= 1e-6 (measured 4e-8).
  ``test_post_checks_are_sharp`` shows these checks reject a transposed comb, a missing post term and a
  dropped rounding.
Outputs are written into NaN-filled tensors and the partial-sum scratch starts as NaN (POISON_SCRATCH).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.ops.ref import mhc as ref  # noqa: E402
from deepinfer.ops.triton import mhc as tri  # noqa: E402
from deepinfer.ops.tuning import H200  # noqa: E402
from tests.gpu.conftest import poison_scratch_exact_fp32, rel_err  # noqa: E402

EPS = 1e-6
ITERS = 20  # hc_sinkhorn_iters of V4 (config/parse.py default)


@pytest.fixture(autouse=True)
def _poison_and_no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_scratch_exact_fp32(monkeypatch, tri)


def _case(T: int, N: int, H: int, dtype: torch.dtype, seed: int, device: str, head: bool = False):
    g = torch.Generator(device=device).manual_seed(seed)
    K, rows = N * H, (N if head else (2 + N) * N)
    mag = 10.0 ** (torch.rand(T, 1, 1, generator=g, device=device) * 2 - 1)
    streams = (torch.randn(T, N, H, generator=g, device=device) * mag).to(dtype)
    fn = torch.randn(rows, K, generator=g, device=device) / math.sqrt(K)
    base = torch.randn(rows, generator=g, device=device) * 0.5
    scale = torch.tensor([0.7] if head else [1.0, 1.5, 2.0 + seed % 7], device=device)
    return streams, fn, base, scale


def _pre(streams, *args, **kwargs):
    out = torch.full(streams[:, 0].shape, float("nan"), dtype=streams.dtype, device=streams.device)
    res = tri.hc_pre(streams, *args, out=out, **kwargs)
    assert res[0].data_ptr() == out.data_ptr()
    for r in res:
        assert torch.isfinite(r).all(), "unwritten or non-finite output"
    return res


def _check_collapsed(got: torch.Tensor, want: torch.Tensor, streams: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        assert rel_err(got, want) <= 1e-5, rel_err(got, want)
        return
    g, w = got.float(), want.float()
    # One bf16 ulp, plus the fp32 error of the sum where it cancels (pre_k <= 1 + eps).
    bound = 2.0**-7 * torch.maximum(g.abs(), w.abs()) + 1e-6 * streams.float().abs().sum(1)
    assert ((g - w).abs() <= bound).all(), (g - w).abs().max()
    assert (got != want).float().mean() <= 1e-2
    assert rel_err(got, want) <= 1e-3, rel_err(got, want)


def _check_pre(T, N, H, dtype, device, iters=ITERS, seed=0) -> None:
    args = _case(T, N, H, dtype, seed, device)
    got = _pre(*args, iters, EPS, EPS)
    want = ref.hc_pre(*args, iters, EPS, EPS)
    _check_collapsed(got[0], want[0], args[0])
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert rel_err(g, w) <= 1e-5, rel_err(g, w)


SMALL = [  # (T, N, H, K_CHUNK): ragged H, several K chunks (ragged last), N not a power of two, T > BLOCK_T
    (1, 4, 64, 1024), (5, 4, 72, 128), (17, 4, 128, 64), (3, 3, 40, 128), (70, 2, 32, 64), (2, 4, 256, 256),
]


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T, N, H, k_chunk", SMALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_pre_small(T, N, H, k_chunk, dtype, device, monkeypatch) -> None:
    monkeypatch.setattr(tri, "K_CHUNK", k_chunk)
    monkeypatch.setattr(tri, "BLOCK_H", 32)  # several collapse blocks (ragged for H = 40, 72)
    _check_pre(T, N, H, dtype, device, seed=T + H)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("iters", [1, 2, 7])
def test_hc_pre_sinkhorn_iters(iters, device) -> None:
    _check_pre(6, 4, 64, torch.float32, device, iters=iters, seed=iters)


@pytest.mark.parametrize("T", [1, 3, 16, 128, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_pre_v4_shapes(T, dtype, device) -> None:
    _check_pre(T, 4, 4096, dtype, device, seed=T)


@pytest.mark.parametrize("case", ["softmax", "peaked", "tiny_eps"])
def test_sinkhorn_fast_division_same_bits(case, device) -> None:
    """The Sinkhorn rounds by the division's fast path (``KernelTuning.mhc_fast_div``) give div_rn's bits: on V4-like inputs
    (fast path throughout), and where operands leave [2^-60, 2^60] (eps 1e-30 with peaked logits: entries
    near 1e-30), which must take the div_rn rounds instead; and peaked logits (entries at eps). GPU only
    (inline PTX)."""
    eps = 1e-30 if case == "tiny_eps" else EPS
    streams, fn, base, scale = _case(300, 4, 256, torch.bfloat16, 11, device)
    if case != "softmax":
        scale = torch.tensor([1.0, 1.5, 400.0 if case == "tiny_eps" else 4e4], device=device)
    got = {}
    for fast in (True, False):
        got[fast] = _pre(streams, fn, base, scale, ITERS, eps, EPS,
                         tuning=dataclasses.replace(H200, mhc_fast_div=fast))
    for g, w in zip(got[True], got[False]):
        assert torch.equal(g, w)
    if case == "tiny_eps":
        assert got[True][2].min() < 2.0**-60  # the fallback was needed
    if case == "softmax":  # (peaked logits amplify the mixes' rounding beyond the reference tolerance)
        want = ref.hc_pre(streams, fn, base, scale, ITERS, eps, EPS)
        assert rel_err(got[True][2], want[2]) <= 1e-5, rel_err(got[True][2], want[2])


def _check_head(T, N, H, dtype, device, seed=0) -> None:
    args = _case(T, N, H, dtype, seed, device, head=True)
    out = torch.full((T, H), float("nan"), dtype=dtype, device=device)
    got = tri.hc_head(*args, EPS, EPS, out=out)
    assert got.data_ptr() == out.data_ptr()
    _check_collapsed(got, ref.hc_head(*args, EPS, EPS), args[0])


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T, N, H, k_chunk", SMALL[:4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_head_small(T, N, H, k_chunk, dtype, device, monkeypatch) -> None:
    monkeypatch.setattr(tri, "K_CHUNK", k_chunk)
    monkeypatch.setattr(tri, "BLOCK_H", 32)
    _check_head(T, N, H, dtype, device, seed=T * 3 + H)


@pytest.mark.parametrize("T", [1, 128, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_head_v4_shapes(T, dtype, device) -> None:
    _check_head(T, 4, 4096, dtype, device, seed=T)


def _post_case(T, N, H, dtype, device, seed=0):
    streams, fn, base, scale = _case(T, N, H, dtype, seed, device)
    _, post, comb = ref.hc_pre(streams, fn, base, scale, ITERS, EPS, EPS)
    out = torch.randn(T, H, generator=torch.Generator(device=device).manual_seed(seed + 1), device=device)
    return streams, out.to(dtype), post, comb


def _post_failures(got, want, streams, out, post, comb) -> list[str]:
    """The hc_post checks (module docstring); returns the ones that fail."""
    assert got.dtype == want.dtype and got.shape == want.shape
    fails = []
    bound = post.abs()[..., None] * out.float().abs()[:, None, :]
    bound = bound + torch.matmul(comb.transpose(-1, -2), streams.float().abs())
    if not ((got.float() - want.float()).abs() <= 2.0**-6 * bound).all():
        fails.append("elementwise")
    err = rel_err(got, want)
    if err > (1e-6 if got.dtype == torch.float32 else 1e-3):
        fails.append(f"rel_err {err:.2e}")
    if got.dtype != torch.float32 and (frac := (got != want).float().mean().item()) > 1e-2:
        fails.append(f"differ {frac:.2%}")
    return fails


def _check_post(T, N, H, dtype, device, seed=0) -> None:
    streams, out, post, comb = _post_case(T, N, H, dtype, device, seed)
    res = torch.full_like(streams, float("nan"))
    got = tri.hc_post(streams, out, post, comb, result=res)
    assert got.data_ptr() == res.data_ptr() and torch.isfinite(got).all()
    want = ref.hc_post(streams, out, post, comb)
    assert _post_failures(got, want, streams, out, post, comb) == []
    # In place (result is streams): same bits as out of place.
    inplace = streams.clone()
    assert tri.hc_post(inplace, out, post, comb, result=inplace).data_ptr() == inplace.data_ptr()
    assert torch.equal(inplace, got)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T, N, H", [(1, 4, 64), (5, 4, 72), (3, 3, 600), (17, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_post_small(T, N, H, dtype, device) -> None:
    _check_post(T, N, H, dtype, device, seed=T + H)


@pytest.mark.parametrize("T", [1, 16, 128, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_post_v4_shapes(T, dtype, device) -> None:
    _check_post(T, 4, 4096, dtype, device, seed=T)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_checks_are_sharp(dtype, device) -> None:
    """The hc_post checks reject a transposed comb, a missing post term and a dropped rounding of post*out."""
    streams, out, post, comb = _post_case(5, 4, 72, dtype, device, seed=3)
    want = ref.hc_post(streams, out, post, comb)
    args = (streams, out, post, comb)
    assert _post_failures(tri.hc_post(*args), want, *args) == []
    assert "elementwise" in _post_failures(tri.hc_post(streams, out, post, comb.transpose(-1, -2)), want, *args)
    assert "elementwise" in _post_failures(tri.hc_post(streams, out, torch.zeros_like(post), comb), want, *args)
    if dtype == torch.bfloat16:  # post*out kept in fp32 into the final sum (what FMA contraction does)
        mix = torch.matmul(comb.to(dtype).transpose(-1, -2).double(), streams.double()).to(dtype).double()
        fused = (post.to(dtype).double()[..., None] * out.double()[:, None, :] + mix).to(dtype)
        assert any(f.startswith("differ") for f in _post_failures(fused, want, *args))


@pytest.mark.interpret_ok
@pytest.mark.parametrize("finish_programs", [None, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant(dtype, finish_programs, device, monkeypatch) -> None:
    """A token's outputs do not depend on the batch around it (alone, in a batch, permuted): bitwise.

    The batch sizes give different finish grids: a token's collapse split over H blocks, the Sinkhorn in
    its own program (T = 1, 2) or one program per token doing all of it (T large, FINISH_PROGRAMS = 8).
    """
    interp = device == "cpu"
    if interp:  # two mixes token blocks, three K chunks (ragged), five collapse blocks of H = 72
        monkeypatch.setattr(tri, "K_CHUNK", 128)
        monkeypatch.setattr(tri, "BLOCK_T", 16)
        monkeypatch.setattr(tri, "BLOCK_H", 16)
    if finish_programs is not None:
        monkeypatch.setattr(tri, "FINISH_PROGRAMS", finish_programs)
    T, N, H = (19, 4, 72) if interp else (300, 4, 4096)
    streams, fn, base, scale = _case(T, N, H, dtype, 7, device)
    batch = _pre(streams, fn, base, scale, ITERS, EPS, EPS)
    for lo, hi in ((0, 1), (5, 6), (T - 1, T), (3, 5)):
        part = _pre(streams[lo:hi], fn, base, scale, ITERS, EPS, EPS)
        for a, b in zip(part, batch):
            assert torch.equal(a, b[lo:hi])
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(8)).to(device)
    shuffled = _pre(streams[perm], fn, base, scale, ITERS, EPS, EPS)
    for a, b in zip(shuffled, batch):
        assert torch.equal(a, b[perm])
    _, hfn, hbase, hscale = _case(T, N, H, dtype, 9, device, head=True)
    head = tri.hc_head(streams, hfn, hbase, hscale, EPS, EPS)
    for lo, hi in ((0, 1), (3, 5)):
        assert torch.equal(tri.hc_head(streams[lo:hi], hfn, hbase, hscale, EPS, EPS), head[lo:hi])
    out = torch.randn(T, H, device=device).to(dtype)
    new = tri.hc_post(streams, out, batch[1], batch[2])
    one = tri.hc_post(streams[T - 1:], out[T - 1:], batch[1][T - 1:], batch[2][T - 1:])
    assert torch.equal(one[0], new[T - 1])
