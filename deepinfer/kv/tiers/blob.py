"""The self-describing byte format of one stored cache object: a fixed header, then the payload.

    magic "DIKV" | format version | header length | config digest | key digest | kind | block size |
    token count | payload length | SHA-256 over everything before it and the payload

Tiers store these blobs as opaque bytes. Reading one back checks every field against what the reader
expects (its config digest and block size, the key it asked for) and the checksum against the bytes, so a
file from another configuration, a file renamed onto another key, a torn or truncated write and a flipped
bit all fail the same way: ``BlobError``, which the tiered store turns into a miss plus deletion. No
pickle: nothing in a blob is ever executed or turned into objects beyond these integers and bytes.

A blob is ``bytes`` or a read-only one-dimensional uint8 numpy array (``build``): the store builds the objects
of saved blocks as arrays because numpy copies with the GIL released, while ``bytes.join`` over parts that are
not ``bytes`` (staging rows, storage rows) holds it for the whole copy -- about 1 ms per MiB with the page
faults of fresh memory, which the write-back thread would take from the engine's thread at every kernel launch.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"DIKV"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sHH32s32s16sIIQ")  # everything up to the checksum
HEADER_BYTES = _HEAD.size + 32
_UNSEALED = bytes(32)  # the checksum field of a blob that has not left host memory
MAX_KEY_BYTES = 64
_KINDS_MAX = 16


class BlobError(ValueError):
    """A stored object that must not be used (wrong format, wrong config, torn, corrupted)."""


@dataclass(frozen=True, slots=True)
class StoreIdentity:
    """What every object of one store must match: written into each header, checked on each read."""

    config_digest: bytes  # CacheNamespace.digest(): model, checkpoint, block size, cache dtype, kernels
    block_size: int

    def __post_init__(self) -> None:
        if len(self.config_digest) != 32:
            raise ValueError(f"config_digest: must be 32 bytes, got {len(self.config_digest)}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class StoredBlock:
    kind: str  # which pool's bytes (history, window, state) or a caller's tag
    num_tokens: int  # positions the payload covers
    payload: memoryview  # read-only view into the blob (no copy)


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key: must be 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")


def encode(identity: StoreIdentity, key: bytes, kind: str, num_tokens: int, payload, sealed: bool = True) -> bytes:
    """The blob of one object. ``sealed=False`` leaves the checksum field zero: for objects that start in
    host memory, where it is never read (``verify_payload=False``) and hashing every saved block would
    cost more than the copy; ``seal`` fills it in before the blob leaves memory (the disk writer does).
    ``payload``: a bytes-like object, or a list of them that together make the payload (a block's rows of
    each cache tensor): joined straight into the blob, each byte copied once."""
    parts = payload if isinstance(payload, list) else [payload]
    head = _head(identity, key, kind, num_tokens, sum(memoryview(p).nbytes for p in parts))
    return b"".join([head, _checksum(head, *parts) if sealed else _UNSEALED, *parts])


def build(identity: StoreIdentity, key: bytes, kind: str, num_tokens: int, payload) -> np.ndarray:
    """The unsealed blob of one object (``encode(..., sealed=False)``'s bytes) as a new read-only uint8 array,
    each payload byte copied once by numpy, outside the GIL (see the module docstring)."""
    parts = payload if isinstance(payload, list) else [payload]
    head = _head(identity, key, kind, num_tokens, sum(memoryview(p).nbytes for p in parts))
    return _joined([head, _UNSEALED, *parts])


def _joined(parts: list) -> np.ndarray:
    """The bytes-like ``parts`` one after another in a new read-only uint8 array (numpy copies: no GIL held)."""
    views = [np.frombuffer(p, dtype=np.uint8) for p in parts]
    out = np.empty(sum(v.size for v in views), dtype=np.uint8)
    offset = 0
    for v in views:
        out[offset:offset + v.size] = v
        offset += v.size
    out.flags.writeable = False
    return out


def _head(identity: StoreIdentity, key: bytes, kind: str, num_tokens: int, payload_len: int) -> bytes:
    check_key(key)
    raw_kind = kind.encode("ascii")
    if not 0 < len(raw_kind) <= _KINDS_MAX:
        raise ValueError(f"kind: must be 1..{_KINDS_MAX} ASCII characters, got {kind!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
    return _HEAD.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, identity.config_digest, hashlib.sha256(key).digest(),
                      raw_kind, identity.block_size, num_tokens, payload_len)


def seal(blob):
    """``blob`` with its checksum filled in (the same object when it already is; a new one of the same type,
    ``bytes`` or array, otherwise). An unsealed blob that reaches a disk unsealed fails every checked read
    there: a zero field never equals a SHA-256."""
    view = memoryview(blob)
    if view.nbytes < HEADER_BYTES or view[_HEAD.size:HEADER_BYTES] != _UNSEALED:
        return blob
    parts = [view[:_HEAD.size], _checksum(view[:_HEAD.size], view[HEADER_BYTES:]), view[HEADER_BYTES:]]
    return _joined(parts) if isinstance(blob, np.ndarray) else b"".join(parts)


def decode(identity: StoreIdentity, key: bytes, blob, verify_payload: bool = True) -> StoredBlock:
    """The object in ``blob`` if it is intact and belongs to ``key`` under ``identity``; else BlobError.

    ``verify_payload=False`` skips the payload checksum (not the header checks) for blobs that never left
    this process's memory, where hashing every read would cost more than it could catch.
    """
    if len(blob) < HEADER_BYTES:
        raise BlobError(f"truncated header ({len(blob)} bytes)")
    magic, version, header_len, config, key_digest, raw_kind, block_size, num_tokens, length = \
        _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise BlobError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION or header_len != HEADER_BYTES:
        raise BlobError(f"format version {version} (header {header_len} B), expected {FORMAT_VERSION}")
    if config != identity.config_digest:
        raise BlobError("written under another configuration")
    if block_size != identity.block_size:
        raise BlobError(f"block size {block_size}, expected {identity.block_size}")
    if key_digest != hashlib.sha256(key).digest():
        raise BlobError("stored under another key")
    if len(blob) != HEADER_BYTES + length:
        raise BlobError(f"{len(blob) - HEADER_BYTES} payload bytes, header says {length}")
    view = memoryview(blob)
    payload = view[HEADER_BYTES:]
    if verify_payload and _checksum(view[:_HEAD.size], payload) != bytes(view[_HEAD.size:HEADER_BYTES]):
        raise BlobError("checksum mismatch")
    try:
        kind = raw_kind.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise BlobError("kind is not ASCII") from None
    return StoredBlock(kind, num_tokens, payload)


def _checksum(head, *payload) -> bytes:
    h = hashlib.sha256(head)
    for part in payload:
        h.update(part)
    return h.digest()
