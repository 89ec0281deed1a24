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

On a device the copies stay off the host's critical path. ``save`` queues a gather of the evicted blocks on
the compute stream (a temporary: the step may overwrite the blocks right after) and its copy into a region of
one pinned staging ring (``tiers/staging.py``) on a copy stream the compute stream never waits for; a
write-back thread (``tiers/writeback.py``) waits for the copy, copies each payload once into its stored
object and puts it into the store. Meanwhile the blocks are pending: ``exists`` counts them and ``fetch``
waits for their batch, so a lookup never reads bytes that are not there yet. ``load`` stages payloads in
the same ring and queues the host-to-device copy on the compute stream, before the step. On the CPU both
are synchronous: each payload is copied from the storage straight into its object, and back.

State blocks (compressor state, the largest blocks of a V4 layout) are written down only when prefix hits
cannot do without them. With bounded replay (``CacheManager.replay`` > 0, any V4 layout with CSA layers) a
hit rebuilds a boundary's state by recomputing its last few positions from the window blocks, which a tier
holds, so the link keeps history and window blocks only and a lookup never asks the store for a state block.
Without replay (``bounded_replay=False``, or a state pool without CSA layers) every pool goes down, as a hit
then needs the boundary's state block itself.

With several ranks each rank has a link of its own over its own storage (``executor/rank_tiers.py``), and the
engine's schedulers reach the ranks' stores through ``executor/remote_tiers.py``.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable

import torch

from deepinfer.kv.prefix_hash import BlockHasher
from deepinfer.kv.spec import POOLS, STATE
from deepinfer.kv.storage import KVStorage
from deepinfer.kv.tiers import StoreIdentity, TieredStore, open_store, payload_bytes, unpack_many
from deepinfer.kv.tiers.payload import block_major, gather, stage, upload
from deepinfer.kv.tiers.staging import Fence, Flag, StagingRing
from deepinfer.kv.tiers.writeback import SaveBatch, WriteBack

log = logging.getLogger("deepinfer")

MIN_STAGING_BYTES = 16 << 20


def store_identity(hasher: BlockHasher, storage: KVStorage) -> StoreIdentity:
    """The namespace digest bound to this engine's block geometry (the payload size of every pool)."""
    h = hashlib.sha256(hasher.namespace.digest())
    for p in POOLS:
        h.update(f"{p}:{payload_bytes(storage, p)};".encode())
    return StoreIdentity(h.digest(), hasher.block_size)


class CopyStream:
    """Device-to-host copies on a stream of their own, so the step's kernels never queue behind them."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def to_host(self, gathered: torch.Tensor, dst: torch.Tensor) -> tuple[Fence, tuple]:
        """Queue ``dst.copy_(gathered)`` after the work queued so far on the current (compute) stream, which
        does not wait for it; returns the copy's fence and its (start, end) timing events."""
        issued, start, end = torch.cuda.Event(), torch.cuda.Event(enable_timing=True), \
            torch.cuda.Event(enable_timing=True)
        issued.record()  # after the gather that made ``gathered``
        self.stream.wait_event(issued)
        with torch.cuda.stream(self.stream):
            start.record()
            dst.copy_(gathered, non_blocking=True)
            end.record()
        # ``gathered`` was allocated on the compute stream: without this, the allocator could hand its memory
        # to the step's kernels while the copy still reads it. With it, the step reuses the evicted blocks at
        # once and only that temporary waits for the copy.
        gathered.record_stream(self.stream)
        return end, (start, end)

    def mark(self) -> Fence:
        """An event recorded now on the current stream (the end of a host-to-device load)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed(start, end) -> float:
        return start.elapsed_time(end) / 1e3


def move_blocks(storage: KVStorage, tiers, saves, copies, loads) -> None:
    """A step's block moves, before the step overwrites evicted blocks and reads copied or loaded ones: the
    tier saves (``tiers``: a ``TierLink`` or a rank's tiers, None without tiers), the private copies, then the
    tier loads -- in this order, since a block evicted by the plan may be a copy's source or a load's
    destination. On a device each only queues work: saves gather the blocks on the compute stream and copy
    them to host memory on a stream of their own (the host never waits for them here), loads are queued
    before the step."""
    if tiers is not None:
        tiers.save(saves)
    for pool, src, dst in copies:
        storage.copy_block(pool, src, dst)
    if tiers is not None:
        tiers.load(loads)


class TierLink:
    def __init__(self, store: TieredStore, storage: KVStorage, replay: bool = False,
                 staging_bytes: int = MIN_STAGING_BYTES, copier: CopyStream | None = None) -> None:
        """``replay``: prefix hits can rebuild a boundary's state by a bounded replay; state blocks then stay
        out of the tiers (see the module docstring). ``staging_bytes``: the pinned staging ring of device
        copies. ``copier``: how device-to-host copies are issued (default: a ``CopyStream`` on CUDA, none on
        the CPU, where saves and loads copy synchronously; tests pass a stand-in to drive the asynchronous
        path on the CPU)."""
        self.store = store
        self.storage = storage
        self._size = {p: payload_bytes(storage, p) for p in POOLS}
        # Each pool's tensors as [blocks, payload slice] views, built once (the storage's tensors never move).
        self._parts = {p: block_major(storage, p) for p in POOLS}
        self.pools = tuple(p for p in POOLS if not (replay and p == STATE))  # the pools written down
        device = next(iter(storage.tensors.values())).device if storage.tensors else torch.device("cpu")
        if copier is None and device.type == "cuda":
            copier = CopyStream(device)
        self._copier = copier
        self._ring = None if copier is None else StagingRing(staging_bytes, pin=device.type == "cuda")
        # Loads stage through a ring of their own: in a shared one a load would wait behind saves whose
        # regions the write-back thread has not copied out yet, and a hit's TTFT with them.
        self._load_ring = None if copier is None else StagingRing(staging_bytes, pin=device.type == "cuda")
        self._writeback = WriteBack(store, threaded=copier is not None)
        self._load_timing: list[tuple] = []  # (start, end) events of loads not yet added to load_copy_seconds
        self.load_copy_seconds = 0.0
        self.saved = self.saved_bytes = 0  # blocks written down (lifetime), and their payload bytes
        self.loaded = self.loaded_bytes = 0  # blocks brought back up (lifetime), and their payload bytes

    @classmethod
    def open(cls, tiers, hasher: BlockHasher | None, storage: KVStorage, replay: bool = False,
             step_blocks: int = 1) -> "TierLink | None":
        """The link the engine arguments ask for (None without tiers or without prefix caching).
        ``step_blocks``: about how many blocks of a pool one step can allocate, hence evict; the staging ring
        holds two such batches of the largest pool written down, so a step's saves rarely wait for the last."""
        if hasher is None or not tiers.enabled:
            return None
        store = open_store(tiers, store_identity(hasher, storage))
        if store is None:
            return None
        largest = max(payload_bytes(storage, p) for p in POOLS if not (replay and p == STATE))
        return cls(store, storage, replay, max(MIN_STAGING_BYTES, 2 * step_blocks * largest))

    @staticmethod
    def key(pool: str, content_hash: bytes) -> bytes:
        return pool[0].encode() + content_hash

    def exists(self, pool: str, content_hash: bytes) -> bool:
        if pool not in self.pools:
            return False
        key = self.key(pool, content_hash)
        # Pending first: once a batch leaves the pending set its objects are in the store already.
        return self._writeback.pending(key) or self.store.exists(key)

    def probe(self, hashes: tuple[bytes, ...]) -> "Callable[[str, bytes], bool]":
        """The ``in_tier`` test of one prefix lookup over ``hashes`` (here: ``exists``; a parallel engine's
        ``executor/remote_tiers.py`` asks the ranks that hold the stores once per lookup)."""
        return self.exists

    def fetch_all(self, blocks: list[tuple[str, bytes]]) -> dict[tuple[str, bytes], memoryview] | None:
        """The payloads of a hit's blocks (pool, hash) by block, checked; None when one is gone or unusable."""
        out = {}
        for pool, h in blocks:
            payload = self.fetch(pool, h)
            if payload is None:
                return None
            out[(pool, h)] = payload
        return out

    def fetch(self, pool: str, content_hash: bytes) -> memoryview | None:
        """The block's payload, checked; None (and the object deleted when it is unusable) otherwise."""
        key = self.key(pool, content_hash)
        self._writeback.wait(key)  # a block still on its way down is read once it is in the store
        found = self.store.get(key)
        if found is None:
            return None
        if found.kind != pool or len(found.payload) != self._size[pool]:
            log.warning("kv tier: object %s holds %s/%d bytes, expected %s/%d; deleted", key.hex()[:16],
                        found.kind, len(found.payload), pool, self._size[pool])
            self.store.delete(key)
            return None
        return found.payload  # a read-only view of the stored blob's bytes: no copy

    def prefetch(self, hashes: tuple[bytes, ...]) -> int:
        """Queue the disk-resident history and window blocks of a prefix to be read into host memory in the
        background (a request's lookup at admission then finds them there); returns how many were queued."""
        return self.store.prefetch([self.key(p, h) for h in hashes for p in ("history", "window")])

    def save(self, blocks: list[tuple[str, int, bytes]]) -> None:
        """Write blocks (pool, block id, hash) down; their rows must still be intact (before the step).
        On a device this only queues work: a gather of each pool's blocks on the compute stream (after which
        the step may overwrite them) and its copy to host memory on the copy stream; the objects reach the
        store from the write-back thread. Blocks host memory holds already, or whose save is still pending,
        are not copied again (keys are content addresses), nor are blocks of a pool the link does not
        write down (state, with replay)."""
        for pool in self.pools:
            size = self._size[pool]
            if not size:
                continue
            todo: dict[bytes, int] = {}
            for p, b, h in blocks:
                key = self.key(pool, h)
                if p == pool and key not in todo and not self._writeback.pending(key) and not self.store.touch(key):
                    todo[key] = b
            # At most half the staging ring per batch: the next one need not wait for this one's copy.
            step = max(1, len(todo) if self._ring is None else self._ring.capacity // (2 * size))
            items = list(todo.items())
            for i in range(0, len(items), step):
                self._save_batch(pool, items[i:i + step])
            self.saved += len(items)
            self.saved_bytes += len(items) * size

    def _save_batch(self, pool: str, items: list[tuple[bytes, int]]) -> None:
        keys, ids = tuple(k for k, _ in items), [b for _, b in items]
        size, block_size = self._size[pool], self.storage.layout.block_size
        if self._copier is None:  # CPU: each payload goes from the storage's rows straight into its object
            parts = self._parts[pool]
            self._writeback.submit(SaveBatch(keys, pool, block_size, lambda i: [t[ids[i]].numpy() for t in parts]))
            return
        gathered = gather(self.storage, pool, ids)
        done = Flag()  # the region is free once the write-back thread has copied every payload out
        rows = self._ring.take(len(ids) * size, fence=done).view(len(ids), size)
        ready, timing = self._copier.to_host(gathered, rows)
        host = rows.numpy()
        self._writeback.submit(SaveBatch(keys, pool, block_size, lambda i: [host[i]], ready, done, timing))

    def load(self, fills: list[tuple[str, int, bytes]]) -> None:
        """Write fetched payloads (pool, block id, payload) into their new blocks, a batch per pool. On a
        device through the staging ring, queued on the compute stream: the step that reads them comes after."""
        self._fold_load_timing(wait=False)
        for pool in POOLS:
            mine = [(b, x) for p, b, x in fills if p == pool]
            if not mine:
                continue
            size = self._size[pool]
            step = len(mine) if self._load_ring is None else max(1, self._load_ring.capacity // (2 * max(size, 1)))
            for i in range(0, len(mine), step):
                part = mine[i:i + step]
                ids, payloads = [b for b, _ in part], [x for _, x in part]
                if self._load_ring is None or not size:  # CPU storage (or a pool without rows)
                    unpack_many(payloads, self.storage, pool, ids)
                    continue
                rows = stage(payloads, self._load_ring.take(len(part) * size), size)  # host copies
                # The timing marks bracket the device work only (the copy and the indexed writes), so the load
                # copy rate means what it says; the host's staging above is the caller's time.
                start = self._copier.mark()
                upload(rows, self._parts[pool], ids)
                end = self._copier.mark()
                self._load_ring.fence_last(end)  # the host-to-device copy has read the region once ``end`` is done
                self._load_timing.append((start, end))
            self.loaded += len(mine)
            self.loaded_bytes += len(mine) * size

    @property
    def staging_waits(self) -> dict[str, int]:
        """Times a save or a load waited for a staging region still in use (0 on the CPU: no rings)."""
        return {kind: ring.waits if ring is not None else 0
                for kind, ring in (("save", self._ring), ("load", self._load_ring))}

    @property
    def save_copy_seconds(self) -> float:
        """Device time of the completed device-to-host copies (0 on the CPU, where nothing is timed)."""
        return self._writeback.copy_seconds

    def flush(self) -> None:
        """Wait until every save so far is in the store (and every load's copy is done)."""
        self._writeback.flush()
        for ring in (self._ring, self._load_ring):
            if ring is not None:
                ring.drain()
        self._fold_load_timing(wait=True)

    def close(self, cached: list[tuple[str, int, bytes]]) -> None:
        """Write the device's cached blocks down too, then flush and close the store (a restart finds all)."""
        self.save(cached)
        self.flush()
        self._writeback.close()
        self.store.close()

    def _fold_load_timing(self, wait: bool) -> None:
        while self._load_timing and (wait or self._load_timing[0][1].query()):
            start, end = self._load_timing.pop(0)
            end.synchronize()
            self.load_copy_seconds += self._copier.elapsed(start, end) or 0.0
