"""Content addresses of cache blocks: a hash chain over full blocks of token ids.

Block i of a sequence is addressed by ``H(hash of block i-1, token ids of block i)`` and block 0 by
``H(root, token ids of block 0)``, so one hash names the whole prefix up to the end of its block: the
history-pool rows of a block depend on every earlier token (a causal model), never on the block alone.
All pools share the chain and the engine's one block size, so a hit is usable at every block boundary.

The root binds the chain to a namespace (the model and checkpoint, the block size, the cache dtype and
whatever computed the rows) and to the request's ``cache_salt``: blocks computed for another model, another
geometry or another tenant can never be found. SHA-256 (hashlib, no extra dependency) rather than
Python's ``hash()``: that one is randomized per process, and a disk tier outlives the process; a
cryptographic digest also keeps a tenant from crafting a collision with another tenant's prefix.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepinfer.config.model import ModelConfig

HASH_BYTES = 32
# Bumped whenever what a block hash covers changes, so old disk tiers stop matching instead of lying.
CHAIN_VERSION = 1
_MAX_TOKEN = (1 << 32) - 1
_SAMPLE_BYTES = 1 << 20  # bytes read from each end of a weight file for the checkpoint fingerprint


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Everything besides the tokens that decides the bytes of a cached block."""

    model_digest: bytes  # model_fingerprint(): config plus checkpoint files
    block_size: int
    cache_dtype: str  # e.g. "bfloat16": rows of one dtype are not rows of another
    kernels: str = ""  # what computed the rows (e.g. "cuda/triton"): other kernels round differently

    def __post_init__(self) -> None:
        if not isinstance(self.model_digest, bytes) or not self.model_digest:
            raise ValueError("model_digest: must be non-empty bytes")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: must be a positive integer, got {self.block_size!r}")

    def digest(self) -> bytes:
        h = hashlib.sha256(b"deepinfer.kv.namespace\0")
        h.update(struct.pack("<II", CHAIN_VERSION, self.block_size))
        for part in (self.model_digest, self.cache_dtype.encode(), self.kernels.encode()):
            h.update(struct.pack("<I", len(part)))  # length-prefixed: no two field splits hash alike
            h.update(part)
        return h.digest()


def model_fingerprint(config: ModelConfig, model_dir: str | Path | None = None) -> bytes:
    """Digest of the model config and, when a directory is given, of its weight files.

    Hashing every weight byte of a large checkpoint would take minutes, so each ``*.safetensors`` file
    contributes its name, its size and its first and last MiB (the header with every tensor's name, shape
    and offset, and weight bytes): a fine-tune of the same shape differs there.
    """
    h = hashlib.sha256(b"deepinfer.kv.model\0")
    h.update(json.dumps(config.to_native_dict(), sort_keys=True, default=str).encode())
    if model_dir is not None:
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            size = path.stat().st_size
            h.update(f"\0{path.name}\0{size}\0".encode())
            with open(path, "rb") as f:
                h.update(f.read(_SAMPLE_BYTES))
                f.seek(max(size - _SAMPLE_BYTES, 0))
                h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


class BlockHasher:
    """Hash chains of one namespace: ``BlockHasher(ns).chain(token_ids, salt)``.

    Only full blocks are hashed (a partial block is still being written). ``chain(..., known=prev)`` extends
    a chain computed earlier for a prefix of the same tokens, hashing only the blocks that are new.
    """

    def __init__(self, namespace: CacheNamespace) -> None:
        self.namespace = namespace
        self.block_size = namespace.block_size
        self._namespace_digest = namespace.digest()

    def root(self, salt: str | None = None) -> bytes:
        """The parent of block 0. ``None`` (no salt) and every string, ``""`` included, give distinct roots."""
        h = hashlib.sha256(b"deepinfer.kv.root\0")
        h.update(self._namespace_digest)
        if salt is None:
            h.update(b"\0")
        elif isinstance(salt, str):
            raw = salt.encode("utf-8")
            h.update(b"\1" + struct.pack("<Q", len(raw)) + raw)
        else:
            raise ValueError(f"cache_salt: must be a string or None, got {type(salt).__name__}")
        return h.digest()

    def block_hash(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        if len(block_tokens) != self.block_size:
            raise ValueError(f"token_ids: a block holds {self.block_size} tokens, got {len(block_tokens)}")
        try:
            packed = struct.pack(f"<{self.block_size}I", *block_tokens)
        except struct.error:
            bad = next((t for t in block_tokens if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN), None)
            raise ValueError(f"token_ids: must be ints in [0, 2**32), got {bad!r}") from None
        return hashlib.sha256(parent + packed).digest()

    def chain(self, token_ids: Sequence[int], salt: str | None = None,
              known: tuple[bytes, ...] = ()) -> tuple[bytes, ...]:
        """Hashes of every full block of ``token_ids``; the first ``len(known)`` are taken from ``known``,
        which must be this chain's prefix (same salt, same leading tokens) — the caller's promise."""
        full = len(token_ids) // self.block_size
        if len(known) > full:
            raise ValueError(f"known: {len(known)} hashes for {full} full blocks of token_ids")
        hashes = list(known)
        parent = hashes[-1] if hashes else self.root(salt)
        bs = self.block_size
        for i in range(len(hashes), full):
            parent = self.block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return tuple(hashes)
