"""Counter-based sampling noise: a pure function of (seed, position, vocab id, salt).

Why not ``torch.Generator``: a generator shared by the batch hands out random numbers in row order, so a
request's sample would depend on which other requests share the step and in which order
(determinism.md §2.7). Here every random number is a hash of its own coordinates instead.

The contract (a Triton kernel must reproduce it bit for bit):

    h = MurmurHash3_x86_32(le32(seed & 0xffffffff), le32(seed >> 32), le32(position), le32(vocab_id);
                           murmur seed = salt)                          # 16-byte key, 32-bit result
    u = (h + 0.5) / 2**32                                               # float64, strictly inside (0, 1)
    g = -log(-log(u))                                                   # standard Gumbel, float64
    token = argmax_v(scores[v] + g[v])                                  # first (lowest) id wins a tie

``scores`` are the processed logits (temperature-scaled, masked with -inf); adding the per-row constant
that turns them into log-probabilities does not change the argmax, so it is skipped (one reduction fewer).
The noise is keyed by the vocabulary *id*, never by a position in a sorted or filtered list, so top-k /
top-p masks cannot shift which noise value a token receives. ``position`` is the absolute sequence
position of the token being sampled. The hash only has 32 bits, so the noise is bounded to about
[-3.1, 22.9]: tokens more than ~26 nats below the best kept token can never be drawn (probability < 1e-11).

All arithmetic is done on non-negative int64 values below 2**49, so nothing overflows and every right shift
is logical: 32x32-bit products are split into 16-bit halves instead of relying on int64 wrap-around.
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF
SALT_TARGET = 0
# Noise stream for speculative drafts (vLLM uses the same offset): a draft and its verification at the same
# position must never share a noise vector, or acceptance would be biased.
SALT_DRAFT = 1 << 30
MAX_POSITION = 2**32  # the position is hashed as one 32-bit word

_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
_N = 0xE6546B64
_KEY_BYTES = 16


def derive_seed(request_id: str) -> int:
    """Seed for a request that did not give one: stable across processes and Python versions.

    Uses SHA-256, not ``hash()`` (salted per process by PYTHONHASHSEED), so a replayed request id gets the
    same seed anywhere. Returned in [0, 2**63) so it fits ``SamplingParams.seq_seed``.
    """
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {request_id!r}")
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def child_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th sample of an ``n > 1`` request; index 0 keeps ``seed`` itself.

    Children of one request would otherwise share (seed, position) and produce identical outputs.
    """
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x, c < 2**32 without int64 overflow: split c into 16-bit halves.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & MASK32) | (x >> (32 - r))


def _scramble(k: torch.Tensor) -> torch.Tensor:
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _absorb(h: torch.Tensor, k_scrambled: torch.Tensor) -> torch.Tensor:
    h = _rotl32(h ^ k_scrambled, 13)
    return (h * 5 + _N) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _F1)
    h = h ^ (h >> 13)
    h = _mul32(h, _F2)
    return h ^ (h >> 16)


def murmur3_32(words: list[torch.Tensor], seed: int) -> torch.Tensor:
    """MurmurHash3_x86_32 of the little-endian 32-bit ``words`` (broadcast together), ``seed`` in [0, 2**32)."""
    h = torch.full((), seed & MASK32, dtype=torch.int64, device=words[0].device)
    for w in words:
        h = _absorb(h, _scramble(w.to(torch.int64) & MASK32))
    return _fmix32(h ^ (4 * len(words)))


Salt = int | torch.Tensor  # one salt for all rows, or an int64 [B] tensor of per-row salts


def _salt_rows(seeds: torch.Tensor, positions: torch.Tensor, salt: Salt) -> torch.Tensor:
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError("seeds and positions must be int64 tensors")
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(f"seeds and positions must be 1-D of equal length, got {tuple(seeds.shape)} and {tuple(positions.shape)}")
    if isinstance(salt, torch.Tensor):
        if salt.shape != seeds.shape:
            raise ValueError(f"per-row salt must have shape {tuple(seeds.shape)}, got {tuple(salt.shape)}")
        return salt.to(device=seeds.device, dtype=torch.int64) & MASK32
    if not 0 <= salt <= MASK32:
        raise ValueError(f"salt must be in [0, 2**32), got {salt}")
    return torch.full_like(seeds, salt)


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, salt: Salt = SALT_TARGET) -> torch.Tensor:
    """[B, V] int64 hash values in [0, 2**32) for rows (seed, position) and columns 0..V-1.

    The murmur state after (seed lo, seed hi, position) depends on the row only and the scrambled vocab
    word on the column only; only the last mixing round is done per element.
    """
    h = _salt_rows(seeds, positions, salt)
    # Values are not range-checked here (that would cost a device sync per step): seeds are >= 0 by
    # SamplingParams / SamplingRow, so `>> 32` is logical, and rows check 0 <= position < 2**32.
    for word in (seeds & MASK32, seeds >> 32, positions):
        h = _absorb(h, _scramble(word))
    vocab = _scramble(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device))
    h = _absorb(h[:, None], vocab[None, :])
    return _fmix32(h ^ _KEY_BYTES)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, salt: Salt = SALT_TARGET) -> torch.Tensor:
    """[B, V] float64 uniforms strictly inside (0, 1): ``(h + 0.5) / 2**32``."""
    bits = random_bits(seeds, positions, vocab_size, salt)
    return (bits.to(torch.float64) + 0.5) * (1.0 / 2**32)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, salt: Salt = SALT_TARGET) -> torch.Tensor:
    """[B, V] float64 standard Gumbel noise ``-log(-log(u))``."""
    u = uniform_noise(seeds, positions, vocab_size, salt)
    return -torch.log(-torch.log(u))


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: Salt = SALT_TARGET) -> torch.Tensor:
    """Sample one token per row from ``softmax(scores)``: ``argmax(scores + Gumbel)``, [B] int64.

    ``scores`` is [B, V] (any float dtype; masked entries -inf). Row b depends only on
    (scores[b], seeds[b], positions[b], salt) -- never on the other rows.
    """
    if scores.dim() != 2 or scores.shape[0] != seeds.shape[0]:
        raise ValueError(f"scores must be [B, V] with B == len(seeds), got {tuple(scores.shape)}")
    noise = gumbel_noise(seeds, positions, scores.shape[1], salt)
    # float64 keeps the sum exact enough that the noise, not rounding, decides close calls.
    return torch.argmax(scores.to(torch.float64) + noise, dim=-1)
