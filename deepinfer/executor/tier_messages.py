"""The messages of the cache tiers over a world of ranks (``remote_tiers.py`` on the engine, ``rank_tiers.py``
on each rank): frozen, plain data, part of ``messages.MESSAGES``.

Between steps the engine asks a DP group which blocks its tiers hold (``ProbeTiers``, a prefix lookup) and has
it fetch a hit's blocks (``FetchTiers``, admission); each step's ``RunStep.tiers`` then tells every DP group
which evicted blocks to save and which fetched blocks to load, before the step. Blocks are named by their
pool and chain hash only: every rank stores and loads its own copy (with TP, its own shard) under that key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierWork:
    """One DP group's tier work of a step, carried out before it (saves, then the plan's copies, then loads)."""

    saves: tuple[tuple[str, int, bytes], ...] = ()  # (pool, block, hash): cached blocks the plan evicts
    loads: tuple[tuple[str, int, bytes], ...] = ()  # (pool, block, hash): fetched blocks to fill
    prefetch: tuple[bytes, ...] = ()  # chain hashes of newly queued prompts: warm host memory from the disk


@dataclass(frozen=True, slots=True)
class ProbeTiers:
    """Which of ``hashes`` do DP group ``dp``'s tiers hold, per written-down pool (a prefix lookup)."""

    dp: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class FetchTiers:
    """DP group ``dp``: fetch (and check) these blocks (pool, hash) and keep them for the next step's loads."""

    dp: int
    blocks: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class CloseTiers:
    """Before shutdown: per DP group, the blocks still cached on the device (pool, block, hash), written down
    so that a restarted engine finds them; then every rank flushes and closes its store."""

    cached: tuple[tuple[tuple[str, int, bytes], ...], ...]


@dataclass(frozen=True, slots=True)
class CollectTierStats:
    """Every rank reports its tier counters (metrics, tests)."""


@dataclass(frozen=True, slots=True)
class TierReply:
    """A rank's answer to a tier order. ``found``: per pool of ``pools``, a flag per probed hash (ProbeTiers);
    ``ok``: every block fetched and checked (FetchTiers); ``saved``/``loaded``: lifetime block counts and
    ``stats`` the store's counters (CollectTierStats). Ranks outside the asked DP group leave them empty."""

    rank: int
    pools: tuple[str, ...] = ()
    found: tuple[tuple[bool, ...], ...] = ()
    ok: bool = True
    saved: int = 0
    loaded: int = 0
    stats: object = None  # kv.tiers.TierStats


TIER_ORDERS = (ProbeTiers, FetchTiers, CloseTiers, CollectTierStats)
TIER_MESSAGES = TIER_ORDERS + (TierReply,)
