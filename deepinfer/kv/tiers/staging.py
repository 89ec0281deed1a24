"""StagingRing: one pinned host buffer that every tier copy between the device and host memory goes through.

Pinning is what makes a device<->host copy run at the copy engine's speed (~55 GB/s on an H200 host, against
~7-12 GB/s pageable), but pinning a fresh buffer per copy costs more than the copy (``cudaHostAlloc``).
So the tier link allocates one buffer, sized from the engine's config, and hands out regions of it in
order, like a ring: a region is free again once its copy has completed (its ``fence``). A request that
does not fit waits for the oldest regions; one larger than the whole buffer replaces it with a bigger one
(the link splits its batches so that this stays rare: only a block larger than half the buffer grows it).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

ALIGN = 512  # region starts: DMA-friendly, and any dtype view of a region is aligned


class Fence(Protocol):
    """Completion of the work that uses a region (``torch.cuda.Event`` has both methods)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Flag(threading.Event):
    """A fence set by host code (a thread that is done with a region), e.g. the write-back thread."""

    def query(self) -> bool:
        return self.is_set()

    def synchronize(self) -> None:
        self.wait()


@dataclass(slots=True)
class _Region:
    start: int
    end: int
    fence: Fence | None  # None: free as soon as it is handed out (synchronous use)


class StagingRing:
    def __init__(self, nbytes: int, pin: bool) -> None:
        if nbytes < 1:
            raise ValueError(f"nbytes: must be >= 1, got {nbytes}")
        self.pin = pin
        self._buf = torch.empty(_round(nbytes), dtype=torch.uint8, pin_memory=pin)
        self._live: deque[_Region] = deque()  # regions in use, oldest first
        self.grown = 0  # times the buffer was replaced by a larger one
        self.waits = 0  # times a request waited for an older region's copy

    @property
    def capacity(self) -> int:
        return self._buf.numel()

    def take(self, nbytes: int, fence: Fence | None = None) -> torch.Tensor:
        """A [nbytes] uint8 view of the buffer that no region in use overlaps; it stays reserved until
        ``fence`` completes (set it later with ``fence_last`` when the fence exists only after the copy is
        issued). Never returns memory a pending copy still reads or writes."""
        size = _round(max(nbytes, 1))
        if size > self.capacity:
            self._grow(size)
        while True:
            self._reclaim(wait=False)
            start = self._fit(size)
            if start is not None:
                break
            self.waits += 1
            self._reclaim(wait=True)  # the oldest region's copy: it is the next to free space
        self._live.append(_Region(start, start + size, fence))
        return self._buf[start:start + nbytes]

    def fence_last(self, fence: Fence) -> None:
        """Attach the fence of the region handed out last (its copy has just been issued)."""
        self._live[-1].fence = fence

    def drain(self) -> None:
        """Wait until no region is in use."""
        while self._live:
            self._reclaim(wait=True)

    def _fit(self, size: int) -> int | None:
        if not self._live:
            return 0
        head, tail = self._live[-1].end, self._live[0].start
        if self._live[-1].start >= tail:  # not wrapped: free space is [head, end) and [0, tail)
            if head + size <= self.capacity:
                return head
            return 0 if size <= tail else None
        return head if head + size <= tail else None  # wrapped: free space is [head, tail)

    def _reclaim(self, wait: bool) -> None:
        """Free the oldest regions whose copies completed; with ``wait``, wait for the oldest one first."""
        if wait and self._live and self._live[0].fence is not None:
            self._live[0].fence.synchronize()
        while self._live and (self._live[0].fence is None or self._live[0].fence.query()):
            self._live.popleft()

    def _grow(self, size: int) -> None:
        # Regions of the old buffer are waited for: they may still be read or written by a copy.
        self.drain()
        self._buf = torch.empty(_round(max(size, 2 * self.capacity)), dtype=torch.uint8, pin_memory=self.pin)
        self.grown += 1


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
