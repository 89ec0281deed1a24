"""Triton compressor emit against its reference twin (and the reference against the per-sequence oracle's ``emit``).

Fresh fixed-seed random inputs per case, laid out like the model's: each position of a sequence owns a
scattered (paged) state row, and a token at the last position of a window emits that window's entry from
the window's own rows (and, for CSA, the previous window's, all -1 for window 0). Tokens that close no
window and a padded tail carry entry row -1 and garbage slot ids. State rows no position owns (row 0
included, which is where a careless -1 would land) hold NaN, and ``out`` starts as NaN: every written row
must be finite, every other row must still be NaN.

Tolerances: fp32 runs the same fp32 math in another order with hardware exp/rsqrt: measured 4e-8 to 3e-7
relative in the interpreter. 1e-5 leaves room for that and still catches a lost slot, a wrong column half
or an unrotated pair (errors of order 1e-1). bf16 follows the reference's rounding steps one for one (bit-
exact in the interpreter at these shapes); an fp32-ulp difference in exp can move a rounded weight by one
bf16 ulp now and then (measured 2e-5 at an HCA shape), far below the 1e-2 bound (a bf16 ulp is 2^-8 to
2^-7 relative). Against the fp32 math on the same inputs bf16 carries its own rounding (3e-3 to 4e-3
measured), bound 1e-2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.ops.ref.compress_emit import compress_emit as ref_emit
from deepinfer.ops.ref.rope import apply_rope, cos_sin
from tests.gpu.conftest import rel_err

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
ROPE_DIM = 64
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _freqs() -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM))


def _tri_emit(*args) -> None:
    from deepinfer.ops.triton.compress_emit import compress_emit

    compress_emit(*args)


def _slots_of(windows: torch.Tensor, pos_row: torch.Tensor, m: int, overlap: bool) -> torch.Tensor:
    """[n, NS] state rows of each window's slots (CSA: previous window's rows first, -1 for window 0)."""
    own = pos_row[windows[:, None] * m + torch.arange(m)]
    if not overlap:
        return own
    prev = pos_row[((windows - 1).clamp(min=0))[:, None] * m + torch.arange(m)]
    return torch.cat([torch.where(windows[:, None] > 0, prev, -1), own], dim=1)


def _case(T: int, m: int, W: int, overlap: bool, dtype: torch.dtype, seed: int, device: str):
    g = _gen(seed)
    S, NS = (2 * W, 2 * m) if overlap else (W, m)
    n_win = 6
    P, R = n_win * m, n_win * m + 8
    pos_row = torch.randperm(R - 1, generator=g)[:P] + 1  # paged; row 0 and 7 others owned by no position
    state = torch.full((R, 2 * S), float("nan"))
    state[pos_row] = torch.randn(P, 2 * S, generator=g)
    state[pos_row, S:] *= 2.0  # gates: a peaked but not one-hot softmax
    pos = torch.randint(0, P, (T,), generator=g)
    pos[0::2] = torch.randint(0, n_win, ((T + 1) // 2,), generator=g) * m + m - 1  # every other token closes
    pos[0] = m - 1  # window 0: for CSA its previous-window slots are all empty
    win = pos // m
    closes = (pos + 1) % m == 0
    slots = _slots_of(win, pos_row, m, overlap)
    slots[~closes] = torch.randint(-1, R, (int((~closes).sum()), NS), generator=g)  # never read
    entry = torch.randperm(T + 4, generator=g)[:T]
    entry[~closes] = -1
    if T >= 4:  # a padded tail, as in a captured batch
        entry[-2:], slots[-2:] = -1, -1
    cos, sin = cos_sin(win * m, _freqs(), 1.0, dtype)
    norm_weight = torch.rand(W, generator=g) + 0.5
    args = (state, slots.to(torch.int32), entry.to(torch.int32), norm_weight, EPS, cos, sin, overlap)
    return tuple(a.to(device) if torch.is_tensor(a) else a for a in args), T + 4


def _run(fn, args, rows: int, dtype: torch.dtype) -> torch.Tensor:
    state, slots, entry, norm_weight, eps, cos, sin, overlap = args
    W = norm_weight.shape[0]
    out = torch.full((rows, W), float("nan"), dtype=dtype, device=state.device)
    fn(state, slots, entry, out, norm_weight, eps, cos, sin, overlap)
    written = torch.zeros(rows, dtype=torch.bool, device=state.device)
    written[entry[entry >= 0].long()] = True
    assert torch.isfinite(out[written]).all(), "an emitted entry is unwritten or non-finite"
    assert torch.isnan(out[~written]).all(), "a row outside entry_rows was written"
    return out


def _check(T, m, W, overlap, dtype, device) -> None:
    args, rows = _case(T, m, W, overlap, dtype, seed=T * 1009 + m * 31 + W + overlap, device=device)
    out = _run(_tri_emit, args, rows, dtype)
    ref = _run(ref_emit, args, rows, dtype)
    written = ~torch.isnan(ref[:, 0])
    assert rel_err(out[written], ref[written]) <= TOL[dtype], rel_err(out[written], ref[written])
    # The fp32 math on the same inputs (cos/sin upcast exactly): bf16 is close to it, not just to itself.
    state, slots, entry, nw, eps, cos, sin, ov = args
    ref32 = _run(ref_emit, (state, slots, entry, nw, eps, cos.float(), sin.float(), ov), rows, torch.float32)
    assert rel_err(out[written], ref32[written]) <= TOL[dtype], rel_err(out[written], ref32[written])


SMALL = [  # (T, m, W, overlap)
    (9, 4, 64, True), (12, 4, 128, True), (9, 4, 64, False), (5, 128, 64, False),
    (7, 5, 96, True),  # odd m, W not a power of two: masked slot rows and channels
    (1, 4, 64, True),
]
V4_LAYERS = ((4, 512, True), (128, 512, False), (4, 128, True))  # CSA, HCA, CSA indexer: (m, W, overlap)
LARGE = [(T, m, W, ov) for T in (1, 7, 64, 300) for (m, W, ov) in V4_LAYERS]


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T, m, W, overlap", SMALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compress_emit_small(T, m, W, overlap, dtype, device) -> None:
    _check(T, m, W, overlap, dtype, device)


@pytest.mark.parametrize("T, m, W, overlap", LARGE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compress_emit_v4_shapes(T, m, W, overlap, dtype, device) -> None:
    _check(T, m, W, overlap, dtype, device)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant(dtype, device) -> None:
    """A token's entry does not depend on the rest of the batch, its padding or its place in it."""
    T, m, W = (9, 4, 64) if device == "cpu" else (64, 128, 512)
    args, rows = _case(T, m, W, m == 4, dtype, seed=3, device=device)
    state, slots, entry, nw, eps, cos, sin, ov = args
    batch = _run(_tri_emit, args, rows, dtype)
    emitters = (entry >= 0).nonzero().flatten().tolist()
    for t in emitters[:2] + emitters[-1:]:
        alone = _run(_tri_emit, (state, slots[t:t + 1], entry[t:t + 1], nw, eps, cos[t:t + 1], sin[t:t + 1], ov),
                     rows, dtype)
        assert torch.equal(alone[entry[t]], batch[entry[t]])
    perm = torch.randperm(T, generator=_gen(4)).to(device)
    shuffled = _run(_tri_emit, (state, slots[perm], entry[perm], nw, eps, cos[perm], sin[perm], ov), rows, dtype)
    assert torch.equal(shuffled.nan_to_num(), batch.nan_to_num())


@pytest.mark.interpret_ok
@pytest.mark.parametrize("overlap", [True, False])
def test_reference_is_compressor_emit(overlap, device, monkeypatch) -> None:
    """The batched op writes what the per-sequence oracle's ``emit`` writes, run by run, over a shared paged
    pool."""
    import deepinfer.model.compressor as mc
    from tests.oracle import per_sequence as ps
    from deepinfer.kv.spec import HISTORY, STATE

    m, W, dtype = 4, 64, torch.float32
    comp = mc.Compressor(8, W, m, overlap, EPS, dtype).to(device)
    comp.norm.weight.data = torch.rand(W, generator=_gen(1)).to(device) + 0.5
    g = _gen(2)
    S = 2 * W if overlap else W
    spans = [(0, 10), (5, 23)]  # (first_pos, end_pos) of two sequences' runs; only the first sees window 0
    R, R2 = 64, 16
    perm, eperm = torch.randperm(R, generator=g), torch.randperm(R2, generator=g)
    tables = [(perm[:24], eperm[:6]), (perm[24:48], eperm[6:12])]  # position -> state row, window -> entry row
    state = torch.randn(R, 2 * S, generator=g).to(device)
    monkeypatch.setattr(ps, "rows_for", lambda table, idx, layout, spec: table.to(idx.device)[idx])
    freqs = _freqs()

    def rope(x, positions):
        return apply_rope(x, *cos_sin(positions, freqs.to(positions.device), 1.0, x.dtype))

    store = torch.full((R2, W), float("nan"), dtype=dtype, device=device)
    # Just what emit touches: the device of positions, a spec (unused by the patched rows_for), two pools.
    layout = SimpleNamespace(layer=lambda key: SimpleNamespace(tensor=lambda name: None))
    storage = SimpleNamespace(get=lambda key, name: state if name == "state" else store)
    ctx = SimpleNamespace(positions=torch.zeros(1, device=device), layout=layout, storage=storage)
    slots, entry, wins = [], [], []
    for (lo, hi), (srow, erow) in zip(spans, tables):
        run = SimpleNamespace(first_pos=lo, end_pos=hi, block_tables={STATE: srow, HISTORY: erow})
        ps.emit(comp, run, ctx, "layer", "state", "entries", rope)
        pos = torch.arange(lo, hi)  # the batch: every token of the run, in order
        closes = (pos + 1) % m == 0
        slots.append(torch.where(closes[:, None], _slots_of(pos // m, srow, m, overlap), -1))
        entry.append(torch.where(closes, erow[pos // m], -1))
        wins.append(pos // m)
    cos, sin = cos_sin(torch.cat(wins) * m, freqs, 1.0, dtype)
    args = (state, torch.cat(slots).to(device), torch.cat(entry).to(device), comp.norm.weight.data, EPS,
            cos.to(device), sin.to(device), overlap)
    ref = _run(ref_emit, args, R2, dtype)
    assert torch.equal(ref.isnan(), store.isnan())
    if device == "cpu":  # same torch ops on the same device: the same bits
        assert torch.equal(ref.nan_to_num(), store.nan_to_num())
    else:  # CUDA reductions over differently laid-out (strided) views may sum in another order
        assert rel_err(ref.nan_to_num(), store.nan_to_num()) <= 1e-6
    out = _run(_tri_emit, args, R2, dtype)
    written = ~store[:, 0].isnan()
    assert written.sum() == 2 + 4 and rel_err(out[written], store[written]) <= TOL[dtype]


@pytest.mark.interpret_ok
def test_nan_never_passes(device) -> None:
    """A NaN in a column that is read reaches the entry (nothing masks it) and fails the comparison; the
    same NaN in a column the window does not read (the Ca half of its own rows) changes nothing."""
    assert rel_err(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])) == float("inf")
    W = 64
    args, rows = _case(9, 4, W, True, torch.float32, seed=5, device=device)
    state, slots, entry, *_ = args
    clean = _run(_tri_emit, args, rows, torch.float32)
    t = int((entry >= 0).nonzero()[1])
    e = int(entry[t])
    for col, read in ((0, False), (W, True)):  # kv channel 0 of the token's last own slot: Ca, then Cb
        poisoned = state.clone()
        poisoned[slots[t, -1].long(), col] = float("nan")
        out = torch.full((rows, W), float("nan"), device=device)
        _tri_emit(poisoned, *args[1:3], out, *args[3:])
        assert (rel_err(out[e], clean[e]) == float("inf")) == read
        if not read:
            assert torch.equal(out[e], clean[e])
