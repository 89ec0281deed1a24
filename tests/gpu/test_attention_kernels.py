"""Triton sparse attention (index lists + sink) and indexer top-k against their reference twins.

Fresh fixed-seed random inputs per case; outputs poisoned with NaN before each kernel run.

Tolerances (attention): the kernel keeps fp32 logits and rounds the *unnormalised* probabilities to the
activation dtype for P·V, where the reference rounds q·k and the scaled logits to bf16 and the normalised
probabilities to bf16. For bf16 both sides carry errors of a few bf16 ulps (2^-9 relative) on every term
plus the bf16 output rounding: measured ~3e-3 to 6e-3, bound 1e-2. For fp32 both compute in fp32 (the
kernel's dots are IEEE fp32, not tf32), so only summation order differs (~1e-7); 1e-4 still catches a tf32
dot (~3e-4) or a lost key. Indexer: selections must match exactly, so inputs are built so that the
kernel's fp32 scores are either exact (small integers, power-of-two weights) or separated by gaps far
larger than rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.ops.ref.attention import sparse_attention
from deepinfer.ops.ref.indexer_topk import indexer_scores_indexed
from deepinfer.ops.ref.indexer_topk import indexer_topk as ref_indexer_topk
from deepinfer.ops.ref.sparse_attention import gather_keys
from deepinfer.ops.ref.sparse_attention import sparse_attention_indexed as ref_attention
from deepinfer.ops.tuning import H200
from tests.gpu.conftest import rel_err

NO_SMALL_SPLIT = dataclasses.replace(H200, attention_small_split=0)  # the batch-invariant split choice

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _index_lists(L: int, n: int, rows: int, g: torch.Generator, pad: float = 0.25) -> torch.Tensor:
    """[L, n] int32 distinct row ids per query, random -1 holes; query 0 keeps a single valid key and
    (for L >= 5) query 3 has none (sink only: output zero)."""
    idx = torch.stack([torch.randperm(rows, generator=g)[:n] for _ in range(L)]).to(torch.int32)
    idx[torch.rand(L, n, generator=g) < pad] = -1
    if n:
        keep = int(torch.randint(0, n, (1,), generator=g))
        idx[0] = -1
        idx[0, keep] = int(torch.randint(0, rows, (1,), generator=g))
    if L >= 5:
        idx[3] = -1
    return idx


def _attention_case(L: int, H: int, D: int, n: int, dtype: torch.dtype, seed: int, device: str):
    g = _gen(seed)
    rows = max(2 * n, 64)
    q = torch.randn(L, H, D, generator=g).to(dtype)  # unit-variance, like the rms-normed q and kv
    kv = torch.randn(rows, D, generator=g).to(dtype)
    idx = _index_lists(L, n, rows, g)
    sinks = torch.randn(H, generator=g)
    return q.to(device), kv.to(device), idx.to(device), sinks.to(device)


def _run(fn, *args, **kwargs) -> torch.Tensor:
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    res = fn(*args, out=out, **kwargs)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    return out


def _tri_attention(*args, **kwargs):
    from deepinfer.ops.triton.sparse_attention import sparse_attention_indexed

    return sparse_attention_indexed(*args, **kwargs)


SMALL_ATT = [(1, 4, 64, 1), (5, 4, 64, 7), (5, 4, 64, 128), (33, 4, 64, 7), (2, 4, 64, 200), (3, 5, 48, 40)]
LARGE_ATT = [(L, 64, 512, n) for L in (1, 5, 33) for n in (1, 7, 128, 640, 2176)]


def _check_attention(L, H, D, n, dtype, device) -> None:
    q, kv, idx, sinks = _attention_case(L, H, D, n, dtype, seed=L * 1000 + n * 7 + D, device=device)
    scale = D**-0.5
    out = _run(_tri_attention, q, kv, idx, sinks, scale)
    ref = ref_attention(q, kv, idx, sinks, scale)
    assert out.dtype == dtype and out.shape == (L, H, D)
    assert rel_err(out, ref) <= TOL[dtype], rel_err(out, ref)
    # Against the fp32 math on the same (upcast) inputs as well: the kernel is not just close to bf16 noise.
    ref32 = ref_attention(q.float(), kv.float(), idx, sinks, scale)
    assert rel_err(out, ref32) <= TOL[dtype]
    if L >= 5:
        assert torch.count_nonzero(out[3]) == 0  # no valid key: all mass on the sink


@pytest.mark.interpret_ok
@pytest.mark.parametrize("L, H, D, n", SMALL_ATT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_small(L, H, D, n, dtype, device) -> None:
    _check_attention(L, H, D, n, dtype, device)


@pytest.mark.parametrize("L, H, D, n", LARGE_ATT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_v4_shapes(L, H, D, n, dtype, device) -> None:
    _check_attention(L, H, D, n, dtype, device)


def _two_source_case(L, H, D, n_window, n_entries, dtype, seed, device):
    """Window rows in one tensor, entry j of each query in column j of indices_extra (HCA layout)."""
    g = _gen(seed)
    q = torch.randn(L, H, D, generator=g).to(dtype)
    win = torch.randn(max(2 * n_window, 16), D, generator=g).to(dtype)
    ent = torch.randn(max(2 * n_entries, 16), D, generator=g).to(dtype)
    widx = _index_lists(L, n_window, win.shape[0], g, pad=0.1)
    eidx = torch.stack([torch.randperm(ent.shape[0], generator=g)[:n_entries] for _ in range(L)]).to(torch.int32)
    # Causal-like ragged visibility: query l sees entries [0, count_l); later columns are -1.
    counts = torch.randint(0, n_entries + 1, (L,), generator=g)
    counts[-1] = n_entries
    eidx[torch.arange(n_entries)[None, :] >= counts[:, None]] = -1
    sinks = torch.randn(H, generator=g)
    return [t.to(device) for t in (q, win, widx, ent, eidx, sinks)]


TWO_SOURCE = [  # (L, H, D, window cols, entry cols, split)
    pytest.param(4, 4, 64, 16, 100, 32, marks=pytest.mark.interpret_ok),
    pytest.param(3, 4, 64, 9, 20, 1024, marks=pytest.mark.interpret_ok),
    (5, 64, 512, 128, 512, 1024),
    (8, 64, 512, 128, 8192, 1024),
    (3, 64, 512, 128, 3000, 1024),
]


@pytest.mark.parametrize("L, H, D, nw, ne, split", TWO_SOURCE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_sources_and_splits(L, H, D, nw, ne, split, dtype, device, monkeypatch) -> None:
    import deepinfer.ops.triton.sparse_attention as tri

    monkeypatch.setattr(tri, "SPLIT", split)
    fixed = NO_SMALL_SPLIT  # the batch-invariant splits only (the small-batch split: below)
    q, win, widx, ent, eidx, sinks = _two_source_case(L, H, D, nw, ne, dtype, seed=ne + nw + L, device=device)
    scale = D**-0.5
    out = _run(tri.sparse_attention_indexed, q, win, widx, sinks, scale, ent, eidx, tuning=fixed)
    ref = ref_attention(q, win, widx, sinks, scale, ent, eidx)
    assert rel_err(out, ref) <= TOL[dtype]
    # Split layout never changes bits: each query alone, with its padding trimmed (fewer splits, maybe the
    # fused single-split path), equals its row of the batch.
    for l in range(L):
        valid = (eidx[l] >= 0).nonzero()
        width = int(valid.max()) + 1 if len(valid) else 0
        alone = _run(tri.sparse_attention_indexed, q[l:l + 1], win, widx[l:l + 1], sinks, scale, ent,
                     eidx[l:l + 1, :width].contiguous(), tuning=fixed)
        assert torch.equal(alone[0], out[l]), f"query {l} differs alone vs in the batch"


SMALL_BATCH = [  # (L, H, D, window cols, entry cols, small split)
    pytest.param(3, 4, 64, 16, 100, 32, marks=pytest.mark.interpret_ok),
    pytest.param(2, 4, 64, 0, 40, 16, marks=pytest.mark.interpret_ok),
    (1, 64, 512, 128, 512, 128),
    (4, 64, 512, 128, 300, 128),
    (15, 64, 512, 128, 256, 128),
    (2, 64, 512, 128, 8, 128),
]


@pytest.mark.parametrize("L, H, D, nw, ne, small", SMALL_BATCH)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_batch_split(L, H, D, nw, ne, small, dtype, device) -> None:
    """Decode-sized calls split every ``attention_small_split`` entry columns with the window a split of its own: same
    result as the reference, and (both calls on this path, same index width) a query alone equals its row of
    the batch."""
    import deepinfer.ops.triton.sparse_attention as tri

    tuning = dataclasses.replace(H200, attention_small_split=small)
    q, win, widx, ent, eidx, sinks = _two_source_case(L, H, D, max(nw, 1), ne, dtype, seed=ne + L, device=device)
    if nw == 0:
        widx = widx[:, :0].contiguous()  # no window keys at all: split 0 holds nothing
    assert L * -(-H // tri.config(dtype, D)["BLOCK_H"]) < tuning.attention_fill_programs  # this path is taken
    scale = D**-0.5
    out = _run(tri.sparse_attention_indexed, q, win, widx, sinks, scale, ent, eidx, tuning=tuning)
    assert rel_err(out, ref_attention(q, win, widx, sinks, scale, ent, eidx)) <= TOL[dtype]
    for l in range(L):
        alone = _run(tri.sparse_attention_indexed, q[l:l + 1], win, widx[l:l + 1], sinks, scale, ent,
                     eidx[l:l + 1], tuning=tuning)
        assert torch.equal(alone[0], out[l]), f"query {l} differs alone vs in the batch"
    fixed = _run(tri.sparse_attention_indexed, q, win, widx, sinks, scale, ent, eidx, tuning=NO_SMALL_SPLIT)
    assert rel_err(out, fixed.float()) <= TOL[dtype]  # the batch-invariant path: the same values


@pytest.mark.interpret_ok
def test_indexed_reference_matches_mask_reference(device) -> None:
    """The index-list spec is the mask spec: per query, sparse_attention over its gathered keys."""
    q, kv, idx, sinks = _attention_case(6, 4, 64, 50, torch.bfloat16, seed=5, device="cpu")
    ent = torch.randn(30, 64, generator=_gen(6)).bfloat16()
    eidx = torch.randint(-1, 30, (6, 12), generator=_gen(7), dtype=torch.int32)
    out = ref_attention(q, kv, idx, sinks, 0.125, ent, eidx)
    keys, valid = gather_keys(kv, idx, ent, eidx)
    for l in range(6):
        one = sparse_attention(q[l:l + 1], keys[l], valid[l:l + 1], sinks, 0.125)
        assert torch.allclose(one[0].float(), out[l].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_batch_invariant(dtype, device) -> None:
    interp = device == "cpu"
    L, H, D, n = (7, 4, 64, 40) if interp else (33, 64, 512, 640)
    q, kv, idx, sinks = _attention_case(L, H, D, n, dtype, seed=11, device=device)
    batch = _run(_tri_attention, q, kv, idx, sinks, D**-0.5, tuning=NO_SMALL_SPLIT)  # the fixed splits only
    for l in (0, 2, L - 1):
        alone = _run(_tri_attention, q[l:l + 1], kv, idx[l:l + 1], sinks, D**-0.5, tuning=NO_SMALL_SPLIT)
        assert torch.equal(alone[0], batch[l])
    # Permuting the batch moves rows and nothing else.
    perm = torch.randperm(L, generator=_gen(12)).to(device)
    shuffled = _run(_tri_attention, q[perm], kv, idx[perm], sinks, D**-0.5)
    assert torch.equal(shuffled, batch[perm])


# ----------------------------------------------------------------------------------------------- indexer

def _tri_topk(*args, **kwargs):
    from deepinfer.ops.triton.indexer_topk import indexer_topk

    return indexer_topk(*args, **kwargs)


def _rows_and_limits(L: int, E: int, R: int, topk: int, g: torch.Generator):
    rows = torch.stack([torch.randperm(R, generator=g)[:E] for _ in range(L)]).to(torch.int32)
    limits = torch.randint(0, E + 1, (L,), generator=g)
    limits[0] = E  # full
    if L > 1:
        limits[1] = 0  # nothing visible yet: all -1
    if L > 2:
        limits[2] = min(E, max(1, topk // 2))  # short context: all visible selected, still best first
    rows[torch.arange(E)[None, :] >= limits[:, None]] = -1  # past the limit: not allocated yet
    return rows, limits


def _check_exact(q, w, keys, rows, limits, topk, scale) -> torch.Tensor:
    got = _tri_topk(q, w, keys, rows, limits, topk, scale)
    want = ref_indexer_topk(q, w, keys, rows, limits, topk, scale)  # stable sort: same on CPU and CUDA
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), "selection or order differs from the reference"
    # as_rows: each pick's row id (what the attention reads), -1 kept; twin-equal and equal to a gather.
    got_rows = _tri_topk(q, w, keys, rows, limits, topk, scale, as_rows=True)
    want_rows = torch.where(want >= 0, rows.long().gather(1, want.clamp(min=0)), -1).to(torch.int32)
    assert torch.equal(got_rows, want_rows)
    assert torch.equal(ref_indexer_topk(q, w, keys, rows, limits, topk, scale, as_rows=True), want_rows)
    return want.cpu()


SMALL_IDX = [(1, 4, 32, 1, 16), (5, 4, 32, 7, 16), (6, 4, 32, 100, 16), (3, 4, 32, 100, 512)]
LARGE_IDX = [(L, 64, 128, E, 512) for L in (1, 5, 33) for E in (7, 600, 2048, 16384)]


@pytest.mark.parametrize("L, hi, di, E, topk", [pytest.param(*c, marks=pytest.mark.interpret_ok) for c in SMALL_IDX]
                         + LARGE_IDX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_tie_free(L, hi, di, E, topk, dtype, device) -> None:
    """Distinct scores by construction: head 0 (weight 1) scores a distinct integer v_r = 256 a_r + b_r per
    row (exact in bf16 and fp32); the other heads are random floats weighted <= 2^-14, adding < 0.03 in all,
    far below the gap of 0.125 (= 1 * scale) between distinct v, and far above rounding."""
    g = _gen(E * 31 + L)
    R = 2 * E + 5
    v = torch.randperm(R, generator=g)  # distinct, < 2^16
    keys = torch.randn(R, di, generator=g)
    keys[:, 0], keys[:, 1] = (v // 256).float(), (v % 256).float()
    q = torch.randn(L, hi, di, generator=g)
    q[:, :, :2] = 0.0
    q[:, 0, :] = 0.0
    q[:, 0, 0], q[:, 0, 1] = 256.0, 1.0
    w = (torch.rand(L, hi, generator=g) - 0.5) * 2.0**-13
    w[:, 0] = 1.0
    rows, limits = _rows_and_limits(L, E, R, topk, g)
    q, keys, w, rows, limits = (t.to(device) for t in (q.to(dtype), keys.to(dtype), w, rows, limits))
    s = indexer_scores_indexed(q, w, keys, rows, 0.125)
    for row in s:  # tie-free within each query
        fin = row[torch.isfinite(row)]
        assert fin.unique().numel() == fin.numel()
    _check_exact(q, w, keys, rows, limits, topk, 0.125)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("L, hi, di, E, topk", SMALL_IDX[1:3])
def test_indexer_weight_scale_on_a_bf16_slice(L, hi, di, E, topk, device) -> None:
    """Head weights given as a bf16 column slice of a wider projection output, upcast and scaled in the op
    (``weight_scale``): the same picks and rows as the reference, and as passing weights.float() * scale."""
    g = _gen(E * 7 + L)
    R = E + 9
    q = torch.randint(-1, 2, (L, hi, di), generator=g).to(torch.bfloat16)
    keys = torch.randint(-1, 2, (R, di), generator=g).to(torch.bfloat16)
    # Power-of-two weights and small integer q, k: every score is exact whatever the summation order.
    sign = torch.randint(0, 2, (L, hi + 7), generator=g) * 2.0 - 1.0
    wide = (sign * 2.0 ** torch.randint(-4, 2, (L, hi + 7), generator=g).float()).to(torch.bfloat16)
    rows, limits = _rows_and_limits(L, E, R, topk, g)
    q, keys, wide, rows, limits = (t.to(device) for t in (q, keys, wide, rows, limits))
    w = wide[:, 3: 3 + hi]  # strided rows, unit column stride
    for as_rows in (False, True):
        got = _tri_topk(q, w, keys, rows, limits, topk, 0.125, as_rows=as_rows, weight_scale=0.25)
        want = ref_indexer_topk(q, w, keys, rows, limits, topk, 0.125, as_rows=as_rows, weight_scale=0.25)
        assert torch.equal(got, want)
        assert torch.equal(got, _tri_topk(q, w.float() * 0.25, keys, rows, limits, topk, 0.125, as_rows=as_rows))


@pytest.mark.parametrize("L, hi, di, E, topk", [pytest.param(*c, marks=pytest.mark.interpret_ok) for c in SMALL_IDX]
                         + LARGE_IDX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_exact_ties(L, hi, di, E, topk, dtype, device) -> None:
    """Small integers, power-of-two weights and scale: every score is exact in fp32 whatever the summation
    order, and there are many exact ties (most are 0: relu). The tie rule must hold to the bit."""
    g = _gen(E * 17 + L + 1)
    R = E + 9
    q = torch.randint(-1, 2, (L, hi, di), generator=g).float()
    keys = torch.randint(-1, 2, (R, di), generator=g).float()
    sign = torch.randint(0, 2, (L, hi), generator=g) * 2.0 - 1.0
    w = sign * 2.0 ** torch.randint(-4, 2, (L, hi), generator=g).float()
    q[0] = 0.0  # query 0: every score is exactly zero -> entries 0, 1, 2, ... in order
    rows, limits = _rows_and_limits(L, E, R, topk, g)
    want = _check_exact(*(t.to(device) for t in (q.to(dtype), w, keys.to(dtype), rows, limits)), topk, 0.125)
    k0 = min(topk, E)
    expect0 = torch.arange(k0)
    assert torch.equal(want[0], torch.where(expect0 < limits[0], expect0, -1))


@pytest.mark.interpret_ok
def test_indexer_batch_and_width_invariant(device) -> None:
    """A query's picks do not depend on its batch or on entries appended beyond its limit."""
    interp = device == "cpu"
    L, hi, di, E, topk = (6, 4, 32, 60, 16) if interp else (32, 64, 128, 4096, 512)
    g = _gen(99)
    q = torch.randn(L, hi, di, generator=g).bfloat16()
    keys = torch.randn(E + 40, di, generator=g).bfloat16()
    w = torch.randn(L, hi, generator=g) * hi**-0.5
    rows, limits = _rows_and_limits(L, E, E + 40, topk, g)
    args = [t.to(device) for t in (q, w, keys, rows, limits)]
    batch = _tri_topk(*args, topk, di**-0.5)
    for l in (0, 3, L - 1):
        one = _tri_topk(*(t[l:l + 1] for t in args[:2]), args[2], args[3][l:l + 1], args[4][l:l + 1], topk,
                        di**-0.5)
        assert torch.equal(one[0], batch[l])
        wider = torch.cat([args[3][l:l + 1], torch.arange(E, E + 40, dtype=torch.int32, device=device)[None]], 1)
        more = _tri_topk(*(t[l:l + 1] for t in args[:2]), args[2], wider, args[4][l:l + 1], topk, di**-0.5)
        assert torch.equal(more[0, : batch.shape[1]], batch[l])
