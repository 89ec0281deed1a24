"""The asynchronous save path of the cache tiers, driven on the CPU: a stand-in for the device copy stream
holds every device-to-host copy "in flight" until the test completes it, so the bookkeeping around it
(pending blocks, fetches that wait, saves of a block already on its way, close) runs as it does on a GPU,
where the copy engine finishes whenever it does. Also the staging ring's reuse rules and the one-copy
encoding of a payload from its parts."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.config.model import ModelConfig
from deepinfer.kv.offload import TierLink
from deepinfer.kv.spec import POOLS, build_layout
from deepinfer.kv.storage import KVStorage
from deepinfer.kv.tiers import DiskTier, HostTier, StoreIdentity, TieredStore, pack
from deepinfer.kv.tiers.blob import build, decode, encode, seal
from deepinfer.kv.tiers.staging import Flag, StagingRing

IDENTITY = StoreIdentity(hashlib.sha256(b"writeback test").digest(), 128)


class HeldCopies:
    """The copy stream's stand-in: a copy is recorded when issued and carried out only by ``complete``,
    so anything reading the staging rows too early would read zeros, not the blocks' bytes."""

    def __init__(self) -> None:
        self.held: list[tuple[torch.Tensor, torch.Tensor, Flag]] = []
        self.issued = 0

    def to_host(self, gathered: torch.Tensor, dst: torch.Tensor):
        fence = Flag()
        self.held.append((gathered, dst, fence))
        self.issued += 1
        return fence, None

    def complete(self) -> None:
        while self.held:  # pop: close() may issue more copies from another thread meanwhile
            gathered, dst, fence = self.held.pop(0)
            dst.copy_(gathered)
            fence.set()

    @staticmethod
    def mark() -> Flag:
        done = Flag()
        done.set()  # a CPU copy is over when it returns
        return done

    @staticmethod
    def elapsed(start, end) -> None:
        return None


def _storage(seed: int) -> KVStorage:
    layout = build_layout(ModelConfig.from_model_dir(demo_model_dir()), block_size=128)
    storage = KVStorage(layout, {p: 4 for p in POOLS}, torch.bfloat16)
    _randomize(storage, seed)
    return storage


def _randomize(storage: KVStorage, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in storage.tensors.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _hash(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def _link(store: TieredStore, storage: KVStorage, copier=None) -> TierLink:
    return TierLink(store, storage, replay=True, staging_bytes=1 << 20, copier=copier)


def test_pending_blocks_are_found_and_read_only_once_their_copy_is_done() -> None:
    storage, copier = _storage(1), HeldCopies()
    store = TieredStore(IDENTITY, HostTier(64 << 20))
    link = _link(store, storage, copier)
    want = {b: pack(storage, "window", b) for b in (1, 2)}
    link.save([("window", 1, _hash(1)), ("window", 2, _hash(2)), ("state", 3, _hash(3))])
    _randomize(storage, 2)  # the step overwrites the evicted blocks at once: the save gathered them before
    key = link.key("window", _hash(1))
    assert copier.issued == 1 and link.saved == 2  # one batch for the pool; state blocks stay out (replay)
    assert link.exists("window", _hash(1)) and not store.exists(key)  # pending: counted, not yet stored
    assert not link.exists("state", _hash(3))
    # Fetch while the copy is in flight: the fetch must wait for the batch. The copy completes only once
    # the fetch is waiting (deterministically: the batch's completion flag reports the wait).
    batch = link._writeback._pending[key]
    waiting, wait = threading.Event(), batch.done.wait
    batch.done.wait = lambda *a: (waiting.set(), wait(*a))[1]
    completer = threading.Thread(target=lambda: (waiting.wait(), copier.complete()))
    completer.start()
    got = {b: link.fetch("window", _hash(b)) for b in (1, 2)}
    completer.join()
    assert {b: bytes(p) for b, p in got.items()} == want
    link.close([])


def test_a_block_saved_again_while_pending_is_copied_once() -> None:
    storage, copier = _storage(3), HeldCopies()
    store = TieredStore(IDENTITY, HostTier(64 << 20))
    link = _link(store, storage, copier)
    want = pack(storage, "history", 0)
    link.save([("history", 0, _hash(0))])
    link.save([("history", 0, _hash(0)), ("history", 0, _hash(0))])  # evicted again (and twice in one plan)
    assert copier.issued == 1 and link.saved == 1
    copier.complete()
    link.flush()
    link.save([("history", 0, _hash(0))])  # host memory holds it now: not copied either
    assert copier.issued == 1 and link.saved == 1
    assert bytes(link.fetch("history", _hash(0))) == want
    assert store.stats().tier("host").stored == 1
    link.close([])


def test_close_waits_for_pending_saves_and_writes_them_to_disk(tmp_path) -> None:
    storage, copier = _storage(4), HeldCopies()
    store = TieredStore(IDENTITY, HostTier(64 << 20), DiskTier(tmp_path, 64 << 20))
    link = _link(store, storage, copier)
    blocks = [("history", b, _hash(b)) for b in range(4)] + [("window", 3, _hash(9))]
    want = {link.key(p, h): pack(storage, p, b) for p, b, h in blocks}
    link.save(blocks[:3])
    closer = threading.Thread(target=link.close, args=(blocks[3:],))  # the rest still cached on the device
    closer.start()
    while closer.is_alive():  # close saves the cached blocks (a second batch), then waits for them all
        copier.complete()
        closer.join(timeout=0.01)
    with TieredStore(IDENTITY, disk=DiskTier(tmp_path, 64 << 20)) as again:
        assert {k: bytes(again.get(k).payload) for k in want} == want


def test_cpu_saves_and_loads_are_synchronous_and_bit_exact() -> None:
    storage = _storage(5)
    link = _link(TieredStore(IDENTITY, HostTier(64 << 20)), storage)
    assert link._ring is None  # nothing asynchronous on the CPU
    want = [pack(storage, "window", b) for b in (0, 3)]
    link.save([("window", 0, _hash(0)), ("window", 3, _hash(3))])
    payloads = [link.fetch("window", _hash(b)) for b in (0, 3)]
    assert [bytes(p) for p in payloads] == want
    link.load([("window", 2, payloads[0]), ("window", 1, payloads[1])])
    assert [pack(storage, "window", b) for b in (2, 1)] == want
    link.close([])


def test_loads_through_the_staging_ring_are_bit_exact() -> None:
    src, dst = _storage(6), _storage(7)
    store = TieredStore(IDENTITY, HostTier(64 << 20))
    copier = HeldCopies()
    writer, reader = _link(store, src, copier), _link(store, dst, HeldCopies())
    writer.save([("history", b, _hash(b)) for b in range(4)])
    copier.complete()
    writer.flush()
    reader.load([("history", 3 - b, reader.fetch("history", _hash(b))) for b in range(4)])
    assert [pack(dst, "history", 3 - b) for b in range(4)] == [pack(src, "history", b) for b in range(4)]
    assert reader.loaded == 4
    writer.close([])
    reader.close([])


class _Copying:
    """A fence whose copy completes when someone waits for it."""

    def __init__(self) -> None:
        self.done = self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


def test_staging_ring_reuses_regions_only_once_their_copies_are_done() -> None:
    ring = StagingRing(4096, pin=False)
    base = ring.take(1).data_ptr()
    ring.drain()
    fences = [_Copying() for _ in range(3)]
    regions = [ring.take(1024, fence=f) for f in fences[:2]] + [ring.take(1536, fence=fences[2])]
    assert [r.data_ptr() - base for r in regions] == [0, 1024, 2048]
    fourth = ring.take(1024)  # no room at the end: waits for the oldest copy, then wraps around
    assert fourth.data_ptr() == base and fences[0].waited and not fences[1].waited and ring.waits == 1
    fences[1].done = True
    fifth = ring.take(1000)  # the second region's copy is done: reused without waiting
    assert fifth.data_ptr() - base == 1024 and ring.waits == 1
    big = ring.take(10000)  # larger than the buffer: every region in use is waited for, then a larger buffer
    assert fences[2].waited and ring.grown == 1 and ring.capacity >= 10000 and big.numel() == 10000


def test_a_payload_in_parts_encodes_as_the_joined_payload() -> None:
    parts = [b"abc" * 100, bytearray(b"\x00\xff" * 7), memoryview(b"tail")]
    whole = b"".join(parts)
    for sealed in (True, False):
        assert encode(IDENTITY, b"k", "window", 128, parts, sealed) == encode(IDENTITY, b"k", "window", 128, whole,
                                                                               sealed)
    assert bytes(decode(IDENTITY, b"k", encode(IDENTITY, b"k", "window", 128, parts)).payload) == whole
    built = build(IDENTITY, b"k", "window", 128, parts)  # the store's objects: numpy copies, outside the GIL
    assert built.tobytes() == encode(IDENTITY, b"k", "window", 128, whole, sealed=False)
    assert not built.flags.writeable and seal(built).tobytes() == encode(IDENTITY, b"k", "window", 128, whole)
    with pytest.raises(ValueError, match="^nbytes"):
        StagingRing(0, pin=False)


def test_host_memory_keeps_built_objects_without_copying_and_copies_mutable_ones() -> None:
    host = HostTier(1 << 20)
    built = build(IDENTITY, b"k", "window", 128, b"payload")
    host.put(b"k", built)
    assert host.get(b"k") is built
    mutable = bytearray(b"a mutable buffer")
    host.put(b"m", mutable)
    mutable[0] = ord("A")
    assert host.get(b"m") == b"a mutable buffer"


class StagedMarks(HeldCopies):
    """Records, at each timing mark of a load, what the staging region and the destination blocks hold."""

    def __init__(self, link_of, dst: KVStorage, pool: str, blocks: list[int]) -> None:
        super().__init__()
        self.link_of, self.dst, self.pool, self.blocks = link_of, dst, pool, blocks
        self.seen: list[tuple[bytes, list[bytes]]] = []

    def mark(self) -> Flag:
        ring = self.link_of()._load_ring
        self.seen.append((ring._buf.numpy().tobytes(), [pack(self.dst, self.pool, b) for b in self.blocks]))
        return HeldCopies.mark()


def test_load_timing_brackets_the_device_copy_only() -> None:
    """The start mark comes once the host has staged every payload, right before the copy is queued; the end
    mark after the blocks are written: the load copy time is device work, not the host's staging."""
    src, dst = _storage(8), _storage(9)
    store = TieredStore(IDENTITY, HostTier(64 << 20))
    writer = _link(store, src, None)
    writer.save([("window", b, _hash(b)) for b in range(2)])
    reader = None
    marks = StagedMarks(lambda: reader, dst, "window", [3, 2])
    reader = _link(store, dst, marks)
    want = [pack(src, "window", b) for b in range(2)]
    before = [pack(dst, "window", b) for b in (3, 2)]
    reader.load([("window", 3 - b, reader.fetch("window", _hash(b))) for b in range(2)])
    (staged_at_start, blocks_at_start), (_, blocks_at_end) = marks.seen
    assert staged_at_start.startswith(b"".join(want))  # staged before the start mark
    assert blocks_at_start == before != want  # the copy comes after it
    assert blocks_at_end == want
    reader.close([])
    writer.close([])
