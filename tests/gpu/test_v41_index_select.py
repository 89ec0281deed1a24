"""DeepSeek-V4.1's indexer choice over key lists (``ops/triton/index_select_v41.py``) against its reference twin
(``ops/ref/index_select_v41.py``).

Fixed-seed random steps: sequences of different entry counts (one with none), each query seeing a prefix of its
sequence's entries (0 .. all), the keys of all sequences concatenated; V4.1-Flash's indexer (32 heads of 128,
top-512, candidate blocks of 8) and small shapes for the interpreter.

What is compared:
  * the scores (decoded from the sort keys) against the reference's formula: fp32 within 1e-5 of the size of
    their terms (the sum of |relu(q . k) * w| over heads: the dot products' K-order), bf16 at most 2% of scores
    apart and those by at most a rounding of their terms (the kernel's fp32 sums in another order before each of
    the reference's roundings; signed head weights cancel, so a term's last bit can be large next to the score),
    the masked slots -inf in both exactly;
  * the choice from those scores, exactly: the best min(topk, E) by (score, then lower slot), the finite ones'
    rows ascending, -1 after (an independent torch computation on the kernel's own scores);
  * the whole op against the reference in float32, exactly (chosen rows and the published candidate mask; a
    re-indexing layer restricted to candidates): continuous random scores leave no tie or last-bit near-tie at
    the cut at these sizes.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.ref import index_select_v41 as ref

V41 = dict(heads=32, dim=128, topk=512, block=8, topk_blocks=2048)


def _tri():
    from deepinfer.ops.triton import index_select_v41

    return index_select_v41


def _step(counts: list[int], queries: int, heads: int, dim: int, dtype, device, seed: int):
    """q [T, h, d], w [T, h], keys [sum counts, d], base [T], visible [T] (each query's sequence at random, a
    prefix of its entries: the whole list mostly, sometimes none)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + counts).cumsum(0)
    seq = torch.randint(0, len(counts), (queries,), generator=g)
    count = torch.tensor(counts)[seq]
    visible = torch.where(torch.rand(queries, generator=g) < 0.7, count,
                          (torch.rand(queries, generator=g) * (count + 1)).long())
    q = torch.randn(queries, heads, dim, generator=g).to(dtype)
    w = (torch.randn(queries, heads, generator=g) * 0.2).to(dtype)
    keys = torch.randn(int(offsets[-1]), dim, generator=g).to(dtype)
    put = dict(device=device)
    return q.to(**put), w.to(**put), keys.to(**put), offsets[seq].to(**put), visible.to(**put), max(counts)


def _ref_scores(q, w, keys, base, visible, width, candidates=None) -> torch.Tensor:
    slots = torch.arange(width, device=q.device)
    allowed = slots < visible.unsqueeze(-1)
    own = keys[torch.where(allowed, base.unsqueeze(-1) + slots, 0)]
    scores = ref.weigh(torch.einsum("shd,sed->she", q, own), w).masked_fill(~allowed, -torch.inf)
    return scores if candidates is None else scores.masked_fill(~candidates, -torch.inf)


def _candidates(t: int, width: int, block: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(t, -(-width // block), generator=g) < 0.5
    return blocks.repeat_interleave(block, dim=-1)[:, :width].to(device)


def _check_scores(counts, queries, heads, dim, dtype, device, seed, with_candidates=False) -> None:
    q, w, keys, base, visible, width = _step(counts, queries, heads, dim, dtype, device, seed)
    cand = _candidates(queries, width, 8, seed, device) if with_candidates else None
    tri = _tri()
    got = tri.scores_from_keys(tri.sort_keys(q, w, keys, base, visible, width, cand))
    want = _ref_scores(q, w, keys, base, visible, width, cand).float()
    masked = torch.isinf(want) & (want < 0)
    assert torch.equal(torch.isinf(got) & (got < 0), masked), "masked slots differ"
    g, r = got[~masked].double(), want[~masked].double()
    # The bound of a last-bit difference in each head's term and in the sum: the terms' magnitudes (signed head
    # weights cancel, so a term's rounding can be large next to the score itself).
    size = _ref_scores(q, w.abs(), keys, base, visible, width, cand).float()[~masked].double() + r.abs()
    if dtype == torch.float32:
        assert ((g - r).abs() <= size * 1e-5).all(), (g - r).abs().max()
    else:
        differ = g != r
        assert differ.float().mean().item() <= 0.02, differ.float().mean()
        assert ((g - r).abs() <= size * 2 ** -7)[differ].all(), "a score off by more than a rounding of its terms"


def _check_choice(counts, queries, heads, dim, topk, dtype, device, seed) -> None:
    q, w, keys, base, visible, width = _step(counts, queries, heads, dim, dtype, device, seed)
    tri = _tri()
    rows, _ = tri.select_entries(q, w, keys, base, visible, width, topk)
    scores = tri.scores_from_keys(tri.sort_keys(q, w, keys, base, visible, width)).cpu().double()
    k = min(topk, width)
    # (score desc, slot asc): a stable sort of the negated scores keeps the lower slot first among equals.
    order = torch.sort(-scores, dim=-1, stable=True).indices[:, :k]
    finite = torch.isfinite(scores.gather(-1, order))
    slots = torch.where(finite, order, width).sort(dim=-1).values
    want = torch.where(slots < width, slots + base.cpu().unsqueeze(-1), -1)
    assert rows.shape == (queries, k) and rows.dtype == torch.long
    assert torch.equal(rows.cpu(), want)


def _check_against_reference(counts, queries, heads, dim, topk, block, topk_blocks, device, seed) -> None:
    q, w, keys, base, visible, width = _step(counts, queries, heads, dim, torch.float32, device, seed)

    def parts():
        return [(slice(0, queries), None)]

    tri = _tri()
    got = tri.select_entries(q, w, keys, base, visible, width, topk, parts, None, (topk_blocks, block))
    want = ref.select_entries(q, w, keys, base, visible, width, topk, parts, None, (topk_blocks, block))
    assert torch.equal(got[0], want[0]), "chosen rows differ"
    assert torch.equal(got[1], want[1]), "published candidates differ"
    cand = want[1]
    got = tri.select_entries(q, w, keys, base, visible, width, topk, parts, cand)
    want = ref.select_entries(q, w, keys, base, visible, width, topk, parts, cand)
    assert torch.equal(got[0], want[0]), "chosen rows inside the candidates differ"
    assert got[1] is cand


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_small(dtype, device) -> None:
    _check_scores([5, 0, 19, 12], 9, 4, 16, dtype, device, seed=1)
    _check_scores([5, 0, 19, 12], 9, 4, 16, dtype, device, seed=2, with_candidates=True)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_choice_small(dtype, device) -> None:
    _check_choice([5, 0, 19, 12], 9, 4, 16, 6, dtype, device, seed=3)
    _check_choice([3, 2], 4, 4, 16, 8, dtype, device, seed=4)  # top-k wider than every list: -1 padding


@pytest.mark.interpret_ok
def test_against_reference_small(device) -> None:
    _check_against_reference([5, 0, 40, 23], 11, 4, 16, 7, 4, 3, device, seed=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,queries", [([1024], 1), ([4096, 100, 0, 2048], 64), ([513] * 8, 300)])
def test_scores_v41_shapes(counts, queries, dtype, device) -> None:
    _check_scores(counts, queries, V41["heads"], V41["dim"], dtype, device, seed=6)
    _check_scores(counts, queries, V41["heads"], V41["dim"], dtype, device, seed=7, with_candidates=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,queries", [([1024], 1), ([4096, 100, 0, 2048], 64), ([300, 513], 33)])
def test_choice_v41_shapes(counts, queries, dtype, device) -> None:
    _check_choice(counts, queries, V41["heads"], V41["dim"], V41["topk"], dtype, device, seed=8)


@pytest.mark.parametrize("counts,queries", [([1024], 2), ([20000, 700, 0], 16)])
def test_against_reference_v41_shapes(counts, queries, device) -> None:
    # 20000 entries: 2500 blocks of 8, more than the 2048 kept, so the candidate choice bites.
    _check_against_reference(counts, queries, V41["heads"], V41["dim"], V41["topk"], V41["block"],
                             V41["topk_blocks"], device, seed=9)
