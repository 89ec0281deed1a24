"""Counters of the tiered store as frozen snapshots, for tests, logs and the server's /metrics.

All counts are monotone since start except the sizes (``used_bytes``, ``num_objects``, ``pending_writes``),
which are gauges: an exporter maps the former to counters and the latter to gauges.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierCounters:
    tier: str  # "host" or "disk"
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    queried: int  # lookups that reached this tier (a host miss goes on to the disk)
    hits: int
    hit_tokens: int  # token positions covered by the hits
    stored: int  # objects written into this tier
    evictions: int  # objects pushed out by the size limit (a host eviction may spill to the disk)
    checksum_failures: int  # objects dropped because their bytes failed verification (header, length,
    # checksum, torn write): each one was a miss plus deletion


@dataclass(frozen=True, slots=True)
class TierStats:
    tiers: tuple[TierCounters, ...]
    spilled: int  # host evictions queued for the disk
    write_drops: int  # disk writes given up because the write-back queue was full
    pending_writes: int  # queued or in flight
    prefetched: int  # objects warmed from disk into host memory by prefetch()
    prefetch_drops: int  # prefetch requests given up because the prefetch queue was full

    def tier(self, name: str) -> TierCounters:
        for t in self.tiers:
            if t.tier == name:
                return t
        raise KeyError(f"no tier {name!r}; tiers: {', '.join(t.tier for t in self.tiers)}")
