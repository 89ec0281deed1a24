"""Engram n-gram memory (spec §2.2): hashed 2..n-gram lookups into a large table, injected into the
residual streams before some layers through a per-stream gate.

The hash sees *compressed* token ids: the tokenizer's vocabulary normalised (NFKC, NFD, strip accents,
lower-case, whitespace runs to one space, strip), ids numbered by first appearance. The tokenizer is
therefore part of the model: the map must have exactly ``engram_compressed_vocab_size`` ids, otherwise
every multiplier and bucket would differ from the trained tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepinfer.config.v41 import V41Config
from deepinfer.model.linear import Linear
from deepinfer.model.v41.engram_table import DenseTable, FP8Table
from deepinfer.ops.table import REF, OpTable

_SENTINEL = "\ue000"


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),  # a lone space survives Strip as itself
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def compressed_token_map(tokenizer) -> tuple[tuple[int, ...], int]:
    """A ``tokenizers.Tokenizer`` (the raw Rust one) -> (compressed id per token id, number of compressed ids).

    Each id is decoded alone without cleanup; a decode holding U+FFFD (a byte fragment) keys on the raw
    token string instead, so distinct fragments stay distinct."""
    norm = _normalizer()
    keys: dict[str, int] = {}
    out = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out.append(keys.setdefault(key, len(keys)))
    return tuple(out), len(keys)


def _is_prime(n: int) -> bool:
    return n >= 2 and (n == 2 or (n % 2 == 1 and all(n % d for d in range(3, math.isqrt(n) + 1, 2))))


def _next_prime(start: int, seen: set[int]) -> int:
    n = start + 1
    while not (_is_prime(n) and n not in seen):
        n += 1
    return n


@dataclass(frozen=True)
class EngramHashPlan:
    """Per Engram layer: the bucket primes and row offsets of its hash columns ([2-gram h0.., 3-gram h0.., ...])
    and the odd multipliers of its lookback shifts."""

    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]


def hash_plan(cfg: V41Config) -> EngramHashPlan:
    """Primes are taken in order over (layer, n-gram order, head) from ``engram_vocab_size`` up, never reused;
    multipliers come from numpy's PCG64 seeded 10007 * layer id, odd and small enough that no product with a
    compressed id overflows int64."""
    seen: set[int] = set()
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    primes, offsets, mults = [], [], []
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        layer_primes = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            current = cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current = _next_prime(current, seen)
                seen.add(current)
                layer_primes.append(current)
        if sum(layer_primes) > rows:
            raise ValueError(f"engram_num_embeddings: layer {layer} needs {sum(layer_primes)} rows for its hash "
                             f"buckets, the config gives {rows}")
        primes.append(tuple(layer_primes))
        offsets.append(tuple(int(v) for v in np.cumsum([0, *layer_primes[:-1]])))
        rng = np.random.default_rng(10007 * layer)
        values = rng.integers(0, bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
        mults.append(tuple(int(v) for v in values * 2 + 1))
    return EngramHashPlan(tuple(primes), tuple(offsets), tuple(mults))


class EngramHasher(nn.Module):
    """Table rows of every Engram layer for a chunk of positions, from the sequence's token history."""

    # The hash (``ops.v41_engram_hash``, ``ops/ref/engram_v41.hash_rows``): the device build sets its table's.
    ops: OpTable = REF

    def __init__(self, cfg: V41Config, token_map: tuple[int, ...], compressed_size: int) -> None:
        super().__init__()
        if compressed_size != cfg.engram_compressed_vocab_size:
            raise ValueError(f"engram_compressed_vocab_size: the tokenizer's normalised vocabulary has "
                             f"{compressed_size} ids, the config says {cfg.engram_compressed_vocab_size} (the hash "
                             "multipliers depend on it: wrong tokenizer?)")
        if cfg.engram_pad_token_id >= len(token_map):
            raise ValueError(f"engram_pad_token_id: {cfg.engram_pad_token_id} is outside the tokenizer's "
                             f"{len(token_map)} ids")
        plan = hash_plan(cfg)
        self.max_ngram = cfg.engram_max_ngram_size
        self.heads = cfg.engram_n_heads
        self.pad_id = token_map[cfg.engram_pad_token_id]
        self.register_buffer("token_map", torch.tensor(token_map, dtype=torch.long), persistent=False)
        self.register_buffer("primes", torch.tensor(plan.primes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(plan.offsets, dtype=torch.long), persistent=False)
        self.register_buffer("multipliers", torch.tensor(plan.multipliers, dtype=torch.long), persistent=False)

    def forward(self, history: torch.Tensor, start: int) -> torch.Tensor:
        """history [L] (the sequence's token ids up to the chunk's end), chunk = positions [start, L) ->
        rows [L - start, engram layers, hash heads]. Lookback before position 0 is the pad id, and once a
        shift is blocked every longer shift is too."""
        if history.numel() and (int(history.min()) < 0 or int(history.max()) >= self.token_map.numel()):
            raise ValueError(f"input_ids: token ids must lie in [0, {self.token_map.numel()}) for Engram hashing")
        positions = torch.arange(start, history.numel(), device=history.device)
        src = positions.unsqueeze(-1) - torch.arange(self.max_ngram, device=history.device)
        return self.rows_from_lookback(torch.where(src < 0, -1, history.long()[src.clamp_min(0)]))

    def rows_from_lookback(self, lookback: torch.Tensor) -> torch.Tensor:
        """lookback [Q, max n-gram] (the token ids at positions p, p - 1, ..., -1 before position 0) -> rows
        [Q, engram layers, hash heads]; the engine's paged step reads the lookback from its cache."""
        # Checked on the CPU only: on a device it would be a host sync per step (the engine's intake has
        # checked every id against the vocabulary already).
        if lookback.device.type == "cpu" and lookback.numel() and int(lookback.max()) >= self.token_map.numel():
            raise ValueError(f"input_ids: token ids must lie in [0, {self.token_map.numel()}) for Engram hashing")
        return self.ops.v41_engram_hash(lookback, self.token_map, self.pad_id, self.multipliers, self.primes,
                                        self.offsets, self.heads)


class Engram(nn.Module):
    """Checkpoint names under ``layers.N.engram.``: embed.weight [rows, head_dim], wkv.weight
    [H * (N + 1), hash heads * head_dim], q_weight / k_weight [N, H] (only their product is used). The device
    build may hold ``embed`` as its stored FP8 codes instead (``engram_table.FP8Table``)."""

    def __init__(self, cfg: V41Config, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        n, h = cfg.hc_mult, cfg.hidden_size
        self.table_index = cfg.engram_layer_ids.index(layer)
        self.rows = cfg.engram_num_embeddings[self.table_index]
        self.hidden, self.streams, self.eps = h, n, cfg.rms_norm_eps
        self.embed: DenseTable | FP8Table = DenseTable(self.rows, cfg.engram_head_dim, dtype)
        self.wkv = Linear(cfg.engram_hash_heads * cfg.engram_head_dim, h * (n + 1), dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(n, h, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(n, h, dtype=dtype))

    def forward(self, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H], rows [T, hash heads] -> streams with x_j + gate_j * value (gate per token and
        stream: a signed square root of the normalised key/stream dot product, through a sigmoid)."""
        if rows.device.type == "cpu" and bool(((rows < 0) | (rows >= self.rows)).any()):  # no sync on a device
            raise ValueError(f"engram rows must lie in [0, {self.rows})")
        memory = self.embed.gather(rows, streams.dtype)  # dense, or the device build's codes (engram_table.py)
        key, value = self.wkv(memory).split((self.streams * self.hidden, self.hidden), dim=-1)
        key = key.float().unflatten(-1, (self.streams, self.hidden))
        x = streams.float()
        w = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * w * key).sum(-1) * rstd * self.hidden ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (x + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
