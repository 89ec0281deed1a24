"""Cache tiers below the device pools: host and disk tiers, the LRU across them, write-back, prefetch,
restart, and corrupted objects (each one a miss plus deletion, never an exception or wrong bytes)."""

from __future__ import annotations

import hashlib
import os
import random
import threading

import pytest

from deepinfer.kv.tiers import BlobError, DiskTier, HostTier, StoreIdentity, TieredStore
from deepinfer.kv.tiers.blob import HEADER_BYTES, decode, encode, seal

ID = StoreIdentity(b"c" * 32, 128)
N = 1000  # payload bytes
BLOB = HEADER_BYTES + N


def key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(N)


def store(tmp_path, host_blobs: int | None = None, disk_blobs: int | None = None, **kw) -> TieredStore:
    host = HostTier(host_blobs * BLOB) if host_blobs is not None else None
    disk = DiskTier(tmp_path / "kv", disk_blobs * BLOB) if disk_blobs is not None else None
    return TieredStore(ID, host, disk, **kw)


def fill(s: TieredStore, keys) -> None:
    for i in keys:
        s.put(key(i), "history", 128, payload(i))


def assert_hit(s: TieredStore, i: int) -> None:
    got = s.get(key(i))
    assert got is not None and got.payload == payload(i) and got.kind == "history" and got.num_tokens == 128


# ---- the object format -----------------------------------------------------------------------------------
def test_blob_round_trip_and_checks() -> None:
    blob = encode(ID, key(1), "window", 127, payload(1))
    got = decode(ID, key(1), blob)
    assert (got.kind, got.num_tokens, bytes(got.payload)) == ("window", 127, payload(1))
    cases = {
        "another configuration": (StoreIdentity(b"d" * 32, 128), key(1), blob),
        "block size": (StoreIdentity(b"c" * 32, 256), key(1), blob),
        "another key": (ID, key(2), blob),
        "truncated": (ID, key(1), blob[:HEADER_BYTES - 1]),
        "payload bytes": (ID, key(1), blob[:-1]),
        "checksum": (ID, key(1), blob[:-1] + bytes([blob[-1] ^ 1])),
        "magic": (ID, key(1), b"XXXX" + blob[4:]),
        "format version": (ID, key(1), blob[:4] + b"\x09\x00" + blob[6:]),
    }
    for reason, args in cases.items():
        with pytest.raises(BlobError, match=reason):
            decode(*args)
    flipped = blob[:-1] + bytes([blob[-1] ^ 1])
    assert decode(ID, key(1), flipped, verify_payload=False).payload != payload(1)  # trusted memory only


def test_unsealed_blobs_are_sealed_before_any_checked_read() -> None:
    raw = encode(ID, key(1), "window", 127, payload(1), sealed=False)
    assert len(raw) == len(encode(ID, key(1), "window", 127, payload(1)))
    assert bytes(decode(ID, key(1), raw, verify_payload=False).payload) == payload(1)  # host memory reads it
    with pytest.raises(BlobError, match="checksum"):  # a disk read never accepts an unsealed blob
        decode(ID, key(1), raw)
    sealed = seal(raw)
    assert sealed == encode(ID, key(1), "window", 127, payload(1))
    assert seal(sealed) is sealed


def test_objects_put_in_host_memory_reach_the_disk_sealed(tmp_path) -> None:
    with store(tmp_path, host_blobs=2, disk_blobs=8) as s:
        fill(s, range(5))  # three spill from host memory to the disk, unsealed until the writer seals them
        s.flush()
    disk = DiskTier(tmp_path / "kv", 8 * BLOB)
    for i in range(5):  # close() wrote the last two down as well
        assert decode(ID, key(i), disk.get(key(i))).payload == payload(i)


def test_bad_arguments_name_the_field(tmp_path) -> None:
    with pytest.raises(ValueError, match="^key"):
        encode(ID, b"", "history", 1, b"x")
    with pytest.raises(ValueError, match="^kind"):
        encode(ID, key(0), "x" * 17, 1, b"x")
    with pytest.raises(ValueError, match="^config_digest"):
        StoreIdentity(b"short", 128)
    with pytest.raises(ValueError, match="^capacity_bytes"):
        HostTier(-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="^kv_cache_dir"):
        DiskTier(tmp_path / "file" / "kv", 1 << 20)


# ---- single tiers ----------------------------------------------------------------------------------------
def test_host_tier_round_trip() -> None:
    t = HostTier(10 * BLOB)
    blob = b"abc"
    assert t.put(key(1), blob) and t.get(key(1)) is blob and t.exists(key(1))  # kept as is: no copy
    assert t.put(key(1), b"abcd") and t.used_bytes == 4 and t.scan() == [(key(1), 4)]
    assert t.delete(key(1)) and not t.delete(key(1)) and t.get(key(1)) is None and t.used_bytes == 0


def test_disk_tier_round_trip_atomic_files_and_one_owner(tmp_path) -> None:
    t = DiskTier(tmp_path, 10 * BLOB)
    assert t.put(key(1), b"abc") and t.get(key(1)) == b"abc" and t.exists(key(1)) and t.used_bytes == 3
    path = t.path(key(1))
    assert path.parent.name == key(1).hex()[:2] and [p.name for p in path.parent.iterdir()] == [path.name]
    with pytest.raises(ValueError, match="^kv_cache_dir: .* in use by another process"):
        DiskTier(tmp_path, BLOB)
    t.close()
    again = DiskTier(tmp_path, 10 * BLOB)
    assert again.scan() == [(key(1), 3)] and again.get(key(1)) == b"abc"
    assert again.delete(key(1)) and not path.exists() and again.get(key(1)) is None and again.used_bytes == 0
    again.close()


# ---- the store -------------------------------------------------------------------------------------------
def test_host_lru_order_and_size_limit(tmp_path) -> None:
    with store(tmp_path, host_blobs=3) as s:
        fill(s, range(3))
        assert_hit(s, 0)  # 0 becomes the most recent: 1 is now the oldest
        fill(s, [3])
        assert s.get(key(1)) is None and not s.exists(key(1))
        for i in (0, 2, 3):
            assert_hit(s, i)
        host = s.stats().tier("host")
        assert (host.evictions, host.num_objects, host.used_bytes) == (1, 3, 3 * BLOB)
        assert (host.queried, host.hits, host.hit_tokens, host.stored) == (5, 4, 4 * 128, 4)
        fill(s, [3])  # already there: kept, not stored twice
        assert s.stats().tier("host").stored == 4


def test_host_eviction_spills_to_disk_and_disk_hits_come_back_up(tmp_path) -> None:
    with store(tmp_path, host_blobs=2, disk_blobs=10) as s:
        fill(s, range(5))
        s.flush()
        st = s.stats()
        assert (st.tier("host").num_objects, st.tier("disk").num_objects, st.spilled) == (2, 3, 3)
        assert st.pending_writes == 0 and st.write_drops == 0
        assert_hit(s, 0)  # from disk, copied up into host memory, which pushes 3 out to the disk
        st = s.stats()
        assert (st.tier("disk").hits, st.tier("host").hits, st.spilled) == (1, 0, 4)
        assert_hit(s, 0)
        assert s.stats().tier("host").hits == 1
        s.flush()
        assert s.stats().tier("disk").num_objects == 4  # 0 stays on disk when copied up
        for i in range(5):
            assert_hit(s, i)


def test_disk_only_store_writes_back_and_evicts_lru_files(tmp_path) -> None:
    with store(tmp_path, disk_blobs=3) as s:
        fill(s, range(5))
        s.flush()
        disk = s.stats().tier("disk")
        assert (disk.num_objects, disk.evictions, disk.stored, disk.used_bytes) == (3, 2, 5, 3 * BLOB)
        files = sorted(p.name for p in (tmp_path / "kv").rglob("*.kvb"))
        assert files == sorted(f"{key(i).hex()}.kvb" for i in (2, 3, 4))
        assert s.get(key(0)) is None
        assert_hit(s, 3)


def test_restart_finds_the_disk_tier_in_recency_order(tmp_path) -> None:
    with store(tmp_path, host_blobs=1, disk_blobs=4) as s:
        fill(s, range(4))
    # Older modification times than anything written from now on, oldest first: 0, 1, 2, 3.
    disk = DiskTier(tmp_path / "kv", 4 * BLOB)
    for i in range(4):
        os.utime(disk.path(key(i)), ns=(10**18 + i, 10**18 + i))
    disk.close()
    with store(tmp_path, host_blobs=1, disk_blobs=4) as s:
        assert s.stats().tier("disk").num_objects == 4
        assert_hit(s, 0)  # a read refreshes recency, on disk too: 1 is the oldest now
        s.flush()
    with store(tmp_path, disk_blobs=4) as s:
        fill(s, [9])
        s.flush()
        assert s.get(key(1)) is None
        for i in (0, 2, 3, 9):
            assert_hit(s, i)


def test_smaller_disk_limit_after_restart_evicts_at_start(tmp_path) -> None:
    with store(tmp_path, disk_blobs=4) as s:
        fill(s, range(4))
    with store(tmp_path, disk_blobs=2) as s:
        disk = s.stats().tier("disk")
        assert (disk.num_objects, disk.evictions) == (2, 2)
        assert len(list((tmp_path / "kv").rglob("*.kvb"))) == 2


def _corrupt(path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip_payload":
        data = data[:-10] + bytes([data[-10] ^ 0x10]) + data[-9:]
    elif how == "flip_header":
        data = data[:60] + bytes([data[60] ^ 1]) + data[61:]
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "magic":
        data = b"PK\x03\x04" + data[4:]
    elif how == "version":
        data = data[:4] + (2).to_bytes(2, "little") + data[6:]
    elif how == "zero_length":
        data = b""
    elif how == "appended":
        data = data + b"\0"
    path.write_bytes(data)


@pytest.mark.parametrize("how", ["flip_payload", "flip_header", "truncate", "magic", "version", "zero_length",
                                 "appended"])
def test_corrupt_file_is_a_miss_plus_deletion(tmp_path, how: str) -> None:
    with store(tmp_path, disk_blobs=4) as s:
        fill(s, range(2))
    with store(tmp_path, host_blobs=4, disk_blobs=4) as s:
        target = next((tmp_path / "kv").rglob(f"{key(0).hex()}.kvb"))
        _corrupt(target, how)
        assert s.get(key(0)) is None
        assert not target.exists() and not s.exists(key(0))
        disk = s.stats().tier("disk")
        assert (disk.checksum_failures, disk.hits, disk.num_objects) == (1, 0, 1)
        assert_hit(s, 1)  # the other object is untouched
        fill(s, [0])  # recomputed and stored again
        assert_hit(s, 0)


def test_object_from_another_configuration_is_a_miss_plus_deletion(tmp_path) -> None:
    with store(tmp_path, disk_blobs=4) as s:
        fill(s, range(2))
    other = StoreIdentity(b"o" * 32, 128)
    with TieredStore(other, None, DiskTier(tmp_path / "kv", 4 * BLOB)) as s:
        assert s.get(key(0)) is None
        assert s.stats().tier("disk").checksum_failures == 1
        assert not any(p.name.startswith(key(0).hex()) for p in (tmp_path / "kv").rglob("*.kvb"))


def test_leftover_temp_file_is_removed_at_start_and_counted(tmp_path) -> None:
    with store(tmp_path, disk_blobs=4) as s:
        fill(s, range(2))
    target = next((tmp_path / "kv").rglob(f"{key(0).hex()}.kvb"))
    torn = target.with_name(target.name + ".tmp-999-0")
    torn.write_bytes(target.read_bytes()[:100])
    target.unlink()  # the crash came before the rename
    (tmp_path / "kv" / "notes.txt").write_text("not ours")
    with store(tmp_path, disk_blobs=4) as s:
        assert not torn.exists() and (tmp_path / "kv" / "notes.txt").exists()
        disk = s.stats().tier("disk")
        assert (disk.checksum_failures, disk.num_objects) == (1, 1)
        assert s.get(key(0)) is None
        assert_hit(s, 1)


class _StalledDisk(DiskTier):
    """A disk tier whose writes wait for a signal, to fill the write-back queue deterministically."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, key: bytes, blob: bytes) -> bool:
        self.entered.set()
        assert self.release.wait(30)
        return super().put(key, blob)


def test_full_write_queue_drops_writes_and_queued_objects_stay_readable(tmp_path) -> None:
    disk = _StalledDisk(tmp_path / "kv", 10 * BLOB)
    with TieredStore(ID, None, disk, queue_depth=2) as s:
        fill(s, [0])
        assert disk.entered.wait(30)  # the writer holds object 0; the queue is empty again
        fill(s, [1, 2, 3])  # 1 and 2 fill the queue; 3 is dropped
        st = s.stats()
        assert (st.write_drops, st.pending_writes) == (1, 3)
        assert_hit(s, 1)  # served from the queue before its file exists
        assert s.get(key(3)) is None
        disk.release.set()
        s.flush()
        st = s.stats()
        assert (st.pending_writes, st.tier("disk").num_objects, st.tier("disk").hits) == (0, 3, 1)


def test_delete_while_queued_leaves_no_file(tmp_path) -> None:
    disk = _StalledDisk(tmp_path / "kv", 10 * BLOB)
    with TieredStore(ID, None, disk, queue_depth=4) as s:
        fill(s, [0, 1])
        assert disk.entered.wait(30)
        s.delete(key(0))  # in flight
        s.delete(key(1))  # queued
        disk.release.set()
        s.flush()
        assert not s.exists(key(0)) and not s.exists(key(1))
        assert list((tmp_path / "kv").rglob("*.kvb")) == []


def test_prefetch_warms_host_memory_from_disk(tmp_path) -> None:
    with store(tmp_path, host_blobs=2, disk_blobs=10) as s:
        fill(s, range(4))
        s.flush()
        assert s.prefetch([key(0), key(3), key(42)]) == 1  # 3 is in host memory, 42 nowhere
        s.flush()
        st = s.stats()
        assert st.prefetched == 1 and st.tier("disk").queried == 0
        assert_hit(s, 0)
        assert s.stats().tier("host").hits == 1


def test_concurrent_puts_and_gets_never_return_wrong_bytes(tmp_path) -> None:
    keys = range(120)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer(s: TieredStore) -> None:
        start.wait()
        for i in keys:
            s.put(key(i), "history", 128, payload(i))
            if i % 10 == 0:
                s.prefetch([key(j) for j in range(i // 2)])

    def reader(s: TieredStore) -> None:
        rng = random.Random(0)
        start.wait()
        for _ in range(600):
            i = rng.randrange(len(keys))
            got = s.get(key(i))
            if got is not None and got.payload != payload(i):
                errors.append(AssertionError(f"wrong bytes for {i}"))

    def guarded(fn, s):
        try:
            fn(s)
        except BaseException as e:  # surfaced below: an exception in a thread must fail the test
            errors.append(e)

    with store(tmp_path, host_blobs=8, disk_blobs=64, queue_depth=256) as s:
        threads = [threading.Thread(target=guarded, args=(fn, s)) for fn in (writer, reader)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.flush()
        assert not errors, errors
        st = s.stats()
        assert (st.pending_writes, st.write_drops, st.tier("disk").checksum_failures) == (0, 0, 0)
        assert st.tier("host").num_objects == 8 and st.tier("disk").num_objects == 64
        files = list((tmp_path / "kv").rglob("*.kvb"))
        assert len(files) == 64 and sum(f.stat().st_size for f in files) == st.tier("disk").used_bytes
        found = [s.get(key(i)) for i in keys]
        assert all(got is None or got.payload == payload(i) for i, got in zip(keys, found))
        assert sum(got is not None for got in found) >= 64


def test_delete_removes_every_copy(tmp_path) -> None:
    with store(tmp_path, host_blobs=1, disk_blobs=4) as s:
        fill(s, range(2))
        s.flush()
        assert_hit(s, 0)  # 0 in host and on disk
        s.delete(key(0))
        s.flush()
        assert not s.exists(key(0)) and s.get(key(0)) is None
        assert [p.name for p in (tmp_path / "kv").rglob("*.kvb")] == [f"{key(1).hex()}.kvb"]
