"""Local-disk tier (``--kv-cache-dir``): one file per blob, written atomically, found again after a restart.

Layout: ``<dir>/<first two hex digits of the key>/<key in hex>.kvb``. A write goes to a temporary file
in the same directory, is fsync'ed and then renamed over the final name, so a reader sees the whole
old file, the whole new one or nothing; a crash leaves at worst a temporary file, which the next start
removes (and counts). Recency survives a restart through file modification times, refreshed on reads.

One process owns a directory at a time (an exclusive ``flock`` on ``<dir>/.lock``): two engines writing
and evicting the same files would each trust an index the other invalidates.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import threading
from pathlib import Path

log = logging.getLogger("deepinfer")

SUFFIX = ".kvb"
_FINAL = re.compile(r"([0-9a-f]{2,128})\.kvb")
_TEMP = re.compile(r"[0-9a-f]{2,128}\.kvb\.tmp-.*")
_SHARD = re.compile(r"[0-9a-f]{2}")


class DiskTier:
    name = "disk"
    trusted = False

    def __init__(self, root: str | Path, capacity_bytes: int, fsync: bool = True) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_cache_dir: cannot create {str(self.root)!r}: {e.strerror}") from None
        self._capacity = int(capacity_bytes)
        self.fsync = fsync
        self._lock_file = self._take_lock()
        self._index: dict[bytes, int] = {}  # key -> file size
        self._used = 0
        self._mutex = threading.Lock()  # the index is touched by the store's writer thread and its callers
        self._tmp_ids = itertools.count()
        self.torn_files_removed = 0
        self._order = self._scan_dir()

    def _take_lock(self):
        f = open(self.root / ".lock", "a+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise ValueError(f"kv_cache_dir: {str(self.root)!r} is in use by another process") from None
        return f

    def _scan_dir(self) -> list[bytes]:
        found: list[tuple[float, bytes, int]] = []
        for shard in self.root.iterdir():
            if not (shard.is_dir() and _SHARD.fullmatch(shard.name)):
                continue
            for path in shard.iterdir():
                if _TEMP.fullmatch(path.name):  # a write that never reached its rename
                    path.unlink(missing_ok=True)
                    self.torn_files_removed += 1
                    continue
                m = _FINAL.fullmatch(path.name)
                if m is None or len(m.group(1)) % 2:
                    continue  # not ours: leave it alone
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, path.name, st.st_size))
        found.sort()
        order = []
        for _, fname, size in found:
            key = bytes.fromhex(fname[: -len(SUFFIX)])
            self._index[key] = size
            self._used += size
            order.append(key)
        if self.torn_files_removed:
            log.warning("kv cache dir %s: removed %d unfinished writes", self.root, self.torn_files_removed)
        return order

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / f"{h}{SUFFIX}"

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, key: bytes) -> bytes | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:  # an unreadable file is as good as a corrupt one
            log.warning("kv cache dir: cannot read %s (%s); dropping it", path, e)
            self.delete(key)
            return None
        try:
            os.utime(path)  # recency for the next start
        except OSError:
            pass
        return data

    def exists(self, key: bytes) -> bool:
        with self._mutex:
            return key in self._index

    def put(self, key: bytes, blob: bytes) -> bool:
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{next(self._tmp_ids)}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
        except OSError as e:
            log.warning("kv cache dir: cannot write %s (%s)", path, e)
            tmp.unlink(missing_ok=True)
            return False
        with self._mutex:
            self._used += len(blob) - self._index.get(key, 0)
            self._index[key] = len(blob)
        return True

    def delete(self, key: bytes) -> bool:
        try:
            self.path(key).unlink()
            found = True
        except FileNotFoundError:
            found = False
        except OSError as e:
            log.warning("kv cache dir: cannot delete %s (%s)", self.path(key), e)
            found = True
        return self._forget(key) or found

    def _forget(self, key: bytes) -> bool:
        with self._mutex:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        return size is not None

    def scan(self) -> list[tuple[bytes, int]]:
        """Objects found on disk at start (oldest first), then those written since."""
        with self._mutex:
            seen = [k for k in self._order if k in self._index]
            listed = set(seen)
            return [(k, self._index[k]) for k in seen] + [(k, s) for k, s in self._index.items() if k not in listed]

    def close(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None
