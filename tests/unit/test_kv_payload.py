"""One pool block as bytes and back, bit for bit, on the demo model's cache layout (every pool, bf16 and
fp32, arbitrary bit patterns including NaNs), and through a disk tier across a restart."""

from __future__ import annotations

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.config.model import ModelConfig
from deepinfer.kv.spec import POOLS, build_layout
from deepinfer.kv.storage import KVStorage
from deepinfer.kv.tiers import (DiskTier, StoreIdentity, TieredStore, pack, pack_many, payload_bytes, unpack,
                                unpack_many)

BLOCKS = {p: 3 for p in POOLS}


def _layout():
    return build_layout(ModelConfig.from_model_dir(demo_model_dir()), block_size=128)


def _random_bits(storage: KVStorage, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in storage.tensors.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _bits(storage: KVStorage, pool: str, block_id: int) -> list[torch.Tensor]:
    out = []
    for spec in storage.layout.layers:
        for t in spec.tensors:
            if t.pool == pool:
                per = storage.layout.rows_per_block(t)
                out.append(storage.get(spec.key, t.name)[block_id * per:(block_id + 1) * per].view(torch.uint8).clone())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pool", POOLS)
def test_pack_unpack_is_bit_exact(dtype: torch.dtype, pool: str) -> None:
    layout = _layout()
    src, dst = KVStorage(layout, BLOCKS, dtype), KVStorage(layout, BLOCKS, dtype)
    _random_bits(src, seed=1)
    data = pack(src, pool, 1)
    assert len(data) == payload_bytes(src, pool) == layout.bytes_per_block(pool, torch.finfo(dtype).bits // 8)
    unpack(data, dst, pool, 2)
    assert all(torch.equal(a, b) for a, b in zip(_bits(src, pool, 1), _bits(dst, pool, 2)))
    assert pack(dst, pool, 2) == data
    for other in (0, 1):  # nothing else written, the spare block included
        assert all(not b.any() for b in _bits(dst, pool, other))
    for p in POOLS:
        if p != pool:
            assert all(not t.view(torch.uint8).any() for (key, name), t in dst.tensors.items()
                       if layout.layer(key).tensor(name).pool == p)


@pytest.mark.parametrize("pool", POOLS)
def test_batched_pack_and_unpack_equal_the_one_block_forms(pool: str) -> None:
    layout = _layout()
    blocks = {p: 6 for p in POOLS}
    src, dst = KVStorage(layout, blocks, torch.bfloat16), KVStorage(layout, blocks, torch.bfloat16)
    _random_bits(src, seed=3)
    ids = [4, 0, 5, 2]
    rows = pack_many(src, pool, ids)
    assert [bytes(r.numpy()) for r in rows] == [pack(src, pool, b) for b in ids]
    targets = [1, 3, 0, 5]
    unpack_many([r.numpy() for r in rows], dst, pool, targets)
    for s_id, d_id in zip(ids, targets):
        assert all(torch.equal(a, b) for a, b in zip(_bits(src, pool, s_id), _bits(dst, pool, d_id)))
    assert all(not b.any() for b in _bits(dst, pool, 2)) and all(not b.any() for b in _bits(dst, pool, 4))
    with pytest.raises(ValueError, match="^block_id"):
        pack_many(src, pool, [6])
    with pytest.raises(ValueError, match="^payload"):
        unpack_many([b"x"], dst, pool, [0])


def test_errors_name_the_field() -> None:
    storage = KVStorage(_layout(), BLOCKS, torch.bfloat16)
    with pytest.raises(ValueError, match="^pool"):
        pack(storage, "gpu", 0)
    with pytest.raises(ValueError, match="^block_id"):
        pack(storage, "window", 3)  # the spare block is never a sequence's
    with pytest.raises(ValueError, match="^payload"):
        unpack(pack(storage, "window", 0)[:-2], storage, "window", 1)


def test_block_survives_a_disk_tier_and_a_restart(tmp_path) -> None:
    layout = _layout()
    src = KVStorage(layout, BLOCKS, torch.bfloat16)
    _random_bits(src, seed=2)
    ident = StoreIdentity(b"n" * 32, layout.block_size)
    cap = 4 * sum(payload_bytes(src, p) for p in POOLS)
    with TieredStore(ident, None, DiskTier(tmp_path, cap)) as s:
        for pool in POOLS:
            s.put(pool.encode() + b"/0", pool, layout.block_size, pack(src, pool, 0))
    dst = KVStorage(layout, BLOCKS, torch.bfloat16)
    with TieredStore(ident, None, DiskTier(tmp_path, cap)) as s:
        for pool in POOLS:
            got = s.get(pool.encode() + b"/0")
            assert got is not None and got.kind == pool
            unpack(got.payload, dst, pool, 1)
            assert all(torch.equal(a, b) for a, b in zip(_bits(src, pool, 0), _bits(dst, pool, 1)))
