"""Host-memory tier: one uint8 tensor per blob, pinned when CUDA is present.

Pinned (page-locked) buffers let a later host-to-device copy run as DMA without a staging copy; on a
CPU-only machine pinning is impossible and pointless, so buffers are ordinary memory there. Per-blob
tensors rather than one hand-managed arena: PyTorch's caching host allocator already recycles pinned
blocks of equal size (every block of a pool has the same size), which is what an arena would buy.
"""

from __future__ import annotations

import numpy as np
import torch


class HostTier:
    name = "host"
    trusted = True

    def __init__(self, capacity_bytes: int, pin: bool | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self._capacity = int(capacity_bytes)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._blobs: dict[bytes, torch.Tensor] = {}
        self._used = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, key: bytes) -> bytes | None:
        buf = self._blobs.get(key)
        return None if buf is None else buf.numpy().tobytes()

    def exists(self, key: bytes) -> bool:
        return key in self._blobs

    def put(self, key: bytes, blob: bytes) -> bool:
        self.delete(key)
        buf = torch.empty(len(blob), dtype=torch.uint8, pin_memory=self.pinned)
        np.copyto(buf.numpy(), np.frombuffer(blob, dtype=np.uint8))
        self._blobs[key] = buf
        self._used += len(blob)
        return True

    def delete(self, key: bytes) -> bool:
        buf = self._blobs.pop(key, None)
        if buf is None:
            return False
        self._used -= buf.numel()
        return True

    def scan(self) -> list[tuple[bytes, int]]:
        return [(k, v.numel()) for k, v in self._blobs.items()]

    def close(self) -> None:
        self._blobs.clear()
        self._used = 0
