"""The tier interface: opaque byte blobs by key, nothing more.

Four verbs (HiCache's get/exists/set plus delete) and two sizes, so that a shared filesystem, Mooncake or
NIXL-backed tier can plug in later without knowing about blocks, pools or the format of a blob. Recency,
size limits, spilling and integrity checks live above, in ``TieredStore``, which also serializes calls
for any one key: a tier need not be safe against concurrent calls on the *same* key.
"""

from __future__ import annotations

from typing import Protocol


class Tier(Protocol):
    name: str
    # True when stored bytes cannot change behind the process's back (its own memory): reads check the
    # header but skip the payload checksum. False for anything on a device, a disk or a network.
    trusted: bool

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def get(self, key: bytes) -> bytes | None:
        """The blob stored under ``key``, or None (never seen, evicted or unreadable)."""

    def exists(self, key: bytes) -> bool: ...

    def put(self, key: bytes, blob: bytes) -> bool:
        """Store ``blob`` (replacing any under ``key``); False when it could not be stored."""

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False when it was not there."""

    def scan(self) -> list[tuple[bytes, int]]:
        """(key, size) of every stored object, least recently used first (rebuilds recency on start)."""

    def close(self) -> None: ...
