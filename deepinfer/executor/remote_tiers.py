"""The cache tiers of one DP group as its scheduler on the engine (rank 0) sees them: ``TierLink``'s lookup
side (``pools``, ``probe``, ``fetch_all``, ``prefetch``), answered by the group's ranks (``rank_tiers.py``).

The stores live in the ranks, so the scheduler asks them, synchronously and between steps: a lookup sends
the request's hash chain (``ProbeTiers``) and the group holds a block when every one of its TP ranks does
(each holds its own shard); an admission's hit blocks are fetched and checked by every rank of the group
(``FetchTiers``) before the scheduler commits to the hit, and when one rank misses one, the hit is refused and
looked up again (the rank's store dropped the object, so the next probe shrinks the hit), as in the
single-process path. Asking costs a round trip per lookup, but it is exact: no index on the engine that
could drift from a store whose background threads evict, spill and drop objects. A fetched payload stays in
its rank, held there until the step whose ``TierWork`` loads it; the scheduler only sees its key.
"""

from __future__ import annotations

from typing import Callable

from deepinfer.executor.tier_messages import FetchTiers, ProbeTiers, TierReply
from deepinfer.kv.spec import POOLS, STATE

Ask = Callable[[object], list]  # broadcast an order to every rank; every rank's reply, in rank order


class RemoteTiers:
    def __init__(self, dp: int, tp: int, replay: bool, ask: Ask, prefetches: bool = True) -> None:
        """``dp``: the DP group; ``tp``: its ranks are dp*tp .. dp*tp + tp - 1. ``replay``: as ``TierLink``'s
        (no state blocks in the tiers), which the ranks' links decide from the same layout. ``prefetches``:
        the tiers are host memory over a disk (otherwise there is nothing to warm and ``prefetch`` sends none)."""
        self.dp, self.tp = dp, tp
        self.pools = tuple(p for p in POOLS if not (replay and p == STATE))
        self._ask = ask
        self._prefetches = prefetches
        self._prefetch: list[bytes] = []
        self.probes = self.fetches = 0  # round trips (tests, metrics)

    def _group(self, replies: list) -> list[TierReply]:
        return replies[self.dp * self.tp:(self.dp + 1) * self.tp]

    def probe(self, hashes: tuple[bytes, ...]) -> Callable[[str, bytes], bool]:
        """The ``in_tier`` test of one lookup over ``hashes``: held by every rank of the group."""
        if not hashes:
            return lambda pool, h: False
        self.probes += 1
        held: set[tuple[str, bytes]] | None = None
        for reply in self._group(self._ask(ProbeTiers(self.dp, tuple(hashes)))):
            mine = {(p, h) for p, flags in zip(reply.pools, reply.found) for h, f in zip(hashes, flags) if f}
            held = mine if held is None else held & mine
        return lambda pool, h: (pool, h) in held

    def fetch_all(self, blocks: list[tuple[str, bytes]]) -> dict[tuple[str, bytes], bytes] | None:
        """Have the group fetch a hit's blocks; their keys (the payloads stay in the ranks, see the module
        docstring), or None when a rank misses one."""
        self.fetches += 1
        if not all(r.ok for r in self._group(self._ask(FetchTiers(self.dp, tuple(blocks))))):
            return None
        return {(p, h): h for p, h in blocks}

    def prefetch(self, hashes: tuple[bytes, ...]) -> int:
        """Queue a prompt's blocks to be warmed from the disk, sent with the next step (``take_prefetch``)."""
        if not self._prefetches:
            return 0
        self._prefetch += hashes
        return len(hashes)

    def take_prefetch(self) -> tuple[bytes, ...]:
        out, self._prefetch = tuple(self._prefetch), []
        return out
