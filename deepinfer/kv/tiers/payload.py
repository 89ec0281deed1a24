"""One cache block of one pool as bytes, and back: the payload a tier stores for a block.

The payload of block ``b`` of pool ``p`` is, for every layer in layout order and every cache tensor of
that layer living in ``p`` (spec order), the block's rows ``[b * rows_per_block, (b + 1) * rows_per_block)``
as raw bytes. Rows are copied as bytes (uint8 views of the storage), never converted, so bf16 and fp32
values, NaN payloads included, come back bit for bit. Which layout and dtype produced the bytes is the
namespace's business (the config digest in every stored object's header), not the payload's.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.kv.spec import POOLS
from deepinfer.kv.storage import KVStorage


def _block_rows(storage: KVStorage, pool: str, block_id: int) -> list[torch.Tensor]:
    """The block's rows of every tensor of ``pool``, as [rows, width] views of the storage."""
    if pool not in POOLS:
        raise ValueError(f"pool: {pool!r} is not a cache pool; allowed: {', '.join(POOLS)}")
    n = storage.num_blocks[pool]
    if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < n:
        raise ValueError(f"block_id: must be an int in [0, {n}) for pool {pool!r}, got {block_id!r}")
    layout = storage.layout
    rows = []
    for spec in layout.layers:
        for t in spec.tensors:
            if t.pool == pool:
                per_block = layout.rows_per_block(t)
                rows.append(storage.get(spec.key, t.name)[block_id * per_block:(block_id + 1) * per_block])
    return rows


def payload_bytes(storage: KVStorage, pool: str) -> int:
    """Size of one block's payload of ``pool``."""
    return sum(r.numel() * r.element_size() for r in _block_rows(storage, pool, 0)) if storage.num_blocks[pool] else 0


def _block_major(storage: KVStorage, pool: str) -> list[torch.Tensor]:
    """Every tensor of ``pool`` as a [blocks (+ the spare), bytes per block] uint8 view: row ``b`` is block
    ``b``'s slice of that tensor, so one indexed read or write moves many blocks at once."""
    n = storage.num_blocks[pool] + 1
    return [storage.get(spec.key, t.name).view(torch.uint8).view(n, -1)
            for spec in storage.layout.layers for t in spec.tensors if t.pool == pool]


def _check_ids(storage: KVStorage, pool: str, block_ids: list[int]) -> None:
    if pool not in POOLS:
        raise ValueError(f"pool: {pool!r} is not a cache pool; allowed: {', '.join(POOLS)}")
    n = storage.num_blocks[pool]
    bad = [b for b in block_ids if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n]
    if bad:
        raise ValueError(f"block_id: must be an int in [0, {n}) for pool {pool!r}, got {bad[0]!r}")


def pack_many(storage: KVStorage, pool: str, block_ids: list[int]) -> torch.Tensor:
    """The payloads of ``block_ids`` as the rows of one host tensor [len(block_ids), payload bytes], each row
    equal to ``pack`` of that block (one gather on the device and one copy to host memory for the batch)."""
    rows = gather(storage, pool, block_ids)
    if rows.device.type == "cpu":
        return rows
    host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(rows)
    return host


def gather(storage: KVStorage, pool: str, block_ids: list[int]) -> torch.Tensor:
    """The payloads of ``block_ids`` as the rows of one new tensor [len(block_ids), payload bytes] on the
    storage's device: one indexed read per tensor of the pool, queued on the current stream. A copy, so
    the blocks may be overwritten as soon as this is queued (the tier link copies it to the host later)."""
    _check_ids(storage, pool, block_ids)
    parts = _block_major(storage, pool)
    if not parts or not block_ids:
        return torch.empty(len(block_ids), 0, dtype=torch.uint8)
    if parts[0].device.type == "cpu":  # row slices are plain memory copies here; indexed uint8 gathers are far slower
        out = torch.empty(len(block_ids), sum(t.shape[1] for t in parts), dtype=torch.uint8)
        for i, b in enumerate(block_ids):
            pack_into(parts, b, out[i].numpy())
        return out
    return torch.cat([t[_index(block_ids, parts[0].device)] for t in parts], dim=1)


def block_major(storage: KVStorage, pool: str) -> list[torch.Tensor]:
    """``pool``'s tensors as [blocks, bytes per block] uint8 views, for ``pack_into`` (checked pool)."""
    _check_ids(storage, pool, [])
    return _block_major(storage, pool)


def pack_into(parts: list[torch.Tensor], block_id: int, out: np.ndarray) -> None:
    """Copy block ``block_id``'s payload (CPU storage, ``block_major`` views) into ``out`` (its bytes):
    one copy per tensor, straight into the destination (a stored object's payload)."""
    offset = 0
    for t in parts:
        width = t.shape[1]
        out[offset:offset + width] = t[block_id].numpy()
        offset += width


def unpack_many(payloads: list[bytes | bytearray | memoryview], storage: KVStorage, pool: str,
                block_ids: list[int], staged: torch.Tensor | None = None) -> None:
    """Write payloads (``pack`` format) into ``block_ids``. On a device the payloads are staged in host
    memory (``staged``: [len(payloads) * payload bytes] uint8, pinned for a fast copy, that the caller keeps
    untouched until the copy is done; a new tensor without it), copied to the device with one copy queued on
    the current stream (the step that reads them comes after it), then one indexed write per tensor:
    ``stage`` then ``upload``, which a caller timing the device work calls itself."""
    _check_ids(storage, pool, block_ids)
    parts = _block_major(storage, pool)
    width = sum(t.shape[1] for t in parts)
    _check_payloads(payloads, block_ids, pool, width)
    if not parts or not block_ids:
        return
    if parts[0].device.type == "cpu":  # straight from the payload into the block's row slices: one copy
        for data, b in zip(payloads, block_ids):
            src = np.frombuffer(data, dtype=np.uint8)
            offset = 0
            for t in parts:
                t[b].numpy()[:] = src[offset:offset + t.shape[1]]
                offset += t.shape[1]
        return
    if staged is None:
        staged = torch.empty(len(payloads) * width, dtype=torch.uint8, pin_memory=True)
    upload(stage(payloads, staged, width), parts, block_ids)


def _check_payloads(payloads, block_ids: list[int], pool: str, width: int) -> None:
    for data in payloads:
        if len(data) != width:
            raise ValueError(f"payload: {len(data)} bytes, but a block of pool {pool!r} holds {width}")
    if len(payloads) != len(block_ids):
        raise ValueError(f"payloads: {len(payloads)} for {len(block_ids)} blocks")


def stage(payloads: list[bytes | bytearray | memoryview], staged: torch.Tensor, width: int) -> torch.Tensor:
    """The host half of a device load: the payloads (each ``width`` bytes) copied into the leading rows of
    ``staged`` (host memory, uint8), returned as [len(payloads), width]. One numpy copy per payload, with the
    GIL released."""
    rows = staged[:len(payloads) * width].view(len(payloads), width)
    host = rows.numpy()
    for i, data in enumerate(payloads):
        if len(data) != width:
            raise ValueError(f"payload: {len(data)} bytes, but a block of this pool holds {width}")
        host[i] = np.frombuffer(data, dtype=np.uint8)
    return rows


def upload(rows: torch.Tensor, parts: list[torch.Tensor], block_ids: list[int]) -> None:
    """The device half of a load: staged ``rows`` (one payload each, pinned) copied to the device with one copy
    queued on the current stream, then written into ``block_ids`` of the pool's ``block_major`` views with one
    indexed write per tensor. Nothing waits: the caller keeps ``rows`` untouched until the stream is past it."""
    dev = parts[0].device
    src = rows.to(dev, non_blocking=True)  # pinned: ordered on the stream before the step that reads it
    idx = _index(block_ids, dev)
    offset = 0
    for t in parts:
        t[idx] = src[:, offset:offset + t.shape[1]]
        offset += t.shape[1]


def _index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as a device index, copied without blocking: a pageable copy would wait for the stream (the
    step still running on the device) before the host could queue anything else."""
    idx = torch.tensor(block_ids, dtype=torch.int64)
    return idx if device.type == "cpu" else idx.pin_memory().to(device, non_blocking=True)


def pack(storage: KVStorage, pool: str, block_id: int) -> bytes:
    """Block ``block_id`` of ``pool`` as bytes (one device-to-host copy when the storage is on a device)."""
    parts = [r.view(torch.uint8).reshape(-1) for r in _block_rows(storage, pool, block_id)]
    if not parts:
        return b""
    return torch.cat(parts).cpu().numpy().tobytes()


def unpack(data: bytes | bytearray | memoryview, storage: KVStorage, pool: str, block_id: int) -> None:
    """Write a payload made by ``pack`` (of a storage with the same layout and dtype) into ``block_id``."""
    rows = _block_rows(storage, pool, block_id)
    dst = [r.view(torch.uint8) for r in rows]  # [rows, width * element size]: same bytes, no conversion
    expected = sum(d.numel() for d in dst)
    if len(data) != expected:
        raise ValueError(f"payload: {len(data)} bytes, but a block of pool {pool!r} holds {expected}")
    if not dst:
        return
    # bytearray: torch.frombuffer wants a writable buffer (a read-only one warns), and it is one copy.
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dst[0].device)
    offset = 0
    for d in dst:
        d.copy_(src[offset:offset + d.numel()].view_as(d))
        offset += d.numel()
