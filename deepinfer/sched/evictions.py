"""PlanEvictions: the cached blocks one plan's allocations evicted, on their way down to the cache tiers.

The scheduler hands a plan's evictions to the tiers with the plan (``Schedule.saves``; the engine saves them
before the step overwrites the blocks), so until the plan is made they are neither on the device nor in a
lower tier. Under a cyclic reuse pattern a lookup later in the same plan needs them as a rule, not by
accident: when conversations take turns in lockstep and outgrow the device pool, the least recently used
blocks are exactly those of the next conversations in line, so the allocations of the requests admitted (or
running) first evict the prefix of the next one. Its hit would stop at the first evicted block and recompute
everything behind it (on the V4-Flash shapes' multi-turn trace, 15% of the last turn's reusable tokens with a
host tier that held all the rest). Lookups count these blocks as held instead, and an admission whose hit
loads one waits for the next plan, by when the tiers hold it (``TierLink.fetch`` waits for a write-back still
in flight). That wait ends: each repeat needs a block of the request's chain evicted by the plan at hand.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.kv.manager import CacheManager, PrefixHit


class PlanEvictions:
    """One plan's evictions in the pools the tiers keep (``tiers``: a ``TierLink`` or its parallel stand-in;
    None: no tiers, nothing recorded)."""

    def __init__(self, cache: CacheManager, tiers) -> None:
        self.cache, self.tiers = cache, tiers
        self.saves: list[tuple[str, int, bytes]] = []
        self.keys: set[tuple[str, bytes]] = set()  # (pool, hash) of ``saves``
        self.late: set[tuple[str, bytes]] = set()  # of those, blocks a lookup found only here

    def _collect(self) -> None:
        if self.tiers is None:
            return
        for e in self.cache.drain_evictions():
            if e[0] in self.tiers.pools:  # only the pools the tiers keep (no state blocks where hits replay)
                self.saves.append(e)
                self.keys.add((e[0], e[2]))

    def probe(self, in_tier: Callable[[str, bytes], bool]) -> Callable[[str, bytes], bool]:
        """``in_tier`` of a lookup that also counts this plan's evictions as held."""
        self._collect()
        if not self.keys:
            return in_tier

        def held(pool: str, h: bytes) -> bool:
            if in_tier(pool, h):
                return True
            if (pool, h) in self.keys:
                self.late.add((pool, h))
                return True
            return False
        return held

    def needed_by(self, hit: PrefixHit) -> bool:
        """Whether the hit loads a block that reaches the tiers only with this plan's saves."""
        return bool(self.late) and any((p, h) in self.late for p, _, h in hit.loads)

    def drain(self) -> tuple[tuple[str, int, bytes], ...]:
        """Every eviction of the plan (pool, block, hash), for ``Schedule.saves``."""
        self._collect()
        return tuple(self.saves)
