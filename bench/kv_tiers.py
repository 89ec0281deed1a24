"""Disk-tier throughput for cache objects of one size (default 1 MiB), on this machine's disk.

    python bench/kv_tiers.py [--dir /path/on/the/disk] [--mib 1] [--count 256]

Rows (MiB/s, the best of --repeats):
  write fsync        DiskTier.put: temp file, fsync, rename (what the store's writer thread does)
  write no-fsync     the same without fsync (the cost of durability)
  read page-cache    DiskTier.get of files just written (still in the page cache)
  read cold          DiskTier.get after posix_fadvise(DONTNEED) drops each file from the page cache
  store put+flush    TieredStore (disk only): header + SHA-256 checksum, queue, writer thread; a flush
                     every queue-depth objects (a full queue would drop writes)
  store get          TieredStore.get of cold files: read + header checks + checksum verification
Prints a table; nothing is written besides the objects in a temporary directory under --dir.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from deepinfer.kv.tiers import DiskTier, StoreIdentity, TieredStore
from deepinfer.kv.tiers.blob import HEADER_BYTES


def _drop_page_cache(disk: DiskTier, keys: list[bytes]) -> None:
    for k in keys:
        fd = os.open(disk.path(k), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 2**20


def run(root: Path, size: int, count: int) -> dict[str, float]:
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(count)]
    blob = os.urandom(size)
    total = size * count
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=root) as d:
        for name, fsync in (("write fsync", True), ("write no-fsync", False)):
            disk = DiskTier(Path(d) / name.replace(" ", "_"), 2 * total, fsync=fsync)
            t = time.perf_counter()
            for k in keys:
                disk.put(k, blob)
            out[name] = _rate(total, time.perf_counter() - t)
            if fsync:
                t = time.perf_counter()
                for k in keys:
                    disk.get(k)
                out["read page-cache"] = _rate(total, time.perf_counter() - t)
                _drop_page_cache(disk, keys)
                t = time.perf_counter()
                for k in keys:
                    disk.get(k)
                out["read cold"] = _rate(total, time.perf_counter() - t)
            disk.close()
        ident = StoreIdentity(b"b" * 32, 256)
        payload = blob[: size - HEADER_BYTES]  # so that a stored object is `size` bytes like the rows above
        disk = DiskTier(Path(d) / "store", 2 * total)
        depth = 64
        store = TieredStore(ident, None, disk, queue_depth=depth)
        t = time.perf_counter()
        for i in range(0, count, depth):  # a full queue drops writes: flush before it fills
            for k in keys[i:i + depth]:
                store.put(k, "history", 256, payload)
            store.flush()
        out["store put+flush"] = _rate(total, time.perf_counter() - t)
        assert store.stats().write_drops == 0
        _drop_page_cache(disk, keys)
        t = time.perf_counter()
        hits = sum(store.get(k) is not None for k in keys)
        out["store get"] = _rate(total, time.perf_counter() - t)
        assert hits == count, f"{hits} of {count} objects came back"
        store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    ap.add_argument("--mib", type=float, default=1.0, help="object size in MiB")
    ap.add_argument("--count", type=int, default=256, help="objects per run")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    size = int(a.mib * 2**20)
    best: dict[str, float] = {}
    for _ in range(a.repeats):
        for name, rate in run(Path(a.dir), size, a.count).items():
            best[name] = max(best.get(name, 0.0), rate)
    print(f"disk tier, {a.count} objects of {size / 2**20:g} MiB under {a.dir} (best of {a.repeats})")
    for name, rate in best.items():
        print(f"  {name:<16} {rate:9.0f} MiB/s  ({size / 2**20 / rate * 1e3:6.2f} ms per object)")


if __name__ == "__main__":
    main()
