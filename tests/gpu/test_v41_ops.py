"""DeepSeek-V4.1's RoPE and key-list attention kernels (``ops/triton/rope_v41.py``, ``ops/triton/key_lists.py``)
against their reference twins (``ops/ref/rope_v41.py``, ``ops/ref/key_lists.py``); also the cache-row, SwiGLU and
Engram kernels (``ops/triton/engram_v41.py``: the n-gram hash, equal as integers, and the FP8 table gather, bit-equal).

Fixed-seed random inputs: V4.1-Flash's shapes (64 heads of 512 with a 64-channel rope; the indexer's 64 heads
of 128) and small ones for the interpreter; angles of positions up to 2^17 (the "compress" table's YaRN
frequencies and the plain "main" table); key lists with padding (-1) inside and at the end, queries that see
no key at all, entries of another source, and several orders of the same keys' rows.

Tolerances. RoPE: fp32 rel_err <= 1e-6 (a last-bit difference of CUDA's complex multiply, which may contract
into an FMA; an unrotated or wrongly paired channel gives >= 1e-2), bf16 at most 1% of elements one rounding
apart; the nope channels bit-equal and the input untouched. Attention: fp32 rel_err <= 1e-5 (the reference's
fp32 sums in another order), bf16 <= 1e-2 (the kernel rounds the probabilities to bf16 before P.V, ~2^-9
relative each; a wrong key or a missing sink moves the output by > 10%).

Compressor pooling (``ops/triton/compress_pool_v41.py``): state pools whose rows entries share, scores equal in
every row, -1e30 / -3e38 beside finite ones, magnitudes in the thousands (exp overflows without the max
subtraction: NaN) and plain N(0, 16) ones (a softmax over the channels instead of the r rows is off by O(1)). fp32
rel_err <= 1e-6 (exp implementations differ in the last bit: libdevice's on CUDA, numpy's in the interpreter,
torch's own vectorised one in its CPU softmax), bf16 at most 1% of elements one rounding apart, none further.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.model import RopeConfig
from deepinfer.model.v41.rope import angles
from deepinfer.ops.ref import key_lists as ref_lists
from deepinfer.ops.ref import rope_v41 as ref_rope
from tests.gpu.conftest import rel_err

MAIN = RopeConfig(rope_dim=64, theta=10000.0)
COMPRESS = RopeConfig(rope_dim=64, theta=160000.0, yarn_factor=16.0, original_max_position_embeddings=65536,
                      beta_fast=32.0, beta_slow=1.0)


def _tri():
    from deepinfer.ops.triton import key_lists, rope_v41

    return rope_v41, key_lists


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,rope", [((5, 3, 96), MAIN), ((7, 96), COMPRESS)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_small(shape, rope, dtype, inverse, device) -> None:
    _check_rope(shape, rope, dtype, inverse, device, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 512), (33, 64, 512), (300, 512), (17, 64, 128)])
@pytest.mark.parametrize("rope", [MAIN, COMPRESS])
def test_rope_v41_shapes(shape, rope, dtype, device) -> None:
    _check_rope(shape, rope, dtype, False, device, seed=2)
    _check_rope(shape, rope, dtype, True, device, seed=3)


def _check_rope(shape, rope: RopeConfig, dtype, inverse: bool, device, seed: int) -> None:
    g = _gen(seed)
    values = (torch.randn(*shape, generator=g) * 3).to(dtype).to(device)
    positions = torch.randint(0, 1 << 17, (shape[0],), generator=g).to(device)
    ang = angles(rope, positions)
    before = values.clone()
    out = _tri()[0].apply_rope(values, ang, inverse)
    want = ref_rope.apply_rope(values, ang, inverse)
    assert torch.equal(values, before), "the input was written"
    assert out.shape == want.shape and out.dtype == want.dtype
    r = 2 * ang.shape[-1]
    assert torch.equal(out[..., :-r], want[..., :-r]), "nope channels changed"
    if dtype == torch.float32:
        assert rel_err(out, want) <= 1e-6, rel_err(out, want)
    else:
        assert (out != want).float().mean().item() <= 1e-2
        assert rel_err(out, want) <= 4e-3


def _lists(g, rows: int, queries: int, width: int, pad: float) -> torch.Tensor:
    """[queries, width] row ids into ``rows`` rows, a fraction ``pad`` of them -1 (anywhere), unique per row."""
    ids = torch.stack([torch.randperm(rows, generator=g)[:width] for _ in range(queries)])
    return torch.where(torch.rand(queries, width, generator=g) < pad, -1, ids)


def _check_attention(L, H, D, rw, w, re, k, dtype, device, seed: int) -> None:
    g = _gen(seed)
    q = torch.randn(L, H, D, generator=g).to(dtype).to(device)
    window = torch.randn(rw, D, generator=g).to(dtype).to(device)
    sink = torch.randn(H, generator=g).float().to(device)
    window_ids = _lists(g, rw, L, w, 0.3)
    window_ids[0] = -1  # a query with no window key
    entries = entry_ids = None
    if re:
        entries = torch.randn(re, D, generator=g).to(dtype).to(device)
        entry_ids = _lists(g, re, L, k, 0.2)
        entry_ids[0, :] = -1  # ... and no entry either: all its mass on the sink (zeros)
        entry_ids = entry_ids.to(device)
    window_ids = window_ids.to(device)
    out = _tri()[1].attend_lists(q, sink, window, window_ids, entries, entry_ids)
    want = ref_lists.attend_lists(q, sink, window, window_ids, entries, entry_ids)
    assert out.shape == want.shape and out.dtype == want.dtype and torch.isfinite(out).all()
    if re:
        assert torch.count_nonzero(out[0]) == 0, "a query with no key must give zeros"
    assert rel_err(out, want) <= (1e-5 if dtype == torch.float32 else 1e-2), rel_err(out, want)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("re,k", [(0, 0), (40, 12)])
def test_attend_lists_small(re, k, dtype, device) -> None:
    if device == "cpu" and re:
        # Two sources at a small batch take the kernel's split path, which this Triton's interpreter refuses
        # ("mask has unsupported dtype"; V4's test_small_batch_split too); CUDA runs it.
        pytest.skip("the split path does not run in the Triton interpreter")
    _check_attention(5, 4, 32, 24, 8, re, k, dtype, device, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,re,k", [(1, 0, 0), (32, 0, 0), (1, 1024, 512), (8, 4096, 512), (128, 512, 256)])
def test_attend_lists_v41_shapes(L, re, k, dtype, device) -> None:
    _check_attention(L, 64, 512, max(256, L * 128), 128, re, k, dtype, device, seed=5)


def _check_fp8_rows(n: int, c: int, dtype, device, seed: int, store: bool = True) -> None:
    from deepinfer.ops.ref import cache_rows_v41 as ref_rows
    from deepinfer.ops.triton import cache_rows_v41 as tri_rows

    g = _gen(seed)
    scale = torch.randn(n, 1, generator=g).mul(4).exp()  # rows over ~e^+-12: every scale exponent path
    values = (torch.randn(n, c, generator=g) * scale)
    values[0] = 0.0  # amax 0: the 1e-4 floor
    values[1, :32] = 1e-30  # a tiny group beside normal ones
    values = values.to(dtype).to(device)
    rows = 3 * n + 5
    where = torch.randperm(rows, generator=g)[:n].to(device)
    # Rows not written hold e4m3 1.0 codes and 2^-71 scales (a cache never holds a scale below 2^-22, so no
    # product is subnormal).
    got = torch.full((rows, c + c // 32), 0x38, dtype=torch.uint8, device=device)
    want = got.clone()
    tri_rows.store_packed(got, where, values, "fp8")
    ref_rows.store_packed(want, where, values, "fp8")
    if store:
        assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    read = torch.randint(0, rows, (2 * n,), generator=g).to(device)
    for out_dtype in (torch.float32, torch.bfloat16):
        a = tri_rows.load_packed(want, read, "fp8", c, out_dtype)
        b = ref_rows.load_packed(want, read, "fp8", c, out_dtype)
        assert a.dtype == out_dtype and torch.equal(a, b)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_small(dtype, device) -> None:
    # This Triton's interpreter converts fp32 -> e4m3 by truncation (as it does to bf16, ``rounding.py``): a
    # value just below a rounding boundary keeps the lower code, so the stored bytes are compared on CUDA only
    # (whose conversion rounds to nearest even); the read is exact everywhere.
    _check_fp8_rows(6, 96, dtype, device, seed=6, store=device != "cpu")


@pytest.mark.parametrize("n", [1, 128, 4096])
def test_fp8_rows_v41_flash(n, device) -> None:
    """V4.1-Flash's window rows: 512 channels (16 scale bytes), decode and prefill row counts."""
    _check_fp8_rows(max(n, 2), 512, torch.bfloat16, device, seed=n)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,inter", [(3, 40), (1, 2304), (64, 2304)])
def test_swiglu_v41(t, inter, dtype, device) -> None:
    """V4.1's expert activation: clamps at +-limit on both sides of the range, fp32 inside, one rounding."""
    from deepinfer.ops.ref.swiglu import swiglu_v41 as ref_swiglu
    from deepinfer.ops.triton.swiglu import swiglu_v41

    g = _gen(t + inter)
    gate = (torch.randn(t, inter, generator=g) * 6).to(dtype).to(device)
    up = (torch.randn(t, inter, generator=g) * 6).to(dtype).to(device)
    out, want = swiglu_v41(gate, up, 7.0), ref_swiglu(gate, up, 7.0)
    assert out.dtype == dtype and out.shape == want.shape
    if dtype == torch.float32:
        assert rel_err(out, want) <= 1e-6, rel_err(out, want)
    else:
        assert (out != want).float().mean().item() <= 1e-2 and rel_err(out, want) <= 4e-3
    assert rel_err(swiglu_v41(gate, up, 3.0), want) > 1e-2  # the clamp matters at these values


def _e2m1_values(n: int, c: int, dtype, device, seed: int) -> torch.Tensor:
    g = _gen(seed)
    values = torch.randn(n, c, generator=g) * torch.randn(n, 1, generator=g).mul(3).exp()
    # NVFP4's e4m3 scale holds amax / 6 up to 448: a larger group is outside the format (torch's conversion and
    # the kernel's saturating one disagree there); cache rows are normed activations, far inside it.
    values = values.clamp(-2000.0, 2000.0)
    values[0] = 0.0  # amax 0: the scale floor
    values[1, :16] = -0.0  # signed zeros keep their sign
    # Values on the e2m1 midpoints of a group whose scale is 1 (amax 6 -> MXFP4 scale 1, NVFP4 e4m3(1.0) = 1):
    # each must go to the even code.
    values[2, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5,
                                   -3.5, -5.0, 6.0])
    return values.to(dtype).to(device)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e2m1_qdq_and_rows_small(fmt, dtype, device) -> None:
    _check_e2m1(fmt, 6, 64, dtype, device, seed=7, store=fmt == "mxfp4" or device != "cpu")


@pytest.mark.parametrize("fmt,c", [("mxfp4", 128), ("nvfp4", 512)])
@pytest.mark.parametrize("n", [1, 64 * 32, 4096])
def test_e2m1_v41_flash(fmt, c, n, device) -> None:
    """V4.1-Flash's index keys / queries (MXFP4, 128 channels) and compressed entries (NVFP4, 512)."""
    _check_e2m1(fmt, max(n, 3), c, torch.bfloat16, device, seed=n + c)


def _check_e2m1(fmt: str, n: int, c: int, dtype, device, seed: int, store: bool = True) -> None:
    """qdq values and packed bytes bit-equal to the reference's; reads bit-equal. (On the interpreter the NVFP4
    scale's e4m3 conversion truncates, so its bytes are compared on CUDA only.)"""
    from deepinfer.ops.ref import cache_rows_v41 as ref_rows
    from deepinfer.ops.triton import cache_rows_v41 as tri_rows

    values = _e2m1_values(n, c, dtype, device, seed)
    if store:
        assert torch.equal(tri_rows.qdq(values, fmt), ref_rows.qdq(values, fmt))
    heads = values.view(n, -1, c // 2)  # [T, heads, d] as the index queries come (rows of c / 2 channels)
    if store and fmt == "mxfp4":
        assert torch.equal(tri_rows.qdq(heads, fmt), ref_rows.qdq(heads, fmt))
    group = 32 if fmt == "mxfp4" else 16
    rows = 2 * n + 3
    g = _gen(seed + 1)
    where = torch.randperm(rows, generator=g)[:n].to(device)
    width = c // 2 + c // group
    got = torch.zeros((rows, width), dtype=torch.uint8, device=device)
    want = got.clone()
    tri_rows.store_packed(got, where, values, fmt)
    ref_rows.store_packed(want, where, values, fmt)
    if store:
        assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    read = where[torch.randint(0, n, (2 * n,), generator=g).to(device)]
    for out_dtype in (torch.float32, torch.bfloat16):
        a = tri_rows.load_packed(want, read, fmt, c, out_dtype)
        b = ref_rows.load_packed(want, read, fmt, c, out_dtype)
        assert a.dtype == out_dtype and torch.equal(a, b)


@pytest.mark.interpret_ok
def test_rope_of_no_rows(device) -> None:
    """A step where no token closes an entry rotates zero rows (the engine's float32 test met it)."""
    from deepinfer.ops.triton.rope_v41 import apply_rope

    out = apply_rope(torch.empty(0, 96, device=device), torch.empty(0, 16, device=device))
    assert out.shape == (0, 96)


def _pool_inputs(e: int, r: int, d: int, device, seed: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A state pool [S, 2d] fp32 (a view of rows ``pad`` columns wider when pad) and rows [e, r] into it, S about
    e * r / 2 so that entries share rows (and an entry may pool one row twice). The scores come in channel bands:
    the same in every row (equal weights), -1e30 or -3e38 in about half of each channel's rows (weight 0 beside a
    finite score, equal weights where a group has only those), magnitudes in the thousands, and N(0, 16)."""
    g = _gen(seed)
    n = e * r // 2 + 2
    values = torch.randn(n, d, generator=g) * 3
    scores = torch.randn(n, d, generator=g) * 4
    a, b, c = d // 8, d // 4, d // 2
    scores[:, :a] = torch.randn(a, generator=g) * 4
    tiny = torch.where(torch.rand(n, b - a, generator=g) < 0.5, -1e30, -3e38)
    scores[:, a:b] = torch.where(torch.rand(n, b - a, generator=g) < 0.5, tiny, scores[:, a:b])
    scores[:, b:c] *= torch.empty(n, c - b).uniform_(1.0, 9.0, generator=g).exp2()
    state = torch.zeros(n, 2 * d + pad)
    state[:, :d], state[:, d:2 * d] = values, scores
    rows = torch.randint(0, n, (e, r), generator=g)
    return state.to(device)[:, :2 * d], rows.to(device)


def _check_pool(e: int, r: int, d: int, dtype, device, seed: int, pad: int = 0) -> None:
    from deepinfer.ops.ref.compress_pool_v41 import pool as ref_pool
    from deepinfer.ops.triton.compress_pool_v41 import pool

    state, rows = _pool_inputs(e, r, d, device, seed, pad)
    out, want = pool(state, rows, dtype), ref_pool(state, rows, dtype)
    assert out.shape == want.shape == (e, d) and out.dtype == want.dtype == dtype
    assert torch.isfinite(want).all() and torch.isfinite(out).all()
    if dtype == torch.float32:
        assert rel_err(out, want) <= 1e-6, rel_err(out, want)
    else:
        apart = (out.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert apart.max().item() <= 1, "a value more than one rounding off"
        assert (apart > 0).float().mean().item() <= 1e-2 and rel_err(out, want) <= 4e-3


def _flash_hash_inputs(q: int, device, seed: int):
    """V4.1-Flash's hash plan (its primes, offsets and multipliers; 99092 compressed ids), a random token map of the
    full vocabulary onto them (its largest id and the largest compressed id included) and lookbacks with every
    blocked prefix: -1 runs of each length, whole rows of -1, the map's last id."""
    from deepinfer.config.v41 import V41Config
    from deepinfer.model.v41.engram import hash_plan

    cfg = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": {}})
    plan = hash_plan(cfg)
    g = _gen(seed)
    n, vocab = cfg.engram_max_ngram_size, cfg.vocab_size
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (vocab,), generator=g)
    token_map[-1] = cfg.engram_compressed_vocab_size - 1
    lookback = torch.randint(0, vocab, (q, n), generator=g)
    blocked = torch.randint(0, n + 1, (q,), generator=g)  # shifts >= n - blocked are before position 0
    lookback[torch.arange(n) >= n - blocked.unsqueeze(-1)] = -1
    lookback[0] = vocab - 1
    if q > 1:
        lookback[1] = -1
    args = [t.to(device) for t in (token_map, torch.tensor(plan.multipliers), torch.tensor(plan.primes),
                                   torch.tensor(plan.offsets))]
    return lookback.to(device), args, int(token_map[cfg.engram_pad_token_id]), cfg.engram_n_heads


def _check_hash(q: int, device, seed: int) -> None:
    from deepinfer.ops.ref import engram_v41 as ref
    from deepinfer.ops.triton import engram_v41 as tri

    lookback, (token_map, mults, primes, offsets), pad, heads = _flash_hash_inputs(q, device, seed)
    got = tri.hash_rows(lookback, token_map, pad, mults, primes, offsets, heads)
    want = ref.hash_rows(lookback, token_map, pad, mults, primes, offsets, heads)
    assert got.dtype == torch.int64 and got.shape == (q, 2, 24) and torch.equal(got, want)
    assert bool((want >= offsets).all()) and bool((want < offsets + primes).all())  # each in its head's bucket


@pytest.mark.interpret_ok
def test_engram_hash_small(device) -> None:
    _check_hash(37, device, seed=8)


@pytest.mark.parametrize("q", [1, 128, 8192])
def test_engram_hash_v41_flash(q, device) -> None:
    _check_hash(q, device, seed=q)


def _check_gather(rows: int, q: int, k: int, c: int, dtype, device, seed: int, exponents: tuple[int, int]) -> None:
    """Bit-equal to the reference: codes of every finite e4m3 byte (signed zeros, the smallest subnormals, +-448),
    UE8M0 bytes over ``exponents``, rows repeated and out of order (the first and last row included)."""
    from deepinfer.ops.ref import engram_v41 as ref
    from deepinfer.ops.triton import engram_v41 as tri

    g = _gen(seed)
    codes = torch.randint(0, 256, (rows, c), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # e4m3fn's NaN codes (a loaded table has none) -> 448
    codes[0, :8] = torch.tensor([0x00, 0x80, 0x01, 0x81, 0x7E, 0xFE, 0x08, 0x88], dtype=torch.uint8)
    scales = torch.randint(exponents[0], exponents[1] + 1, (rows, c // 32), generator=g, dtype=torch.uint8)
    scales[0, 0], scales[-1, -1] = exponents
    index = torch.randint(0, rows, (q, k), generator=g)
    index[0, :3] = torch.tensor([rows - 1, 0, rows - 1])
    codes, scales, index = codes.view(torch.float8_e4m3fn).to(device), scales.to(device), index.to(device)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for e8m0 in (False, True):  # the scales as the build holds them (bytes) and as a checkpoint stores them
        s = scales.view(torch.float8_e8m0fnu) if e8m0 else scales
        got, want = tri.gather_rows(codes, s, index, dtype), ref.gather_rows(codes, s, index, dtype)
        assert got.dtype == dtype and got.shape == (q, k * c)
        assert torch.equal(got.view(bits), want.view(bits)), f"{int((got.view(bits) != want.view(bits)).sum())} differ"
    heads = index.view(q, 2, k // 2)  # leading dimensions are kept
    assert torch.equal(tri.gather_rows(codes, scales, heads, dtype).view(bits), want.view(q, 2, -1).view(bits))


# The interpreter's fp32 -> bf16 conversion truncates subnormals (``rounding.py``), so there the scales keep every
# product normal; on CUDA they span UE8M0's whole range (byte 0 = 2^-127 to 254 = 2^127, products up to +-inf).
_INTERPRETED_EXPONENTS = (127 - 100, 127 + 100)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,r,d", [(5, 2, 96), (3, 1, 40), (4, 3, 64), (6, 4, 96), (3, 2, 640)])
def test_compress_pool_small(e, r, d, dtype, device) -> None:
    """Ratios 1..4, channels not a power of two and over one program's block, a pool with padded rows."""
    _check_pool(e, r, d, dtype, device, seed=8 + e * r, pad=16 if r == 2 else 0)


@pytest.mark.interpret_ok
def test_compress_pool_of_no_entries(device) -> None:
    """A step where no token closes an entry pools nothing (and launches nothing)."""
    from deepinfer.ops.triton.compress_pool_v41 import pool

    out = pool(torch.zeros(4, 64, device=device), torch.zeros(0, 2, dtype=torch.int64, device=device), torch.bfloat16)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("e", [1, 7, 300, 2048])
def test_compress_pool_v41_flash(e, r, dtype, device) -> None:
    """V4.1-Flash's sources: 512 channels, ratio 2 (and 1), decode to prefill entry counts."""
    _check_pool(e, r, 512, dtype, device, seed=9 + e + r)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_gather_small(dtype, device) -> None:
    _check_gather(50, 5, 24, 64, dtype, device, seed=9, exponents=_INTERPRETED_EXPONENTS if device == "cpu" else
                  (0, 254))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [1, 128, 4096])
def test_engram_gather_v41_flash(q, dtype, device) -> None:
    """V4.1-Flash's lookup: 24 rows of 256 a token (8 scale bytes each), from a table of 100k rows."""
    _check_gather(100_000, q, 24, 256, dtype, device, seed=q, exponents=(0, 254))
