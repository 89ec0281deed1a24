"""A rank's cache tiers: its own ``TierLink`` over its own storage, driven by the engine's tier orders.

Each rank's cache blocks live in its own process, so each rank saves and loads them itself: a DP group's
ranks own its cache, and with TP every rank of the group holds its shard of each block, which it stores
under the block's key in a store of its own. Rank r's disk tier is ``<kv_cache_dir>/rank<r>`` (a restart
with the same layout finds each rank's shards again; another layout's ranks read other directories or
objects whose identity, the shard's payload sizes included, does not match). The size limits are split:
``kv_host_cache_gb`` and ``kv_disk_cache_gb`` are what one node gives the tiers (its host memory and its
disk are shared by the ranks it runs), and each rank gets an equal share of them, so a flag means the same
machine budget whatever the parallel layout.

Protocol (the engine side is ``remote_tiers.py``): ``ProbeTiers`` answers which blocks this rank's store
holds (pending saves included), ``FetchTiers`` fetches and checks a hit's blocks and keeps their payloads
until the next step, whose ``TierWork`` saves the evicted blocks before the step's copies and fills the
fetched blocks after them, exactly where the single-process engine does. A fetched payload is held, so the
load of a hit the engine committed to cannot fail.
"""

from __future__ import annotations

import dataclasses
import os

from deepinfer.config.engine import EngineConfig, KVTierConfig
from deepinfer.distributed.world import WorldEnv
from deepinfer.engine.sizing import build_prefix_hasher
from deepinfer.executor.tier_messages import (CloseTiers, CollectTierStats, FetchTiers, ProbeTiers, TierReply,
                                              TierWork)
from deepinfer.kv.block_budget import cdiv
from deepinfer.kv.offload import TierLink
from deepinfer.kv.storage import KVStorage
from deepinfer.kv.tiers.stats import TierStats


def rank_tier_config(tiers: KVTierConfig, rank: int, ranks_on_node: int) -> KVTierConfig:
    """Rank ``rank``'s tiers: its share of the node's sizes and its own disk sub-directory."""
    disk_dir = None if tiers.disk_dir is None else os.path.join(tiers.disk_dir, f"rank{rank}")
    return dataclasses.replace(tiers, host_bytes=tiers.host_bytes // ranks_on_node, disk_dir=disk_dir,
                               disk_bytes=tiers.disk_bytes // ranks_on_node)


class RankTiers:
    def __init__(self, link: TierLink, rank: int, dp_rank: int) -> None:
        self.link = link
        self.rank, self.dp_rank = rank, dp_rank
        self._fetched: dict[tuple[str, bytes], memoryview] = {}  # payloads held for the next step's loads
        self._reported: TierStats | None = None  # the counters last sent with a step's results

    @classmethod
    def open(cls, config: EngineConfig, env: WorldEnv, dp_rank: int, storage: KVStorage,
             replay: bool) -> "RankTiers | None":
        """The rank's tiers (None when the engine has none)."""
        tiers = config.cache.tiers
        if not tiers.enabled:
            return None
        sc = config.scheduler
        link = TierLink.open(rank_tier_config(tiers, env.rank, env.ranks_on_node), build_prefix_hasher(config),
                             storage, replay=replay,
                             step_blocks=cdiv(sc.max_num_batched_tokens, config.cache.block_size) + sc.max_num_seqs)
        return None if link is None else cls(link, env.rank, dp_rank)

    def handle(self, order) -> TierReply:
        if isinstance(order, ProbeTiers):
            if order.dp != self.dp_rank:
                return TierReply(self.rank)
            pools = self.link.pools
            return TierReply(self.rank, pools, tuple(tuple(self.link.exists(p, h) for h in order.hashes)
                                                     for p in pools))
        if isinstance(order, FetchTiers):
            if order.dp != self.dp_rank:
                return TierReply(self.rank)
            ok = True
            for pool, h in order.blocks:  # every one, not up to the first miss: the others are held for a retry
                payload = self._fetched.get((pool, h))
                if payload is None:
                    payload = self.link.fetch(pool, h)
                if payload is None:
                    ok = False
                else:
                    self._fetched[(pool, h)] = payload
            return TierReply(self.rank, ok=ok)
        if isinstance(order, CloseTiers):
            self.link.close(list(order.cached[self.dp_rank]))
            return TierReply(self.rank)
        if isinstance(order, CollectTierStats):
            self.link.flush()
            return TierReply(self.rank, self.link.pools, saved=self.link.saved, loaded=self.link.loaded,
                             stats=self.link.store.stats())
        raise TypeError(f"rank {self.rank}: unexpected tier order {type(order).__name__}")

    def report(self) -> TierStats | None:
        """The store's counters now, when they changed since the last report (None: unchanged). Sent with every
        step's results (``StepDone.tiers``): reading them takes the store's lock for a few integers and does not
        wait for the write-back, so /metrics follows every rank at no cost to the step; what the background
        threads do while the engine is idle shows with the next step."""
        stats = self.link.store.stats()
        if stats == self._reported:
            return None
        self._reported = stats
        return stats

    def save(self, work: TierWork) -> None:
        """Before the step's copies (a block this plan evicts may be a copy's source)."""
        if work.prefetch:
            self.link.prefetch(work.prefetch)
        self.link.save(list(work.saves))

    def load(self, work: TierWork) -> None:
        """After the step's copies, before the step: fill the hit blocks fetched since the last step."""
        fetched, self._fetched = self._fetched, {}
        self.link.load([(p, b, fetched[(p, h)]) for p, b, h in work.loads])
