"""``collectives.all_reduce(ordered=True)`` (the batch-invariant mode's TP sum) in a real 3-rank gloo world: the
rank-order sum ((x_0 + x_1) + x_2) on every rank, for float32 and bfloat16 (summed in fp32, rounded once), and
a row's bits the same whatever other rows share the call (a library all-reduce chunks the tensor by its size)."""

from __future__ import annotations

import torch

from deepinfer.distributed.world import WorldEnv
from deepinfer.testing.world import run_world


def _inputs(rank: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + rows)
    x = torch.randn(rows, 33, generator=g) * 10.0 ** torch.randint(-3, 4, (rows, 1), generator=g)
    x[0] = torch.randn(33, generator=torch.Generator().manual_seed(rank)) * 1e3  # the same row 0 at every size
    return x.to(dtype)


def _rank(env: WorldEnv) -> list:
    import torch.distributed as dist

    from deepinfer.distributed.collectives import all_reduce

    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    try:
        return [(rows, dtype, all_reduce(_inputs(env.rank, rows, dtype), dist.group.WORLD,
                                         ordered=True))
                for dtype in (torch.float32, torch.bfloat16) for rows in (1, 5, 64, 257)]
    finally:
        dist.destroy_process_group()


def test_ordered_all_reduce_sums_in_rank_order_and_rows_are_invariant() -> None:
    results = run_world(_rank, world_size=3, timeout_s=120)
    for per_rank in zip(*results):
        (rows, dtype, first), *others = per_rank
        assert all(torch.equal(first, o[2]) for o in others), "every rank must hold the same bits"
        parts = [_inputs(r, rows, dtype).float() for r in range(3)]
        want = ((parts[0] + parts[1]) + parts[2]).to(dtype)
        assert torch.equal(first, want)
    for dtype in (torch.float32, torch.bfloat16):
        row0 = [out[0] for rows, d, out in results[0] if d == dtype]
        assert all(torch.equal(r, row0[0]) for r in row0), "row 0's sum must not depend on the call's size"
