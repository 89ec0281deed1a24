"""Block hash chain: equal prefixes share hashes; a changed token, salt or namespace changes every hash from
that block on; extending a chain equals hashing from scratch."""

from __future__ import annotations

import random

import pytest

from deepinfer.assets import demo_model_dir
from deepinfer.config.model import ModelConfig
from deepinfer.kv.prefix_hash import HASH_BYTES, BlockHasher, CacheNamespace, model_fingerprint

BS = 128
NS = CacheNamespace(model_digest=b"m" * 32, block_size=BS, cache_dtype="bfloat16", kernels="cpu/ref")


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(129280) for _ in range(n)]


def test_same_prefix_same_chain_and_only_full_blocks() -> None:
    h = BlockHasher(NS)
    toks = _tokens(5 * BS + 17)
    chain = h.chain(toks)
    assert len(chain) == 5 and all(len(x) == HASH_BYTES for x in chain)
    assert len(set(chain)) == 5
    assert BlockHasher(NS).chain(toks) == chain  # stable across instances (no per-process randomness)
    assert h.chain(toks[:3 * BS + 5]) == chain[:3]  # a shorter prompt with the same prefix shares its blocks
    assert h.chain(toks[:BS - 1]) == ()


@pytest.mark.parametrize("pos", [0, BS - 1, BS, 3 * BS + 64])
def test_changed_token_changes_hashes_from_its_block_on(pos: int) -> None:
    h = BlockHasher(NS)
    toks = _tokens(5 * BS)
    other = list(toks)
    other[pos] = (other[pos] + 1) % 129280
    a, b = h.chain(toks), h.chain(other)
    first = pos // BS
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


def test_salts_and_none_are_all_distinct() -> None:
    h = BlockHasher(NS)
    toks = _tokens(3 * BS)
    chains = [h.chain(toks, salt) for salt in (None, "", "tenant-a", "tenant-b", "\0")]
    for i in range(3):
        assert len({c[i] for c in chains}) == len(chains)
    assert h.chain(toks, "tenant-a") == h.chain(toks, "tenant-a")
    with pytest.raises(ValueError, match="^cache_salt"):
        h.root(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("change", [
    {"model_digest": b"n" * 32}, {"block_size": 256}, {"cache_dtype": "float32"}, {"kernels": "cuda/triton"},
])
def test_namespace_changes_every_hash(change: dict) -> None:
    ns = CacheNamespace(**{"model_digest": NS.model_digest, "block_size": NS.block_size,
                           "cache_dtype": NS.cache_dtype, "kernels": NS.kernels, **change})
    toks = _tokens(4 * 256)
    a, b = BlockHasher(NS).chain(toks), BlockHasher(ns).chain(toks)
    assert not set(a) & set(b)


def test_incremental_extension_equals_from_scratch() -> None:
    h = BlockHasher(NS)
    toks = _tokens(9 * BS + 3, seed=1)
    chain: tuple[bytes, ...] = ()
    for n in (0, 5, BS, BS + 1, 4 * BS - 1, 4 * BS, 7 * BS + 100, len(toks)):
        chain = h.chain(toks[:n], "s", known=chain)
        assert chain == h.chain(toks[:n], "s")
    with pytest.raises(ValueError, match="^known"):
        h.chain(toks[:BS], "s", known=chain)


def test_bad_tokens_name_the_field() -> None:
    h = BlockHasher(NS)
    for bad in (-1, 1 << 32, 1.5):
        toks = _tokens(BS)
        toks[7] = bad
        with pytest.raises(ValueError, match="^token_ids"):
            h.chain(toks)
    with pytest.raises(ValueError, match="^block_size"):
        CacheNamespace(b"m", 0, "bfloat16")


def test_model_fingerprint_covers_config_and_weights(tmp_path) -> None:
    cfg = ModelConfig.from_model_dir(demo_model_dir())
    assert model_fingerprint(cfg) == model_fingerprint(cfg)
    assert model_fingerprint(cfg) != model_fingerprint(cfg.replace(rms_norm_eps=cfg.rms_norm_eps * 2))
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 4096)
    first = model_fingerprint(cfg, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 4095 + b"\2")
    assert model_fingerprint(cfg, tmp_path) not in (first, model_fingerprint(cfg))
