"""Triton FP8 block-scaled linear against its reference twin, on fresh random inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.model.quant import quant_fp8_block, ue8m0_to_float
from deepinfer.ops.ref.fp8_linear import fp8_linear as ref_fp8_linear
from deepinfer.ops.tuning import H200
from tests.gpu.conftest import rel_err


def fp8_linear(*args, **kwargs):
    """The Triton kernel, imported lazily (collecting this file must not need Triton)."""
    from deepinfer.ops.triton.fp8_linear import fp8_linear as tri

    return tri(*args, **kwargs)


def _weights(n: int, k: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, s = quant_fp8_block(w, (128, 128))
    return q.to(device), ue8m0_to_float(s).float().to(device)


SMALL = [(1, 64, 96), (3, 130, 256), (17, 256, 200), (40, 96, 384), (130, 128, 256)]
LARGE = [(1, 1024, 4096), (1, 32768, 1024), (8, 4096, 4096), (32, 4096, 8192), (128, 8192, 4096),
         (300, 1000, 1000), (4096, 4096, 4096), (1, 512, 4096), (64, 24576, 1536)]


def _check(m, n, k, dtype, device, seed, pow2_scales=False):
    from deepinfer.ops.triton.fp8_linear import fp8_linear

    w, s = _weights(n, k, seed, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    out = fp8_linear(x, w, s, pow2_scales=pow2_scales)
    ref = ref_fp8_linear(x.float(), w, s)  # fp32 spec
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16 output rounding (2^-8) dominates
    assert rel_err(out, ref) <= tol


@pytest.mark.interpret_ok
@pytest.mark.parametrize("m, n, k", SMALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_shapes(m, n, k, dtype, device) -> None:
    _check(m, n, k, dtype, device, seed=m * 7 + n)


@pytest.mark.parametrize("m, n, k", LARGE)
def test_v4_shapes_bf16(m, n, k, device) -> None:
    _check(m, n, k, torch.bfloat16, device, seed=n + k)


@pytest.mark.parametrize("m, n, k", [(300, 1000, 1000), (4096, 4096, 4096), (2048, 1024, 4096), (257, 32768, 1024)])
def test_large_m_pow2_scale_path(m, n, k, device) -> None:
    """UE8M0 (power-of-two) scales take the weight-as-A path at large M (quant_fp8_block makes them)."""
    _check(m, n, k, torch.bfloat16, device, seed=n + k + 1, pow2_scales=True)


@pytest.mark.interpret_ok
def test_large_m_pow2_scale_path_small(device) -> None:
    _check(260, 200, 256, torch.bfloat16, device, seed=9, pow2_scales=True)


def test_row_is_batch_invariant_within_a_bucket(device) -> None:
    """One row's result does not depend on the other rows of the same M bucket."""
    from deepinfer.ops.triton.fp8_linear import fp8_linear

    w, s = _weights(4096, 4096, 3, device)
    x = torch.randn(16, 4096, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    alone = fp8_linear(x[5:6].contiguous(), w, s)
    batch = fp8_linear(x, w, s)
    assert torch.equal(alone[0], batch[5])


@pytest.mark.interpret_ok
def test_split_k_epilogue_repeats_bit_for_bit(device) -> None:
    """The split-K tickets are reset by the last program of each tile: back-to-back calls (different shapes
    in between) give identical bits, and the split path matches the reference."""
    from deepinfer.ops.triton import fp8_linear as tri

    w, s = _weights(128, 1024, 6, device)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(7)).to(device)
    assert tri._config(2, 128, 1024, H200)[2] > 1  # this shape takes the split-K path
    first = tri.fp8_linear(x, w, s)
    tri.fp8_linear(torch.randn(3, 256, device=device), *_weights(64, 256, 8, device))
    again = tri.fp8_linear(x, w, s)
    assert torch.equal(first, again)
    assert int(tri._tickets(x.device).abs().sum()) == 0
    assert rel_err(first, ref_fp8_linear(x, w, s)) <= 1e-4


def _check_grouped(m, groups, r, k, device, pow2_scales=False):
    from deepinfer.ops.ref.fp8_linear import fp8_linear_grouped as ref_grouped
    from deepinfer.ops.triton.fp8_linear import fp8_linear_grouped

    w, s = _weights(groups * r, k, m + r, device)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(r)).to(device, torch.bfloat16)
    out = fp8_linear_grouped(x, w, s, groups, pow2_scales=pow2_scales)
    want = ref_grouped(x.float(), w, s, groups)
    assert out.shape == (m, groups * r) and rel_err(out, want) <= 1e-2
    # Same as running each group alone through the plain kernel.
    g1 = fp8_linear(x[:, k : 2 * k].contiguous(), w[r : 2 * r], s[r // 128 : 2 * r // 128], pow2_scales=pow2_scales)
    assert rel_err(out[:, r : 2 * r], g1.float()) <= 1e-2


@pytest.mark.interpret_ok
@pytest.mark.parametrize("m", [1, 5, 260])
def test_grouped_one_launch_small(m, device) -> None:
    _check_grouped(m, 2, 128, 128, device, pow2_scales=True)


@pytest.mark.parametrize("m", [1, 32, 128, 4096])
def test_grouped_v4_wo_a(m, device) -> None:
    """V4-Flash wo_a: 8 groups, 1024 rows each, 4096 input columns per group."""
    _check_grouped(m, 8, 1024, 4096, device, pow2_scales=True)



def test_e4m3_to_bf16_by_bit_placement_is_exact(device) -> None:
    """The kernels' e4m3 -> bf16 (integer bit placement and one bf16 multiply by 2^120) gives every finite
    code's exact value, subnormals and both zeros included. (GPU only: the interpreter cannot multiply bf16.)"""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.ops.triton import fp8_linear as tri

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).cuda()
    got = torch.empty(256, dtype=torch.float32, device="cuda")
    _convert_kernel()[(1,)](codes, got)
    want = codes.float()
    finite = torch.isfinite(want)
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))
    # And whole GEMMs either way, the decode split-K path and the large-M weight-as-A path: the same bits.
    # (The small-M decode path has no hardware-conversion variant: it is off here; its own test is below.)
    w, s = _weights(1024, 4096, 11, "cuda")
    for m in (3, 40, 300):
        x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
        no_decode = dataclasses.replace(H200, fp8_decode_max_m=0)
        by_bits = tri.fp8_linear(x, w, s, pow2_scales=True, tuning=no_decode)
        by_cvt = tri.fp8_linear(x, w, s, pow2_scales=True,
                                tuning=dataclasses.replace(no_decode, fp8_e4m3_by_bits=False))
        assert torch.equal(by_bits, by_cvt), m


# Small-M shapes of the swap-AB decode path (power-of-two scales): V4 decode GEMMs, ragged N, K blocks that
# do not split evenly, every M bucket.
DECODE = [(1, 1536, 4096), (1, 40960, 1024), (3, 4096, 8192), (8, 4096, 4096), (16, 4096, 2048),
          (17, 1000, 896), (32, 4096, 8192), (64, 200, 1152), (40, 130, 384), (33, 64, 128)]


@pytest.mark.parametrize("m, n, k", DECODE)
def test_decode_path_against_reference(m, n, k, device) -> None:
    """The decode path (GPU only: inline PTX) against the reference, and against the split-K MMA path."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.ops.triton import fp8_linear as tri

    assert m <= H200.fp8_decode_max_m and k % 128 == 0
    _check(m, n, k, torch.bfloat16, device, seed=n + k + m, pow2_scales=True)
    w, s = _weights(n, k, n + k + m, device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n + k + m + 1)).to(device, torch.bfloat16)
    mma = tri.fp8_linear(x, w, s, pow2_scales=True, tuning=dataclasses.replace(H200, fp8_decode_max_m=0))
    assert rel_err(tri.fp8_linear(x, w, s, pow2_scales=True), mma.float()) <= 1e-2


def test_decode_path_reads_every_code_exactly(device) -> None:
    """One-hot activations pick single weights out of the decode path: every finite e4m3 code, at every
    row and K position of a tile (the kernel's permuted orders), times its block scale, comes out exact."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.ops.triton import fp8_linear as tri

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[torch.isfinite(codes.view(torch.float8_e4m3fn).float())]  # 254 finite codes
    n, k = 192, 256  # 1.5 scale blocks of rows, two of K
    g = torch.Generator().manual_seed(5)
    w = codes[torch.randint(0, codes.numel(), (n, k), generator=g)].view(torch.float8_e4m3fn).cuda()
    w.view(torch.uint8).view(-1)[: codes.numel()] = codes.cuda()  # each code at least once
    s = (2.0 ** torch.randint(-12, 3, (2, 2), generator=g).float()).cuda()
    want = (w.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)).t()  # [k, n]
    for first in range(0, k, 64):
        x = torch.zeros(64, k, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(64), first + torch.arange(64)] = 1.0
        got = tri.fp8_linear(x, w, s, pow2_scales=True)
        assert torch.equal(got.float(), want[first : first + 64].bfloat16().float()), first


def test_decode_split_k_repeats_bit_for_bit(device) -> None:
    """The decode path's split-K tickets reset too: repeated calls give the same bits."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.ops.triton import fp8_linear as tri

    w, s = _weights(4096, 8192, 12, device)
    x = torch.randn(2, 8192, generator=torch.Generator().manual_seed(13)).to(device, torch.bfloat16)
    first = tri.fp8_linear(x, w, s, pow2_scales=True)
    tri.fp8_linear(x[:1, :1024].contiguous(), *_weights(256, 1024, 14, device), pow2_scales=True)
    assert torch.equal(first, tri.fp8_linear(x, w, s, pow2_scales=True))
    assert int(tri._tickets(x.device).abs().sum()) == 0


def _convert_kernel():
    """A one-program kernel applying ``e4m3_to_bf16`` to 256 codes (built lazily: Triton is imported only
    where a test runs it)."""
    global e4m3_to_bf16  # the kernel below resolves it among this module's globals when it compiles
    import triton
    import triton.language as tl

    from deepinfer.ops.triton.e4m3 import e4m3_to_bf16

    @triton.jit
    def convert(src, dst):
        offs = tl.arange(0, 256)
        tl.store(dst + offs, e4m3_to_bf16(tl.load(src + offs)).to(tl.float32))

    return convert
