"""Triton RMSNorm / RoPE ops (``ops/triton/rope_norm.py``) against their reference twins.

Fresh fixed-seed random inputs per case: rows of very different scales (the norm must remove them), RoPE
angles at positions up to 2^17 with cos/sin scaled by 1.2 (as a YaRN attention factor does), ragged T and
head counts that do not fill a head block. Outputs that are not in place start as NaN; in-place RoPE gets
NaN in the channels it must neither read nor write, and they must still be NaN afterwards.

Tolerances. fp32: the same fp32 steps, but the sum of squares runs in another order (measured 5e-8 to
7e-8 relative in the interpreter, a few fp32 ulps; RoPE alone is bit-exact); 1e-6 still catches a tf32-like
product or an unrotated pair (>= 1e-4). bf16 rounds where the reference rounds and multiplies/adds without
FMA contraction, so outputs are bit-identical except where an fp32-ulp change in the variance moves a
rounded factor or output by one bf16 ulp (measured on ~1e-5 of the elements, rel_err ~1e-5). Bounds: at
most 1% of the elements differ (skipping the reference's rounding of the factor alone flips ~26%), and
rel_err <= 4e-3, below what one ulp (2^-8 relative) on every element would give.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.ref import rope_norm as ref
from deepinfer.ops.ref.rope import cos_sin
from tests.gpu.conftest import rel_err

TOL = {torch.bfloat16: 4e-3, torch.float32: 1e-6}
MISMATCH = 1e-2  # bf16: fraction of elements allowed to differ (by a rounding flip)
EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float32]
SMALL_T = [1, 3, 17, 300]


def _tri():
    from deepinfer.ops.triton import rope_norm

    return rope_norm


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _acts(shape, dtype, g, device) -> torch.Tensor:
    scale = torch.randn(*shape[:-1], 1, generator=g).mul(2).exp()  # per-row scales over ~e^+-6
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _tables(T: int, rope_dim: int, dtype, g, device, factor: float = 1.2):
    freqs = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    cos, sin = cos_sin(torch.randint(0, 1 << 17, (T,), generator=g), freqs, factor, dtype)
    return cos.to(device), sin.to(device)


def _check(out: torch.Tensor, want: torch.Tensor) -> None:
    assert out.dtype == want.dtype and out.shape == want.shape
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, want) <= TOL[want.dtype], rel_err(out, want)
    if want.dtype == torch.bfloat16:
        assert (out != want).float().mean().item() <= MISMATCH


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _check_rms_norm(shape, dtype, device, seed) -> None:
    g = _gen(seed)
    x = _acts(shape, dtype, g, device)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(device)
    out = _poisoned(shape, dtype, device)
    assert _tri().rms_norm(x, w, EPS, out=out) is out
    _check(out, ref.rms_norm(x, w, EPS))


def _check_norm_rope_heads(T, H, D, R, dtype, device, seed) -> None:
    g = _gen(seed)
    q = _acts((T, H, D), dtype, g, device)
    cos, sin = _tables(T, R, dtype, g, device)
    want = ref.norm_rope_heads(q, cos, sin, EPS)
    buf = q.clone()
    out = _tri().norm_rope_heads(buf, cos, sin, EPS)
    assert out.data_ptr() == buf.data_ptr()  # in place
    _check(out, want)


def _check_norm_rope(T, D, R, dtype, device, seed) -> None:
    g = _gen(seed)
    x = _acts((T, D), dtype, g, device)
    w = (torch.rand(D, generator=g) + 0.5).to(device)
    cos, sin = _tables(T, R, dtype, g, device)
    out = _poisoned((T, D), dtype, device)
    assert _tri().norm_rope(x, w, EPS, cos, sin, out=out) is out
    _check(out, ref.norm_rope(x, w, EPS, cos, sin))


def _check_norm_rope_rows(T, D, R, dtype, device, seed) -> None:
    """The cache-write form: token t's row lands in table[rows[t]]; every other row is left as it was."""
    g = _gen(seed)
    x = _acts((T, D), dtype, g, device)
    w = (torch.rand(D, generator=g) + 0.5).to(device)
    cos, sin = _tables(T, R, dtype, g, device)
    rows = (torch.randperm(3 * T + 5, generator=g)[:T]).to(device)
    table = _acts((3 * T + 5, D), dtype, g, device)
    want = ref.norm_rope(x, w, EPS, cos, sin, out=table.clone(), rows=rows)
    got = table.clone()
    assert _tri().norm_rope(x, w, EPS, cos, sin, out=got, rows=rows.int() if seed % 2 else rows) is got
    untouched = torch.ones(len(table), dtype=torch.bool, device=device)
    untouched[rows] = False
    assert torch.equal(got[untouched], table[untouched])
    _check(got[rows], want[rows])
    _check(got[rows], ref.norm_rope(x, w, EPS, cos, sin))


def _check_rope(T, H, D, R, inverse, dtype, device, seed) -> None:
    g = _gen(seed)
    cos, sin = _tables(T, R, dtype, g, device)
    # A view into a wider buffer (strided rows), the nope channels poisoned: never read, never written.
    wide = _acts((T, H + 2, D), dtype, g, device)
    x = wide[:, 1:H + 1]
    x[..., :D - R] = float("nan")
    want = ref.rope(x, cos, sin, inverse=inverse)
    spare = wide[:, [0, H + 1]].clone()
    out = _tri().rope(x, cos, sin, inverse=inverse)
    assert out.data_ptr() == x.data_ptr()
    assert torch.isnan(out[..., :D - R]).all()
    _check(out[..., D - R:], want[..., D - R:])
    assert torch.equal(wide[:, [0, H + 1]], spare)  # neighbouring rows untouched


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T", SMALL_T)
@pytest.mark.parametrize("C", [64, 96, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_small(T, C, dtype, device) -> None:
    _check_rms_norm((T, C), dtype, device, seed=T * 31 + C)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_streams(dtype, device) -> None:
    _check_rms_norm((5, 4, 128), dtype, device, seed=7)  # [T, N, H] mHC streams (the MTP hnorm)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T", SMALL_T)
@pytest.mark.parametrize("H, D, R", [(5, 128, 32), (4, 64, 64), (3, 48, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_heads_small(T, H, D, R, dtype, device) -> None:
    _check_norm_rope_heads(T, H, D, R, dtype, device, seed=T * 131 + H * 7 + D)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T", SMALL_T)
@pytest.mark.parametrize("D, R", [(128, 32), (64, 64), (96, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_small(T, D, R, dtype, device) -> None:
    _check_norm_rope(T, D, R, dtype, device, seed=T * 17 + D + R)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T", SMALL_T)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_into_rows(T, dtype, device) -> None:
    _check_norm_rope_rows(T, 128, 32, dtype, device, seed=T * 5 + 1)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T", SMALL_T)
@pytest.mark.parametrize("H, D, R", [(5, 128, 32), (3, 64, 64)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_small(T, H, D, R, inverse, dtype, device) -> None:
    _check_rope(T, H, D, R, inverse, dtype, device, seed=T * 3 + H + D + inverse)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_round_trip(dtype, device) -> None:
    """rope then inverse rope gives x back (cos^2 + sin^2 = 1 up to the tables' rounding), like the reference."""
    g = _gen(11)
    x = _acts((17, 3, 64), dtype, g, device)
    cos, sin = _tables(17, 32, dtype, g, device, factor=1.0)
    back = _tri().rope(_tri().rope(x.clone(), cos, sin), cos, sin, inverse=True)
    want = ref.rope(ref.rope(x, cos, sin), cos, sin, inverse=True)
    _check(back, want)
    assert rel_err(back, x) <= (1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(back[..., :32], x[..., :32])


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant(dtype, device) -> None:
    """A row's bits do not depend on how many other tokens share the launch."""
    g, tri = _gen(5), _tri()
    q = _acts((300, 5, 128), dtype, g, device)
    w = (torch.rand(128, generator=g) + 0.5).to(device)
    cos, sin = _tables(300, 32, dtype, g, device)
    full = tri.norm_rope_heads(q.clone(), cos, sin, EPS)
    part = tri.norm_rope_heads(q[:17].clone(), cos[:17], sin[:17], EPS)
    assert torch.equal(full[:17], part)
    x = q[:, 0].contiguous()
    assert torch.equal(tri.norm_rope(x, w, EPS, cos, sin)[:3], tri.norm_rope(x[:3], w, EPS, cos[:3], sin[:3]))
    assert torch.equal(tri.rms_norm(x, w, EPS)[:1], tri.rms_norm(x[:1], w, EPS))


@pytest.mark.interpret_ok
def test_op_tables(device) -> None:
    from deepinfer.model.norm import RMSNorm
    from deepinfer.ops.ref.norm import rms_norm
    from deepinfer.ops.table import REF, triton_ops
    from deepinfer.ops.tuning import H200

    tri = triton_ops(H200)  # the device's own SM count does not matter here (and the interpreter has no device)
    assert REF.rms_norm is rms_norm  # the reference path keeps its exact bits
    assert (tri.rms_norm, tri.norm_rope_heads, tri.norm_rope, tri.rope) == (
        _tri().rms_norm, _tri().norm_rope_heads, _tri().norm_rope, _tri().rope)
    norm = RMSNorm(64, EPS).to(device)
    x = _acts((9, 64), torch.bfloat16, _gen(3), device)
    want = norm(x)
    norm.ops = tri
    _check(norm(x), want)


# V4-Flash shapes: hidden 4096, q_lora 1024, head 512 with 64 rope channels, 64 heads; indexer 64 x 128.
V4_T = [1, 17, 4096]


@pytest.mark.parametrize("T", V4_T)
@pytest.mark.parametrize("C", [4096, 1024, 512])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_v4_shapes(T, C, dtype, device) -> None:
    _check_rms_norm((T, C), dtype, device, seed=T + C)


@pytest.mark.parametrize("T", V4_T)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_heads_v4_shapes(T, dtype, device) -> None:
    _check_norm_rope_heads(T, 64, 512, 64, dtype, device, seed=T)


@pytest.mark.parametrize("T", V4_T)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_v4_shapes(T, dtype, device) -> None:
    _check_norm_rope(T, 512, 64, dtype, device, seed=T + 1)


@pytest.mark.parametrize("T", V4_T)
@pytest.mark.parametrize("H, D, inverse", [(64, 128, False), (64, 512, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_v4_shapes(T, H, D, inverse, dtype, device) -> None:
    _check_rope(T, H, D, 64, inverse, dtype, device, seed=T + D)


def _check_pairs(T, C, D, R, H, HD, HI, HID, dtype, device, seed) -> None:
    """``latent_norms`` and ``heads_norm_rope`` (two ops per launch) give exactly the separate ops' bits, in
    place where those are, and leave the window rows no token writes as they were."""
    g, tri = _gen(seed), _tri()
    xq = _acts((T, C + D), dtype, g, device)
    wq, wkv = (torch.rand(C, generator=g) + 0.5).to(device), (torch.rand(D, generator=g) + 0.5).to(device)
    cos, sin = _tables(T, R, dtype, g, device)
    rows = torch.randperm(3 * T + 5, generator=g)[:T].to(device)
    table = _acts((3 * T + 5, D), dtype, g, device)
    got_table = table.clone()
    q_res = tri.latent_norms(xq, C, wq, EPS, wkv, EPS, cos, sin, window=got_table, rows=rows)
    assert torch.equal(q_res, tri.rms_norm(xq[:, :C], wq, EPS))
    assert torch.equal(got_table, tri.norm_rope(xq[:, C:], wkv, EPS, cos, sin, out=table.clone(), rows=rows))
    want_table = table.clone()
    _check(q_res, ref.latent_norms(xq, C, wq, EPS, wkv, EPS, cos, sin, window=want_table, rows=rows))
    _check(got_table, want_table)
    q_all = _acts((T, H * HD + HI * HID), dtype, g, device)
    q, q_ix = q_all[:, : H * HD].view(T, H, HD), q_all[:, H * HD :].view(T, HI, HID)
    want_q, want_ix = tri.norm_rope_heads(q.clone(), cos, sin, EPS), tri.rope(q_ix.clone(), cos, sin)
    ref_q, ref_ix = ref.heads_norm_rope(q, cos, sin, EPS, q_ix)
    got_q, got_ix = tri.heads_norm_rope(q, cos, sin, EPS, q_ix)
    assert got_q.data_ptr() == q.data_ptr() and got_ix.data_ptr() == q_ix.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_ix, want_ix)
    _check(got_q, ref_q)
    _check(got_ix, ref_ix)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_small(T, dtype, device) -> None:
    _check_pairs(T, 96, 128, 32, 5, 128, 3, 64, dtype, device, seed=T + 40)


@pytest.mark.interpret_ok
def test_pairs_fall_back_to_two_launches(device) -> None:
    """Rows wider than one 4-warp tile (a q latent of 8192) take two launches: the same results."""
    _check_pairs(2, 8192, 128, 32, 2, 64, 2, 64, torch.bfloat16, device, seed=47)


@pytest.mark.parametrize("T", V4_T)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_v4_shapes(T, dtype, device) -> None:
    _check_pairs(T, 1024, 512, 64, 64, 512, 64, 128, dtype, device, seed=T + 50)
