"""TieredStore: cache objects by key across host memory and a disk directory, least recently used first.

    put -> host (evicting its LRU objects, which spill to the disk in the background)
    get -> host, else the write-back queue, else disk (a disk hit is copied up into host memory)

Either tier may be absent: host only keeps the newest objects in memory; disk only writes every put in
the background. Disk writes never block the caller: puts and spills go to a bounded queue drained by
one writer thread (a full queue drops the write, which only costs a later miss), and objects stay
readable from the queue until their file is in place. ``prefetch(keys)`` warms host memory from the
disk on a second thread. ``flush()`` waits for both queues (tests); ``close()`` also writes what only
host memory holds down to the disk, so that a restarted server finds it.

Every read is checked (``blob.decode``): anything that fails is a miss, the object is deleted and the
tier's ``checksum_failures`` counter moves; no exception reaches the caller and no wrong bytes either.
One lock guards the recency lists, the queue map and the counters; file I/O and checksums run outside it.
Objects are written unsealed (no checksum) into host memory, which never verifies one, and sealed by the
writer thread on their way to the disk, so the engine's thread never hashes a payload.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, fields

from deepinfer.config.engine import KVTierConfig
from deepinfer.kv.tiers.base import Tier
from deepinfer.kv.tiers.blob import BlobError, StoredBlock, StoreIdentity, build, decode, seal
from deepinfer.kv.tiers.disk import DiskTier
from deepinfer.kv.tiers.host import HostTier
from deepinfer.kv.tiers.stats import TierCounters, TierStats

log = logging.getLogger("deepinfer")


class _Lru:
    """One tier's objects as the store sees them: recency order and total size."""

    def __init__(self, entries: Iterable[tuple[bytes, int]] = ()) -> None:
        self.sizes: OrderedDict[bytes, int] = OrderedDict()
        self.total = 0
        for key, size in entries:
            self.add(key, size)

    def __contains__(self, key: bytes) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def add(self, key: bytes, size: int) -> None:
        self.remove(key)
        self.sizes[key] = size
        self.total += size

    def touch(self, key: bytes) -> None:
        if key in self.sizes:
            self.sizes.move_to_end(key)

    def remove(self, key: bytes) -> bool:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.total -= size
        return size is not None

    def oldest(self) -> bytes:
        return next(iter(self.sizes))


@dataclass(slots=True)
class _Counts:
    queried: int = 0
    hits: int = 0
    hit_tokens: int = 0
    stored: int = 0
    evictions: int = 0
    checksum_failures: int = 0


class TieredStore:
    def __init__(self, identity: StoreIdentity, host: Tier | None = None, disk: Tier | None = None,
                 queue_depth: int = 64) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth: must be >= 1, got {queue_depth}")
        self.identity = identity
        self._host, self._disk = host, disk
        self._lock = threading.Lock()
        self._host_lru = _Lru(host.scan() if host else ())
        self._disk_lru = _Lru(disk.scan() if disk else ())
        self._counts = {t.name: _Counts() for t in (host, disk) if t is not None}
        self._pending: dict[bytes, bytes] = {}  # disk writes queued or in flight, readable meanwhile
        self._spilled = self._write_drops = self._prefetched = self._prefetch_drops = 0
        self._writes: queue.Queue[bytes | None] = queue.Queue(maxsize=queue_depth)
        self._prefetches: queue.Queue[bytes | None] = queue.Queue(maxsize=queue_depth)
        self._threads: list[threading.Thread] = []
        self._closed = False
        if disk is not None:
            self._counts[disk.name].checksum_failures += getattr(disk, "torn_files_removed", 0)
            victims = self._make_disk_room(0) or []  # the limit may have shrunk since the last run
            for v in victims:
                disk.delete(v)
            for name, loop in (("writer", self._write_loop), ("prefetch", self._prefetch_loop)):
                t = threading.Thread(target=loop, name=f"deepinfer-kv-{name}", daemon=True)
                t.start()
                self._threads.append(t)

    # ---- the four verbs ------------------------------------------------------------------------------
    def put(self, key: bytes, kind: str, num_tokens: int, payload) -> None:
        """Store an object (``payload``: bytes-like, or a list of parts, see ``blob.encode``). Keys are content
        addresses: an object already stored under ``key`` is kept."""
        if self.touch(key):
            return
        # Unsealed: host memory never verifies the checksum; the disk writer seals it in the background. Built
        # by numpy copies, which leave the GIL to the engine's thread (``blob.build``).
        blob = build(self.identity, key, kind, num_tokens, payload)
        with self._lock:
            if self._host is not None and len(blob) <= self._host.capacity_bytes:
                if key not in self._host_lru:
                    self._host_insert(key, blob)
            elif self._disk is not None:
                self._queue_write(key, blob)

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` recently used when host memory holds it (all a put of it would do); False when it
        does not, so that a caller's copy of the payload is worth making."""
        with self._lock:
            if key in self._host_lru:
                self._host_lru.touch(key)
                return True
            return False

    def get(self, key: bytes) -> StoredBlock | None:
        with self._lock:
            if self._host is not None:
                found = self._get_host(key)
                if found is not None:
                    return found
            if self._disk is None:
                return None
            counts = self._counts[self._disk.name]
            counts.queried += 1
            if key in self._pending:  # still in memory on its way to the disk (encoded here: trusted)
                found = self._decode(self._disk, key, self._pending[key], verify_payload=False)
                if found is not None:
                    self._hit(counts, found)
                return found
            if key not in self._disk_lru:
                return None
        return self._get_disk(key)

    def exists(self, key: bytes) -> bool:
        with self._lock:
            return key in self._host_lru or key in self._pending or key in self._disk_lru

    def delete(self, key: bytes) -> None:
        with self._lock:
            if self._host_lru.remove(key):
                self._host.delete(key)
            self._pending.pop(key, None)  # an in-flight write notices and removes its file
            on_disk = self._disk_lru.remove(key)
        if on_disk:
            self._disk.delete(key)

    def prefetch(self, keys: Iterable[bytes]) -> int:
        """Queue disk-resident keys to be copied into host memory in the background; returns how many."""
        if self._host is None or self._disk is None:
            return 0
        queued = 0
        with self._lock:
            for key in keys:
                if key in self._host_lru or key not in self._disk_lru:
                    continue
                try:
                    self._prefetches.put_nowait(key)
                    queued += 1
                except queue.Full:
                    self._prefetch_drops += 1
        return queued

    def flush(self) -> None:
        """Wait until every queued prefetch and disk write is done."""
        if self._threads:
            self._prefetches.join()  # first: a prefetch may spill host objects into the write queue
            self._writes.join()

    def close(self) -> None:
        """Write host-only objects down to the disk (a restarted server finds them), then stop the threads."""
        if self._closed:
            return
        self._persist_host()
        self.flush()
        self._closed = True
        for q in (self._writes, self._prefetches):
            if self._threads:
                q.put(None)
        for t in self._threads:
            t.join()
        for tier in (self._host, self._disk):
            if tier is not None:
                tier.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> TierStats:
        with self._lock:
            tiers = []
            for tier, lru in ((self._host, self._host_lru), (self._disk, self._disk_lru)):
                if tier is None:
                    continue
                c = self._counts[tier.name]
                tiers.append(TierCounters(tier.name, tier.capacity_bytes, lru.total, len(lru),
                                          **{f.name: getattr(c, f.name) for f in fields(c)}))
            return TierStats(tuple(tiers), self._spilled, self._write_drops, len(self._pending),
                             self._prefetched, self._prefetch_drops)

    def _persist_host(self) -> None:
        if self._host is None or self._disk is None:
            return
        with self._lock:
            keys = list(self._host_lru.sizes)  # oldest first, so the newest end up the most recent on disk
        for key in keys:
            with self._lock:
                if key not in self._host_lru or key in self._pending or key in self._disk_lru:
                    continue
                blob = self._host.get(key)
                if blob is None or len(blob) > self._disk.capacity_bytes:
                    continue
                self._pending[key] = blob
            self._writes.put(key)  # blocking: at most the queue's depth of copies at a time

    # ---- host (lock held) ----------------------------------------------------------------------------
    def _get_host(self, key: bytes) -> StoredBlock | None:
        counts = self._counts[self._host.name]
        counts.queried += 1
        if key not in self._host_lru:
            return None
        blob = self._host.get(key)
        found = self._decode(self._host, key, blob, verify_payload=False)
        if found is None:
            self._drop(self._host, self._host_lru, key, corrupt=blob is not None)
            return None
        self._host_lru.touch(key)
        self._hit(counts, found)
        return found

    def _host_insert(self, key: bytes, blob: bytes) -> None:
        while self._host_lru and self._host_lru.total + len(blob) > self._host.capacity_bytes:
            self._evict_host(self._host_lru.oldest())
        if self._host.put(key, blob):
            self._host_lru.add(key, len(blob))
            self._counts[self._host.name].stored += 1

    def _evict_host(self, victim: bytes) -> None:
        spill = (self._disk is not None and victim not in self._disk_lru and victim not in self._pending)
        blob = self._host.get(victim) if spill else None
        self._host.delete(victim)
        self._host_lru.remove(victim)
        self._counts[self._host.name].evictions += 1
        if blob is not None and self._queue_write(victim, blob):
            self._spilled += 1

    # ---- disk ----------------------------------------------------------------------------------------
    def _queue_write(self, key: bytes, blob: bytes) -> bool:  # lock held
        if key in self._pending or key in self._disk_lru or len(blob) > self._disk.capacity_bytes:
            return False
        self._pending[key] = blob
        try:
            self._writes.put_nowait(key)
        except queue.Full:
            del self._pending[key]
            self._write_drops += 1
            return False
        return True

    def _make_disk_room(self, size: int) -> list[bytes] | None:  # lock held (or not yet shared)
        if size > self._disk.capacity_bytes:
            return None
        victims = []
        while self._disk_lru and self._disk_lru.total + size > self._disk.capacity_bytes:
            victim = self._disk_lru.oldest()
            self._disk_lru.remove(victim)
            victims.append(victim)
            self._counts[self._disk.name].evictions += 1
        return victims

    def _get_disk(self, key: bytes) -> StoredBlock | None:
        blob = self._disk.get(key)
        found = self._decode(self._disk, key, blob, verify_payload=True)
        with self._lock:
            if found is None:
                self._drop(self._disk, self._disk_lru, key, corrupt=blob is not None)
            else:
                self._disk_lru.touch(key)
                self._hit(self._counts[self._disk.name], found)
                if self._host is not None and key not in self._host_lru \
                        and len(blob) <= self._host.capacity_bytes:
                    self._host_insert(key, blob)
        return found

    def _write_loop(self) -> None:
        while True:
            key = self._writes.get()
            try:
                if key is None:
                    return
                self._write_one(key)
            except Exception:  # one failed write must not stop the others
                log.exception("kv disk tier: write failed")
            finally:
                self._writes.task_done()

    def _write_one(self, key: bytes) -> None:
        with self._lock:
            blob = self._pending.get(key)
            if blob is None:
                return  # deleted while queued
            victims = self._make_disk_room(len(blob)) or []
        for victim in victims:
            self._disk.delete(victim)
        ok = self._disk.put(key, seal(blob))  # the checksum is computed here, off the engine's thread
        with self._lock:
            current = self._pending.get(key)
            if current is blob:
                del self._pending[key]
                if ok:
                    self._disk_lru.add(key, len(blob))
                    self._counts[self._disk.name].stored += 1
            elif ok:  # deleted while being written: the file must go too
                self._disk.delete(key)

    def _prefetch_loop(self) -> None:
        while True:
            key = self._prefetches.get()
            try:
                if key is None:
                    return
                self._prefetch_one(key)
            except Exception:
                log.exception("kv disk tier: prefetch failed")
            finally:
                self._prefetches.task_done()

    def _prefetch_one(self, key: bytes) -> None:
        with self._lock:
            if key in self._host_lru or key not in self._disk_lru:
                return
        blob = self._disk.get(key)
        found = self._decode(self._disk, key, blob, verify_payload=True)
        with self._lock:
            if found is None:
                self._drop(self._disk, self._disk_lru, key, corrupt=blob is not None)
            elif key not in self._host_lru and len(blob) <= self._host.capacity_bytes:
                self._host_insert(key, blob)
                self._prefetched += 1

    # ---- shared --------------------------------------------------------------------------------------
    def _decode(self, tier: Tier, key: bytes, blob: bytes | None, verify_payload: bool) -> StoredBlock | None:
        """The object in ``blob``, or None (missing, or failed its checks: logged, not raised)."""
        if blob is None:
            return None
        try:
            return decode(self.identity, key, blob, verify_payload)
        except BlobError as e:
            log.warning("kv %s tier: dropping object %s: %s", tier.name, key.hex()[:16], e)
            return None

    def _drop(self, tier: Tier, lru: _Lru, key: bytes, corrupt: bool) -> None:  # lock held
        """Forget ``key`` in ``tier``; a corrupt object is also deleted and counted."""
        lru.remove(key)
        if corrupt:
            self._counts[tier.name].checksum_failures += 1
            tier.delete(key)

    @staticmethod
    def _hit(counts: _Counts, found: StoredBlock) -> None:
        counts.hits += 1
        counts.hit_tokens += found.num_tokens


def open_store(tiers: KVTierConfig, identity: StoreIdentity) -> TieredStore | None:
    """The store that the engine arguments ask for (``--kv-host-cache-gb``, ``--kv-cache-dir``), or None."""
    if not tiers.enabled:
        return None
    host = HostTier(tiers.host_bytes) if tiers.host_bytes else None
    disk = DiskTier(tiers.disk_dir, tiers.disk_bytes) if tiers.disk_dir is not None else None
    return TieredStore(identity, host, disk)
