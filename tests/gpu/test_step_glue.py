"""The small kernels between a layer's GEMMs, each against its reference twin on fresh random inputs:
compressor state write, the shared expert's clamped SwiGLU, and indexer picks returned as row ids for
queries that share their sequence's entry list."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.ref.compress_state import compress_state as ref_state
from deepinfer.ops.ref.indexer_topk import indexer_topk as ref_topk
from deepinfer.ops.ref.swiglu import swiglu as ref_swiglu


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("t, s, m, extra", [(1, 64, 4, 0), (5, 96, 4, 16), (7, 40, 128, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compress_state_matches_reference_bitwise(t, s, m, extra, dtype, device) -> None:
    """Pure movement plus one fp32 add: the kernel's rows equal the reference's bit for bit, and no other
    state row changes (the column offset selects one compressor's range of a wider projection)."""
    from deepinfer.ops.triton.compress_state import compress_state

    g = _gen(t * s + m)
    col = extra
    proj = torch.randn(t, col + 2 * s + 3, generator=g).to(dtype)
    ape = torch.randn(m, s, generator=g)
    rows = torch.randperm(3 * t, generator=g)[:t]
    positions = torch.randint(0, 10 * m, (t,), generator=g)
    state = torch.randn(3 * t, 2 * s, generator=g)
    want = state.clone()
    ref_state(proj, col, want, rows, ape, positions)
    got = state.to(device)
    compress_state(*(x.to(device) for x in (proj,)), col, got, rows.to(device), ape.to(device), positions.to(device))
    assert torch.equal(got.cpu(), want)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("t, inter", [(1, 64), (3, 200), (9, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_matches_reference(t, inter, dtype, device) -> None:
    """Values span the clamp (limit 7): silu's exp may differ by an fp32 ulp, so a bf16 result may move by
    one ulp now and then; everything else is the reference's rounding step for step."""
    from deepinfer.ops.triton.swiglu import swiglu

    gu = (torch.randn(t, 2 * inter, generator=_gen(t + inter)) * 6).to(dtype)
    want = ref_swiglu(gu, 7.0)
    got = swiglu(gu.to(device), 7.0).cpu()
    assert got.dtype == dtype and got.shape == (t, inter) and not torch.isnan(got).any()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    diff = (got.float() - want.float()).abs()
    assert (diff <= ulp * want.float().abs().clamp(min=1e-3)).all()
    if dtype == torch.bfloat16:  # in fp32 every exp ulp shows; in bf16 only the rare rounding boundary
        assert (diff > 0).float().mean() <= 0.01


@pytest.mark.interpret_ok
def test_indexer_rows_with_shared_entry_lists(device) -> None:
    """Queries name their sequence's entry list (query_rows); as_rows maps each pick through that list."""
    from deepinfer.ops.triton.indexer_topk import indexer_topk

    g = _gen(5)
    b, per, hi, di, e, topk, r = 3, 2, 4, 32, 40, 8, 150
    seq_rows = torch.stack([torch.randperm(r, generator=g)[:e] for _ in range(b)]).to(torch.int32)
    ends = torch.tensor([40, 25, 3])
    seq_rows[torch.arange(e)[None, :] >= ends[:, None]] = -1
    qrows = torch.arange(b).repeat_interleave(per)
    limits = torch.minimum(ends[qrows], torch.randint(0, e + 1, (b * per,), generator=g))
    q = torch.randn(b * per, hi, di, generator=g).bfloat16()
    w = torch.randn(b * per, hi, generator=g)
    keys = torch.randn(r, di, generator=g).bfloat16()
    args = (q, w, keys, seq_rows, limits, topk, 0.25, qrows)
    want = ref_topk(*args, as_rows=True)
    got = indexer_topk(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), as_rows=True)
    assert torch.equal(got.cpu(), want)
    picks = ref_topk(*args)
    rows = seq_rows[qrows].long().gather(1, picks.clamp(min=0))
    assert torch.equal(want, torch.where(picks >= 0, rows, -1).to(torch.int32))


def _step_index_tensors(b: int, t: int, block_size: int, span: int, seed: int):
    """Random step index tensors: b sequences (the last one the padding sequence, empty tables), t tokens
    at positions inside their sequences, a few released (-1) leading blocks, tables wider than used."""
    g = _gen(seed)
    width = -(-span // block_size) + 2
    ids = torch.randperm(3 * b * width, generator=g).view(3, b, width)
    seq_end = torch.randint(1, span + 1, (b,), generator=g)
    seq_end[-1] = 0
    seq_end[0] = span
    for tab in ids:
        used = -(-seq_end // block_size)
        tab[torch.arange(width)[None, :] >= used[:, None]] = -1
        released = torch.randint(0, 3, (b,), generator=g)
        released[0] = 0  # sequence 0 keeps every block (its window-closing tokens below find their rows)
        tab[torch.arange(width)[None, :] < released[:, None] - 1] = -1
    seq = torch.randint(0, b - 1, (t,), generator=g)
    seq[-2:] = b - 1  # two padding tokens
    pos = (torch.rand(t, generator=g) * seq_end[seq]).long()
    pos[-2:] = 0
    seq[:2] = 0
    pos[:2] = torch.tensor([min(span, 256) - 1, 127])  # tokens that close CSA and HCA windows
    return seq, pos, ids[0].clone(), ids[1].clone(), ids[2].clone(), seq_end


@pytest.mark.interpret_ok
@pytest.mark.parametrize("b, t, block_size, span, window, kinds", [
    (2, 5, 128, 300, 16, ((4, True), (128, False))),
    (4, 9, 256, 700, 128, ((4, True), (128, False))),
    (3, 5, 128, 260, 8, ((128, False),)),
    (2, 4, 64, 100, 16, ()),
])
def test_step_rows_match_reference(b, t, block_size, span, window, kinds, device) -> None:
    """Every row list of the one-launch derivation equals the reference's, padding tokens included."""
    from deepinfer.ops.ref.step_rows import step_rows as ref_rows
    from deepinfer.ops.triton.step_rows import step_rows

    args = _step_index_tensors(b, t, block_size, span, seed=b * t + span)
    rest = (span, block_size, window, kinds, 9999, 8888)
    want = ref_rows(*args, *rest)
    got = step_rows(*(a.to(device) for a in args), *rest)
    assert (want[2] >= 0).any() and (want[2] < 0).any()  # the case has keys present and missing
    assert all((k.slot_rows >= 0).any() and (k.entry_rows >= 0).any() for k in want[3])
    for name, w, x in zip(("window_rows", "state_rows", "window_keys"), want[:3], got[:3]):
        assert x.dtype == w.dtype and torch.equal(x.cpu(), w), name
    assert len(got[3]) == len(kinds)
    for kind, wk, xk in zip(kinds, want[3], got[3]):
        for field in wk._fields:
            w, x = getattr(wk, field), getattr(xk, field)
            if w is None:
                assert x is None, (kind, field)
            else:
                assert x.dtype == w.dtype and torch.equal(x.cpu(), w), (kind, field)
