"""The indexer's top-k for every sequence of a step at once (the device build's ``PagedV41.key_lists``).

``Indexer.select`` (``attention.py``) scores one sequence's queries against that sequence's index keys: the
plain model's path and the CPU engine's. ``select_lists`` does it for all the step's queries in a number of
ops that does not grow with the number of sequences: the index queries and head weights of all the step's
tokens in one go (``Indexer.queries``, row by row), then, a part of the rows at a time (``EntryLists.parts``),
each query's own sequence's index keys gathered as one list as wide as the step's widest sequence (slot j:
that sequence's entry j, the sequences' entries concatenated in run order), the same dot products, ReLU, head
weights and sum over heads in the activation dtype (``Indexer.weigh``), the slots past the query's visible
bound (t + 1) // r set to -inf (whatever row they gathered: never another sequence's score), the candidate
blocks (``candidate_blocks`` on the padded scores) or the restriction to them, and the top-k. A run of many
rows (a prefill chunk) is scored instead against its sequence's keys in one matmul, as ``Indexer.select``
does: its rows share those keys, and a gathered copy per query would multiply the bytes by its rows. So the
ops grow with the number of such runs, each a chunk's worth of work, not with the number of sequences.

What equals what, per query, against ``Indexer.select`` on its sequence alone:
  * the scores of its visible entries: the same operations on the same rows. Gathered, the dot products are
    one batched matmul instead of one matmul per sequence: the same terms, whose rounding may differ in the
    last bits (float32 on the CPU does). A run against its own keys: the per-sequence code's own matmul (in
    parts of rows when it is long);
  * the candidate mask over its sequence's entries: the slots past its sequence's width are -inf, so their
    blocks are never kept, and ``min(topk_blocks, blocks)`` of the widest sequence is at least its own, so the
    same finite blocks are kept;
  * the chosen entries: ``min(topk, E)`` of the widest sequence is at least its own ``min(topk, width)`` and
    every extra pick is a -inf score, so the same finite entries are chosen. They come as ascending entry ids
    with every -1 after them; the per-sequence code's -1s stand where its top-k picked non-finite entries (an
    order top-k leaves to the implementation). So the set of chosen entries is what is equal, and it is all
    the attention reads (``attend_lists``: key lists; ``add_entries``: a mask).
Both choices are the same unless two scores tie at the cut (the spec leaves ties to the implementation, and
top-k breaks them by its own order over rows of other widths) or straddle it within the last bits' rounding:
``tests/unit/test_v41_select_lists.py`` checks them equal on random float32 steps.
The result is given as what ``attend_lists`` reads: each query's chosen entries as rows of the concatenated
entries (-1 = none), ``min(topk, E)`` per query.

What runs is the indexer's op table's ``v41_index_select``: the reference above (``ops/ref/index_select_v41.py``,
the CPU engine's), or on CUDA one scoring kernel that reads every query's keys in place, in the same roundings,
and a top-k over sort keys (``ops/triton/index_select_v41.py``; ties go to the lower entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.model.v41.attention import Indexer
from deepinfer.runner.transfer import to_device


@dataclass(frozen=True)
class EntryLists:
    """Where each of a step's queries finds its sequence's entries of a ratio-r KV source among the step's
    sequences' entries concatenated in run order."""

    width: int  # E: the most entries one of the step's sequences holds
    queries: np.ndarray  # [runs] each run's query rows (host; the runs' rows are consecutive, in run order)
    counts: np.ndarray  # [runs] its sequence's entries (host)
    base: torch.Tensor  # [T] long: the row of the query's sequence's entry 0
    visible: torch.Tensor  # [T] long: how many of its sequence's entries the query sees, (t + 1) // r

    @classmethod
    def of(cls, firsts: list[int], ends: list[int], ratio: int, device: torch.device) -> "EntryLists":
        """From the runs' host positions: run i's queries are at positions ``firsts[i]`` .. ``ends[i] - 1``
        and its sequence holds ``ends[i] // ratio`` entries (laid out on the host, one copy)."""
        firsts, ends = np.asarray(firsts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        counts = ends // ratio
        t = np.concatenate([np.arange(a, b) for a, b in zip(firsts, ends)] + [np.zeros(0, dtype=np.int64)])
        base = np.repeat(np.cumsum(counts) - counts, ends - firsts)
        flat = to_device(np.concatenate((base, (t + 1) // ratio)), torch.int64, device)
        return cls(int(counts.max(initial=0)), ends - firsts, counts, flat[:t.size], flat[t.size:])

    def parts(self, budget: int, shared_from: int) -> list[tuple[slice, tuple[int, int] | None]]:
        """The query rows in the order ``select_lists`` scores them: (rows, None) for rows scored against
        their own keys gathered per query, (rows, (first, count)) for rows of one run scored against its
        sequence's entries ``first`` .. ``first + count - 1`` in one matmul (runs of at least ``shared_from``
        rows: a prefill chunk, whose rows share the keys). At most ``budget`` // per-query size rows a part."""
        out, lo, pending = [], 0, 0

        def flush(end: int) -> None:
            step = max(1, budget // self.width)
            out.extend((slice(a, min(a + step, end)), None) for a in range(end - pending, end, step))

        for n, count, first in zip(self.queries.tolist(), self.counts.tolist(),
                                   (np.cumsum(self.counts) - self.counts).tolist()):
            if n >= shared_from and count:
                flush(lo)
                pending, step = 0, max(1, budget // count)
                out.extend((slice(a, min(a + step, lo + n)), (first, count)) for a in range(lo, lo + n, step))
            else:
                pending += n
            lo += n
        flush(lo)
        return out


def select_lists(indexer: Indexer, x: torch.Tensor, qr: torch.Tensor, ang: torch.Tensor, cache_qdq: bool,
                 keys: torch.Tensor, lists: EntryLists, candidates: torch.Tensor | None = None,
                 budget: int = 1 << 26, shared_from: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Indexer.select`` for every query of a step at once: x [T, H], qr [T, q_lora], ang [T, rope / 2] of
    the step's queries, ``keys`` [Re, d] the sequences' index keys concatenated as ``lists`` says, the
    candidate mask [T, E] published by the candidate source (re-indexing layers after it). -> (each query's
    chosen entries as rows of ``keys`` [T, min(topk, E)], ascending, -1 after them; the candidate mask: the
    candidate source's own, else ``candidates`` as given). The scoring and choice are the indexer's op table's
    ``v41_index_select`` (``ops/ref/index_select_v41.py``): the reference walks the rows in parts
    (``EntryLists.parts``) that keep a part's keys and per-head scores under ``budget`` elements, a run of
    ``shared_from`` rows or more scored against its sequence's keys as the per-sequence code does (its rows
    share them: no gathered copy per query, and the same ops as ``Indexer.select``); the kernel reads every
    query's keys in place."""
    t, width = x.shape[0], lists.width
    if width == 0 or t == 0:
        none = torch.zeros(t, width, dtype=torch.bool, device=x.device)
        return torch.full((t, 0), -1, dtype=torch.long, device=x.device), \
            none if indexer.candidate_source else candidates
    if indexer.uses_candidates and (candidates is None or candidates.shape != (t, width)):
        raise ValueError("a re-indexing layer after the candidate source found no candidates")
    q, w = indexer.queries(x, qr, ang, cache_qdq)

    def parts() -> list:  # the reference's walk over the rows, laid out only if it is asked for
        return lists.parts(budget // max(indexer.dim, indexer.heads), shared_from)

    publish = (indexer.topk_blocks, indexer.block) if indexer.candidate_source else None
    rows, published = indexer.ops.v41_index_select(q, w, keys, lists.base, lists.visible, width, indexer.topk,
                                                   parts, candidates if indexer.uses_candidates else None, publish)
    return rows, published if indexer.candidate_source else candidates
