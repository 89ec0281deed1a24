"""Triton pair grouping (``ops/triton/moe_align.py``) vs its torch specification: bitwise equal outputs.

Routings: a router's (k distinct experts per row, uniform), skewed (one hot expert in almost every row),
identical rows (every column a single expert) and hash-like repeats inside a row. Outputs start poisoned,
so an element no kernel writes fails even where a reused allocation happened to hold the right value.
Both launch paths are covered: one program (P <= ONE_PROGRAM_PAIRS) and per-range programs, the latter
also at small P by shrinking the range size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.ops.ref.moe_align import align_pairs_torch  # noqa: E402
from deepinfer.ops.triton import moe_align as tri  # noqa: E402

ROUTINGS = ("router", "skewed", "same_rows")


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tri, "POISON_OUTPUTS", True)
    yield


def make_ids(n_tok: int, k: int, n_exp: int, routing: str, seed: int) -> torch.Tensor:
    """int64 [T, k] expert ids, built on the CPU (the same routing on every device)."""
    g = torch.Generator().manual_seed(seed)
    ranked = torch.rand(n_tok, n_exp, generator=g).argsort(dim=1)  # a random permutation per row
    if routing == "router":
        return ranked[:, :k].contiguous()
    if routing == "skewed":  # expert 3 (or the last) in ~90% of rows, at a random slot; rows stay distinct
        hot = min(3, n_exp - 1)
        ids = ranked[ranked != hot].view(n_tok, n_exp - 1)[:, :k].clone()
        slot = torch.randint(0, k, (n_tok,), generator=g)
        take = torch.rand(n_tok, generator=g) < 0.9
        ids[take, slot[take]] = hot
        return ids
    if routing == "same_rows":  # column j always expert perm[j]: k groups of T pairs each
        return ranked[:1, :k].expand(n_tok, k).contiguous()
    if routing == "repeats":  # hash routing may pick an expert twice in a row: two independent slots
        return torch.randint(0, n_exp, (n_tok, k), generator=g)
    raise ValueError(routing)


def check(ids: torch.Tensor, n_exp: int, block_m: int, device: str) -> None:
    want_rows, want_blocks = align_pairs_torch(ids, n_exp, block_m)
    got_rows, got_blocks = tri.align_pairs(ids.to(device), n_exp, block_m)
    assert got_rows.dtype == got_blocks.dtype == torch.int32
    assert torch.equal(got_blocks.cpu(), want_blocks), "expert_of_block differs"
    assert torch.equal(got_rows.cpu(), want_rows), "pair_of_row differs"


def _grid(tokens: tuple[int, ...], marks: tuple = ()) -> list:
    return [pytest.param(t, k, e, bm, r, marks=marks, id=f"T{t}-k{k}-E{e}-bm{bm}-{r}")
            for t in tokens for k in (2, 6) for e in (8, 256) for bm in (16, 64) for r in ROUTINGS]


@pytest.mark.parametrize("n_tok,k,n_exp,block_m,routing",
                         _grid((1, 2, 7, 32, 128), (pytest.mark.interpret_ok,)) + _grid((1000,)))
def test_matches_torch(device, n_tok, k, n_exp, block_m, routing) -> None:
    check(make_ids(n_tok, k, n_exp, routing, seed=n_tok * 7 + k), n_exp, block_m, device)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("n_exp", [8, 256])
@pytest.mark.parametrize("n_tok,k", [(5, 3), (64, 8), (100, 6)])
def test_repeats_inside_a_row(device, n_tok, k, n_exp) -> None:
    check(make_ids(n_tok, k, n_exp, "repeats", seed=11), n_exp, 16, device)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("per", [16, 48, 100])
@pytest.mark.parametrize("n_tok,k,n_exp", [(40, 6, 256), (45, 4, 8), (9, 2, 8)])
def test_per_range_path(device, monkeypatch, per, n_tok, k, n_exp, routing) -> None:
    """Range programs at small P: ranges ending mid-chunk, more ranges than blocks, a single range."""
    monkeypatch.setattr(tri, "ONE_PROGRAM_PAIRS", per)
    check(make_ids(n_tok, k, n_exp, routing, seed=per + n_tok), n_exp, 16, device)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("offset", [-1, 0, 1, "x2", "x2.5"])
def test_path_boundary(device, offset) -> None:
    """Around ONE_PROGRAM_PAIRS with the real range size (k = 1 gives any P)."""
    per = tri.ONE_PROGRAM_PAIRS
    n_pairs = per + offset if isinstance(offset, int) else int(per * float(offset[1:]))
    ids = make_ids(n_pairs, 1, 256, "router", seed=n_pairs)
    check(ids, 256, 16, device)
    check(make_ids(n_pairs, 1, 8, "skewed", seed=n_pairs), 8, 64, device)


@pytest.mark.parametrize("n_tok,k", [(16384, 6), (4096, 8)])
def test_prefill_sizes(device, n_tok, k) -> None:
    for routing in ROUTINGS:
        check(make_ids(n_tok, k, 256, routing, seed=n_tok), 256, 128, device)


@pytest.mark.interpret_ok
def test_sliced_and_int32_ids(device) -> None:
    """A column slice of a sort (non-contiguous) and int32 ids give the same grouping."""
    ids = make_ids(33, 8, 256, "router", seed=5)
    want = align_pairs_torch(ids[:, :6], 256, 16)
    for got in (tri.align_pairs(ids.to(device)[:, :6], 256, 16),
                tri.align_pairs(ids[:, :6].to(device, torch.int32), 256, 16)):
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.interpret_ok
def test_no_pairs(device) -> None:
    rows, blocks = tri.align_pairs(torch.empty((0, 6), dtype=torch.int64, device=device), 256, 16)
    assert rows.numel() == 0 and blocks.numel() == 0
