"""WriteBack: blocks on their way from the device into the tiered store, and the thread that puts them there.

The tier link queues a batch once its device-to-host copy is issued (``SaveBatch``: the keys, how to read
each payload from the staging rows the copy lands in, and the copy's ``ready`` fence); the engine's thread
goes on at once. A small thread waits for each batch's copy, builds one stored object per block
(``store.put``: the header, then the payload copied once from the staging rows behind it, by numpy with
the GIL released, so the engine's thread never waits for a copy to launch its kernels), hands
them to the store and marks the batch ``done``, which frees its staging region. Until then the batch's keys
are *pending*: ``pending`` says so (a lookup counts them as stored), and ``wait`` blocks until the batch is
in the store, so a fetch of a pending block reads its bytes only once they are there.

Synchronous mode (``threaded=False``) completes each batch inside ``submit``, on the caller's thread: the
same bookkeeping, no thread (CPU storage, where nothing is asynchronous anyway).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.kv.tiers.staging import Fence, Flag
from deepinfer.kv.tiers.store import TieredStore

log = logging.getLogger("deepinfer")


@dataclass(frozen=True, eq=False)
class SaveBatch:
    keys: tuple[bytes, ...]
    kind: str  # the pool, written into each object's header
    num_tokens: int  # positions one block covers
    # payload(i): key i's payload as buffers (valid once ``ready`` completes) that the store joins into the
    # object, each byte copied once: a staging row on a device, the storage's rows themselves on the CPU.
    payload: Callable[[int], list]
    ready: Fence | None = None  # the copy the payloads come from; None: already there
    done: Flag = field(default_factory=Flag)  # set once the objects are in the store (the staging rows are free)
    copy_timing: tuple | None = None  # (start, end) timing events of the copy, read once it is done


class WriteBack:
    def __init__(self, store: TieredStore, threaded: bool) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._pending: dict[bytes, SaveBatch] = {}
        self._batches: list[SaveBatch] = []  # queued or in progress, oldest first
        self.copy_seconds = 0.0  # device time of the completed batches' copies (where they were timed)
        self._queue: queue.SimpleQueue[SaveBatch | None] | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, name="deepinfer-kv-writeback", daemon=True)
            self._thread.start()

    def pending(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending

    def wait(self, key: bytes) -> None:
        """Return once ``key``'s batch (if any) is in the store."""
        with self._lock:
            batch = self._pending.get(key)
        if batch is not None:
            batch.done.wait()

    def submit(self, batch: SaveBatch) -> None:
        """Queue a batch whose copy is issued. A key that is pending already is the caller's to leave out
        (keys are content addresses: the batch in flight carries the same bytes)."""
        with self._lock:
            for key in batch.keys:
                self._pending[key] = batch
            self._batches.append(batch)
        if self._queue is None:
            self._complete(batch)
        else:
            self._queue.put(batch)

    def flush(self) -> None:
        """Wait until every batch submitted so far is in the store."""
        with self._lock:
            batches = list(self._batches)
        for batch in batches:
            batch.done.wait()

    def close(self) -> None:
        self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            self._complete(batch)

    def _complete(self, batch: SaveBatch) -> None:
        try:
            if batch.ready is not None:
                batch.ready.synchronize()  # the device-to-host copy (releases the GIL while it waits)
            if batch.copy_timing is not None:
                start, end = batch.copy_timing
                self.copy_seconds += start.elapsed_time(end) / 1e3
            for i, key in enumerate(batch.keys):
                self.store.put(key, batch.kind, batch.num_tokens, batch.payload(i))
                if self._queue is not None:
                    # Building an object copies its payload outside the GIL (``blob.build``); between objects
                    # the GIL goes back to the engine's thread at once rather than after the switch interval.
                    time.sleep(0)
        except Exception:  # a lost batch costs later misses, never wrong bytes: its keys stop being pending
            log.exception("kv tier: write-back of %d blocks failed", len(batch.keys))
        finally:
            with self._lock:
                for key in batch.keys:
                    if self._pending.get(key) is batch:
                        del self._pending[key]
                self._batches.remove(batch)
            batch.done.set()
