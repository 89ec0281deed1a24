"""Triton mHC kernels (``hc_pre``, ``hc_post``, ``hc_head``) vs ``ops/ref/mhc.py``, plus batch invariance.

Fresh fixed-seed inputs per case: streams with a per-token scale spread of 100x (the RMS factor matters),
fn ~ N(0, 1/K) so the mixes are O(1), comb scales up to 8 (peaked softmax before Sinkhorn).

Tolerances (rel_err = ||out - ref|| / ||ref||, NaN fails):
* post, comb (fp32 for every stream dtype): 1e-5. Both sides do fp32 math on the same values; they differ
  in the order of the 16384-term dot (the kernel also applies the RMS factor after the dot, not before) and
  in the GPU's exp/sigmoid/rsqrt. The reference itself is ~2e-6 off float64 in the mixes; an emulation of
  the kernel's order at V4 shapes gives rel_err ~1.5e-6 on comb with comb scale 8, ~3e-7 on post.
* collapsed, fp32 streams: 1e-5, same reasons. bf16 streams: the fp32 sum of pre_k * x_k differs from the
  reference by ~1e-7 relative before the single bf16 cast, so an element either matches or is one bf16 ulp
  off: elementwise |out - ref| <= 2^-7 * max(|out|, |ref|) (plus the fp32 error where the sum cancels),
  at most 1% of elements differ (measured 0.04% at V4 shapes), rel_err <= 1e-3.
* hc_post: the kernel rounds where the reference rounds (post, comb, post*out, the mix, the sum), so only
  the fp32 order of the 4-term mix differs: elementwise |out - ref| <= 2^-6 * (|post*out| + sum_j comb*|x_j|)
  (one ulp of each rounded term, covering cancellation in the final sum); for bf16 at most 1% of elements
  differ (measured 0.04%; rounding once in fp32 instead would change ~40%) and rel_err <= 1e-3; for fp32
  rel_err <= 1e-6 (measured 4e-8).
Outputs are written into NaN-filled tensors and the partial-sum scratch starts as NaN (POISON_SCRATCH).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.ops.ref import mhc as ref  # noqa: E402
from deepinfer.ops.triton import mhc as tri  # noqa: E402
from tests.gpu.conftest import rel_err  # noqa: E402

EPS = 1e-6
ITERS = 20  # hc_sinkhorn_iters of V4 (config/parse.py default)


@pytest.fixture(autouse=True)
def _poison_and_no_tf32(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tri, "POISON_SCRATCH", True)
    if torch.cuda.is_available():  # the fp32 reference must not run in tf32 (1e-3 error)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    yield


def _case(T: int, N: int, H: int, dtype: torch.dtype, seed: int, device: str, head: bool = False):
    g = torch.Generator(device=device).manual_seed(seed)
    K, rows = N * H, (N if head else (2 + N) * N)
    mag = 10.0 ** (torch.rand(T, 1, 1, generator=g, device=device) * 2 - 1)
    streams = (torch.randn(T, N, H, generator=g, device=device) * mag).to(dtype)
    fn = torch.randn(rows, K, generator=g, device=device) / math.sqrt(K)
    base = torch.randn(rows, generator=g, device=device) * 0.5
    scale = torch.tensor([0.7] if head else [1.0, 1.5, 2.0 + seed % 7], device=device)
    return streams, fn, base, scale


def _pre(streams, *args):
    out = torch.full(streams[:, 0].shape, float("nan"), dtype=streams.dtype, device=streams.device)
    res = tri.hc_pre(streams, *args, out=out)
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
    (1, 4, 64, 1024), (5, 4, 72, 128), (17, 4, 128, 64), (3, 3, 40, 128), (33, 2, 32, 64), (2, 4, 256, 256),
]


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T, N, H, k_chunk", SMALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_pre_small(T, N, H, k_chunk, dtype, device, monkeypatch) -> None:
    monkeypatch.setattr(tri, "K_CHUNK", k_chunk)
    _check_pre(T, N, H, dtype, device, seed=T + H)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("iters", [1, 2, 7])
def test_hc_pre_sinkhorn_iters(iters, device) -> None:
    _check_pre(6, 4, 64, torch.float32, device, iters=iters, seed=iters)


@pytest.mark.parametrize("T", [1, 3, 16, 128, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_pre_v4_shapes(T, dtype, device) -> None:
    _check_pre(T, 4, 4096, dtype, device, seed=T)


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
    _check_head(T, N, H, dtype, device, seed=T * 3 + H)


@pytest.mark.parametrize("T", [1, 128, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_head_v4_shapes(T, dtype, device) -> None:
    _check_head(T, 4, 4096, dtype, device, seed=T)


def _check_post(T, N, H, dtype, device, seed=0) -> None:
    streams, fn, base, scale = _case(T, N, H, dtype, seed, device)
    _, post, comb = ref.hc_pre(streams, fn, base, scale, ITERS, EPS, EPS)
    out = torch.randn(T, H, generator=torch.Generator(device=device).manual_seed(seed + 1), device=device)
    out = out.to(dtype)
    res = torch.full_like(streams, float("nan"))
    got = tri.hc_post(streams, out, post, comb, result=res)
    assert got.data_ptr() == res.data_ptr() and torch.isfinite(got).all()
    want = ref.hc_post(streams, out, post, comb)
    assert got.dtype == want.dtype and got.shape == want.shape
    bound = post.abs()[..., None] * out.float().abs()[:, None, :]
    bound = bound + torch.matmul(comb.transpose(-1, -2), streams.float().abs())
    assert ((got.float() - want.float()).abs() <= 2.0**-6 * bound).all()
    if dtype == torch.float32:
        assert rel_err(got, want) <= 1e-6, rel_err(got, want)
    else:
        assert rel_err(got, want) <= 1e-3, rel_err(got, want)
        assert (got != want).float().mean() <= 1e-2
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
def test_batch_invariant(dtype, device, monkeypatch) -> None:
    """A token's outputs do not depend on the batch around it (alone, in a batch, permuted): bitwise."""
    interp = device == "cpu"
    if interp:
        monkeypatch.setattr(tri, "K_CHUNK", 128)
    T, N, H = (19, 4, 72) if interp else (300, 4, 4096)
    streams, fn, base, scale = _case(T, N, H, dtype, 7, device)
    batch = _pre(streams, fn, base, scale, ITERS, EPS, EPS)
    for t in (0, 5, T - 1):
        alone = _pre(streams[t:t + 1], fn, base, scale, ITERS, EPS, EPS)
        for a, b in zip(alone, batch):
            assert torch.equal(a[0], b[t])
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(8)).to(device)
    shuffled = _pre(streams[perm], fn, base, scale, ITERS, EPS, EPS)
    for a, b in zip(shuffled, batch):
        assert torch.equal(a, b[perm])
    out = torch.randn(T, H, device=device).to(dtype)
    new = tri.hc_post(streams, out, batch[1], batch[2])
    one = tri.hc_post(streams[T - 1:], out[T - 1:], batch[1][T - 1:], batch[2][T - 1:])
    assert torch.equal(one[0], new[T - 1])
