"""One cache block of one pool as bytes, and back: the payload a tier stores for a block.

The payload of block ``b`` of pool ``p`` is, for every layer in layout order and every cache tensor of
that layer living in ``p`` (spec order), the block's rows ``[b * rows_per_block, (b + 1) * rows_per_block)``
as raw bytes. Rows are copied as bytes (uint8 views of the storage), never converted, so bf16 and fp32
values, NaN payloads included, come back bit for bit. Which layout and dtype produced the bytes is the
namespace's business (the config digest in every stored object's header), not the payload's.
"""

from __future__ import annotations

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
