"""Host cost of the cache tiers' save and load paths, model-free, with V4-Flash-sized blocks.

    python bench/kv_tier_host.py [--layers 4] [--block-size 256] [--blocks 48] [--repeats 7]

The cache layout is V4-Flash's (``deepinfer/assets/shapes/v4-flash``) cut to --layers layers, without the MTP
layer: at 4 layers and 256 positions a block is 82 KiB of history, 1 MiB of window and 3.5 MiB of state, the
blocks of the H200 trace (``bench/prefix_cache.py``). Storage and staging live in host memory, so every row
is host work a GPU engine does too, minus its device copies. Rows, per pool (ms per MiB, median of --repeats):

  fetch          TierLink.fetch_all of host-tier objects: the store lookup and every check short of the payload
                 checksum (host memory is trusted), no copy
  fetch disk     the same from a disk-only store (files in the page cache): read + checksum verified
  stage          fetch + the payloads copied into a staging region ([blocks, payload] rows), the host half of a
                 device load (``unpack_many`` with ``staged``); the device copy follows it
  unpack cpu     fetch + unpack_many into CPU storage (the CPU engine's load)
  put            TieredStore.put of the blocks' rows: building each stored object (the write-back thread's work)

and two rows of the engine's thread sharing the interpreter with a write-back thread that builds objects of
window blocks (the saves of evicted blocks, ``tiers/writeback.py``):

  wake-up        a thread sleeping 0.5 ms at a time wakes while the write-back thread builds --blocks window
                 objects: its mean delay past the sleep, against the same alone (ms). Waking needs the GIL, as
                 the engine's thread does after waiting for the device, before it launches the next kernels
  load in wb     fetch + stage of window blocks while the write-back thread builds objects: ms per MiB loaded

With fewer free cores than threads, the threads also wait for a core: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer.config.model import ModelConfig
from deepinfer.kv.offload import TierLink, store_identity
from deepinfer.kv.prefix_hash import BlockHasher, CacheNamespace
from deepinfer.kv.spec import POOLS, WINDOW, build_layout
from deepinfer.kv.storage import KVStorage
from deepinfer.kv.tiers import DiskTier, HostTier, TieredStore, payload_bytes, unpack_many
from deepinfer.kv.tiers import payload as payload_mod
from deepinfer.kv.tiers.writeback import SaveBatch, WriteBack

SHAPES = Path(__file__).resolve().parents[1] / "deepinfer" / "assets" / "shapes" / "v4-flash"
MiB = 1 << 20
_KEPT: list[TieredStore] = []
WAKE = 0.5e-3  # the wake-up probe's sleep


def _storage(layers: int, block_size: int, blocks: int) -> KVStorage:
    cfg = ModelConfig.from_model_dir(SHAPES, {"num_hidden_layers": layers})
    storage = KVStorage(build_layout(cfg, block_size, include_mtp=False), {p: blocks for p in POOLS}, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for t in storage.tensors.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return storage


def _hashes(n: int, tag: str) -> list[bytes]:
    return [hashlib.sha256(f"{tag} {i}".encode()).digest() for i in range(n)]


def _stage(payloads, staged: torch.Tensor, width: int) -> torch.Tensor:
    """The host half of a device load: the payloads copied into staging rows."""
    fn = getattr(payload_mod, "stage", None)
    if fn is not None:
        return fn(payloads, staged, width)
    rows = staged[:len(payloads) * width].view(len(payloads), width)  # the code of unpack_many before ``stage``
    host = rows.numpy()
    for i, data in enumerate(payloads):
        host[i] = np.frombuffer(data, dtype=np.uint8)
    return rows


def _median_ms_per_mib(fn, nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3 / (nbytes / MiB)


def _wake_ups(until) -> list[float]:
    """Sleep WAKE at a time until ``until()``; each wake-up's delay past WAKE. A thread that wakes needs the GIL
    to go on, as the engine's thread does after waiting for the device, before it launches the next kernels."""
    delays = []
    while not until():
        t = time.perf_counter()
        time.sleep(WAKE)
        delays.append(time.perf_counter() - t - WAKE)
    return delays


def _with_writeback(storage: KVStorage, identity, blocks: int, tag: str, foreground,
                    done: threading.Event | None = None) -> tuple[object, float]:
    """(what ``foreground()`` returns, write-back seconds) with a write-back thread building ``blocks`` window
    objects meanwhile; ``done`` is set once they are all built."""
    store = TieredStore(identity, HostTier(1 << 40))
    wb = WriteBack(store, threaded=True)
    parts = payload_mod.block_major(storage, WINDOW)
    keys = tuple(b"w" + h for h in _hashes(blocks, tag))
    started = threading.Event()
    ready = _Ready(started)
    t0 = time.perf_counter()
    wb.submit(SaveBatch(keys, WINDOW, storage.layout.block_size,
                        lambda i: [p[i % storage.num_blocks[WINDOW]].numpy() for p in parts], ready))
    started.wait()
    if done is not None:
        threading.Thread(target=lambda: (wb.flush(), done.set()), daemon=True).start()
    fg = foreground()
    wb.flush()
    total = time.perf_counter() - t0
    wb.close()
    _KEPT.append(store)  # the objects stay: every build writes fresh memory, as a filling host tier's do
    return fg, total


class _Ready:
    """A copy fence that is already complete; tells the benchmark when the write-back thread started."""

    def __init__(self, started: threading.Event) -> None:
        self.started = started

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.started.set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--blocks", type=int, default=48, help="blocks per pool in each timed batch")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--verbose", action="store_true", help="print each repeat of the write-back rows")
    a = p.parse_args()
    torch.set_num_threads(1)
    storage = _storage(a.layers, a.block_size, a.blocks)
    hasher = BlockHasher(CacheNamespace(b"bench" * 4, a.block_size, "bfloat16"))
    identity = store_identity(hasher, storage)
    hashes = _hashes(a.blocks, "load")
    ids = list(range(a.blocks))
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        link = TierLink(TieredStore(identity, HostTier(1 << 40)), storage)
        disk_link = TierLink(TieredStore(identity, None, DiskTier(Path(d) / "kv", 1 << 40, fsync=False)), storage)
        for pool in POOLS:
            size = payload_bytes(storage, pool)
            total = size * a.blocks
            blocks = [(pool, b, h) for b, h in zip(ids, hashes)]
            for lk in (link, disk_link):
                lk.save(blocks)
                lk.store.flush()
            want = [(pool, h) for h in hashes]
            staged = torch.empty(total, dtype=torch.uint8)

            def stage() -> None:
                got = link.fetch_all(want)
                _stage([got[k] for k in want], staged, size)

            def unpack_cpu() -> None:
                got = link.fetch_all(want)
                unpack_many([got[k] for k in want], storage, pool, ids)

            put_keys = iter(range(1 << 30))
            put_parts = payload_mod.block_major(storage, pool)
            put_store = TieredStore(identity, HostTier(1 << 40))

            def put() -> None:
                n = next(put_keys)
                for i in ids:
                    put_store.put(hashlib.sha256(f"put {n} {i}".encode()).digest(), pool, a.block_size,
                                  [t[i].numpy() for t in put_parts])

            rows[pool] = {
                "fetch": _median_ms_per_mib(lambda: link.fetch_all(want), total, a.repeats),
                "fetch disk": _median_ms_per_mib(lambda: disk_link.fetch_all(want), total, a.repeats),
                "stage": _median_ms_per_mib(stage, total, a.repeats),
                "unpack cpu": _median_ms_per_mib(unpack_cpu, total, a.repeats),
                "put": _median_ms_per_mib(put, total, a.repeats),
            }
            put_store.close()
        link.store.close()
        disk_link.store.close()

    # The engine's thread next to a write-back thread (window blocks).
    wsize = payload_bytes(storage, WINDOW)
    written = wsize * a.blocks
    wake, load_wb, load_alone = [], [], []
    load_link = TierLink(TieredStore(identity, HostTier(1 << 40)), storage)
    load_link.save([(WINDOW, b, h) for b, h in zip(ids, hashes)])
    want = [(WINDOW, h) for h in hashes]
    staged = torch.empty(written, dtype=torch.uint8)

    def load() -> float:
        t = time.perf_counter()
        got = load_link.fetch_all(want)
        _stage([got[k] for k in want], staged, wsize)
        return time.perf_counter() - t

    for r in range(a.repeats):
        done = threading.Event()
        delays, total = _with_writeback(storage, identity, a.blocks, f"wake {r}", lambda: _wake_ups(done.is_set), done)
        end = time.perf_counter() + total
        alone = _wake_ups(lambda: time.perf_counter() > end)
        wake.append((statistics.mean(delays) * 1e3, statistics.mean(alone) * 1e3))
        if a.verbose:
            print(f"repeat {r}: wake-up delay {wake[-1][0]:.3f} ms (alone {wake[-1][1]:.3f}), "
                  f"{a.blocks} window objects built in {total * 1e3:.1f} ms")
        load_alone.append(load() * 1e3 / (written / MiB))
        fg, _ = _with_writeback(storage, identity, a.blocks, f"load {r}", load)
        load_wb.append(fg * 1e3 / (written / MiB))
    load_link.store.close()

    print(f"# Tier host paths ({a.layers} V4-Flash layers, block {a.block_size}, {a.blocks} blocks a batch; "
          f"ms per MiB, median of {a.repeats})\n")
    cols = list(next(iter(rows.values())))
    print("| pool | payload | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for pool, row in rows.items():
        print(f"| {pool} | {payload_bytes(storage, pool) / 1024:.0f} KiB | "
              + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    print(f"\nWake-up delay of a sleeping thread while the write-back thread builds {a.blocks} window objects: "
          f"{statistics.median(w for w, _ in wake):.3f} ms (alone {statistics.median(x for _, x in wake):.3f} ms).")
    print(f"Load (fetch + stage) of {a.blocks} window blocks: {statistics.median(load_alone):.3f} ms/MiB alone, "
          f"{statistics.median(load_wb):.3f} ms/MiB while the write-back thread builds objects.")


if __name__ == "__main__":
    main()
