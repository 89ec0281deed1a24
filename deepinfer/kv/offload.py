"""TierLink: prefix-cache blocks between the device pools and the tiered store (host memory, then disk).

    device pool --evict--> save (pack the block's rows, store.put)        before the step overwrites them
    lower tier  --hit----> fetch (store.get, checked) ... load (unpack)   into a new block, before the step

A cached block is written down when the device pool evicts it (``CacheManager.record_evictions``), and on
``persist`` (engine shutdown) every block still cached on the device is written too, so a restarted engine
finds the whole prefix cache in its disk tier. Keys are the pool's initial plus the block's chain hash; every
object carries the store identity (config digest, block size) and a payload checksum (``tiers/blob.py``), and
a payload whose size does not match this engine's block is deleted and treated as a miss. Fetching happens
during admission, before a hit is committed to: an object that is gone or fails its check shrinks the hit
instead of ever reaching the model.

State blocks (compressor state, the largest blocks of a V4 layout) are written down only when prefix hits
cannot do without them. With bounded replay (``CacheManager.replay`` > 0, any V4 layout with CSA layers) a
hit rebuilds a boundary's state by recomputing its last few positions from the window blocks, which a tier
holds, so the link keeps history and window blocks only and a lookup never asks the store for a state block.
Without replay (``bounded_replay=False``, or a state pool without CSA layers) every pool goes down, as a hit
then needs the boundary's state block itself.
"""

from __future__ import annotations

import hashlib
import logging

from deepinfer.kv.prefix_hash import BlockHasher
from deepinfer.kv.spec import POOLS, STATE
from deepinfer.kv.storage import KVStorage
from deepinfer.kv.tiers import StoreIdentity, TieredStore, open_store, pack_many, payload_bytes, unpack_many

log = logging.getLogger("deepinfer")


def store_identity(hasher: BlockHasher, storage: KVStorage) -> StoreIdentity:
    """The namespace digest bound to this engine's block geometry (the payload size of every pool)."""
    h = hashlib.sha256(hasher.namespace.digest())
    for p in POOLS:
        h.update(f"{p}:{payload_bytes(storage, p)};".encode())
    return StoreIdentity(h.digest(), hasher.block_size)


class TierLink:
    def __init__(self, store: TieredStore, storage: KVStorage, replay: bool = False) -> None:
        """``replay``: prefix hits can rebuild a boundary's state by a bounded replay; state blocks then stay
        out of the tiers (see the module docstring)."""
        self.store = store
        self.storage = storage
        self._size = {p: payload_bytes(storage, p) for p in POOLS}
        self.pools = tuple(p for p in POOLS if not (replay and p == STATE))  # the pools written down
        self.saved = 0  # blocks written down (lifetime)
        self.loaded = 0  # blocks brought back up (lifetime)

    @classmethod
    def open(cls, tiers, hasher: BlockHasher | None, storage: KVStorage, replay: bool = False) -> "TierLink | None":
        """The link the engine arguments ask for (None without tiers or without prefix caching)."""
        if hasher is None or not tiers.enabled:
            return None
        store = open_store(tiers, store_identity(hasher, storage))
        return None if store is None else cls(store, storage, replay)

    @staticmethod
    def key(pool: str, content_hash: bytes) -> bytes:
        return pool[0].encode() + content_hash

    def exists(self, pool: str, content_hash: bytes) -> bool:
        return pool in self.pools and self.store.exists(self.key(pool, content_hash))

    def fetch(self, pool: str, content_hash: bytes) -> memoryview | None:
        """The block's payload, checked; None (and the object deleted when it is unusable) otherwise."""
        key = self.key(pool, content_hash)
        found = self.store.get(key)
        if found is None:
            return None
        if found.kind != pool or len(found.payload) != self._size[pool]:
            log.warning("kv tier: object %s holds %s/%d bytes, expected %s/%d; deleted", key.hex()[:16],
                        found.kind, len(found.payload), pool, self._size[pool])
            self.store.delete(key)
            return None
        return found.payload  # a view of the stored blob's bytes (immutable): no copy

    def prefetch(self, hashes: tuple[bytes, ...]) -> int:
        """Queue the disk-resident history and window blocks of a prefix to be read into host memory in the
        background (a request's lookup at admission then finds them there); returns how many were queued."""
        return self.store.prefetch([self.key(p, h) for h in hashes for p in ("history", "window")])

    def save(self, blocks: list[tuple[str, int, bytes]]) -> None:
        """Write blocks (pool, block id, hash) down; their rows must still be intact (before the step).
        Each pool's blocks leave the device in one batch (``pack_many``); blocks of a pool the link does not
        write down (state, with replay) are dropped."""
        for pool in self.pools:
            mine = [(b, h) for p, b, h in blocks if p == pool]
            if not mine or not self._size[pool]:
                continue
            rows = pack_many(self.storage, pool, [b for b, _ in mine]).numpy()
            for (_, h), payload in zip(mine, rows):
                self.store.put(self.key(pool, h), pool, self.storage.layout.block_size, payload)
            self.saved += len(mine)

    def load(self, fills: list[tuple[str, int, bytes]]) -> None:
        """Write fetched payloads (pool, block id, payload) into their new blocks, a batch per pool."""
        for pool in POOLS:
            mine = [(b, x) for p, b, x in fills if p == pool]
            if mine:
                unpack_many([x for _, x in mine], self.storage, pool, [b for b, _ in mine])
                self.loaded += len(mine)

    def close(self, cached: list[tuple[str, int, bytes]]) -> None:
        """Write the device's cached blocks down too, then flush and close the store (a restart finds all)."""
        self.save(cached)
        self.store.close()
