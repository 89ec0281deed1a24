"""Per-layer cache specs: what each layer stores, in which pool, at what granularity.

All per-sequence state is *position-addressed* (architecture note §3.4): every row belongs to one absolute
position (or, for compressed entries, one window), so rolling a sequence back to length n is "set n" and
any chunking of the prompt writes the same rows. Three lifetimes live in three pools:

  * ``history`` — grows with the sequence and is never rewritten: CSA/HCA compressed entries and CSA
    indexer keys (one row per closed window of m positions).
  * ``window``  — sliding-window K=V rows, one per position; only the last ``window_tail`` positions
    behind the write head are read, so older blocks may be released.
  * ``state``   — raw compressor inputs (projected kv and gate, position bias added), one row per
    position; only the last ``state_tail`` positions are read (CSA: 2m-1, HCA: m-1).

Every pool is paged by one logical block of ``block_size`` positions (a multiple of 128, so prefix-cache
boundaries fall on closed HCA windows); a block of a pool holds ``block_size // stride`` rows per tensor.

A tensor's ``dtype`` says how its rows are stored: in the model's activation dtype, in float32, or packed in
a block-scaled FP8/FP4 format (``PackedFormat``: uint8 rows of codes then scales, DeepSeek-V4.1's released
cache formats). The storage only allocates and moves such rows; the model quantizes what it writes and
dequantizes what it reads (``model/v41/cache_quant.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.config.model import CSA, HCA, SWA, ModelConfig

HISTORY = "history"
WINDOW = "window"
STATE = "state"
POOLS = (HISTORY, WINDOW, STATE)
MODEL_DTYPE = "model"  # stored in the model's activation dtype
FLOAT32 = "float32"


@dataclass(frozen=True, slots=True)
class PackedFormat:
    """A block-scaled format of cache rows: ``code_bits`` per channel, one ``scale_bytes`` scale per ``block``
    channels. A row is one uint8 vector, every code first (4-bit codes two per byte, the even channel in the
    low nibble, as the FP4 expert weights), then every scale: one row per position keeps a block copy, a
    tier payload or a gather a plain row operation, and the codes' offset the same in every row."""

    name: str
    code_bits: int
    block: int
    scale_bytes: int = 1

    def code_bytes(self, width: int) -> int:
        return -(-width * self.code_bits // 8)

    def row_bytes(self, width: int) -> int:
        """Bytes of one row of ``width`` channels (a partial last block still has its scale)."""
        return self.code_bytes(width) + -(-width // self.block) * self.scale_bytes


FP8_UE8M0_32 = PackedFormat("fp8_e4m3+ue8m0/32", 8, 32)  # e4m3 codes, a power-of-two (exponent byte) scale
E2M1_UE8M0_32 = PackedFormat("e2m1+ue8m0/32", 4, 32)  # MXFP4
E2M1_E4M3_16 = PackedFormat("e2m1+e4m3/16", 4, 16)  # NVFP4 without a global scale
PACKED_FORMATS = {f.name: f for f in (FP8_UE8M0_32, E2M1_UE8M0_32, E2M1_E4M3_16)}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    pool: str
    stride: int  # positions per row: 1 for per-token rows, m for compressed entries
    width: int  # elements (channels) per row
    dtype: str  # MODEL_DTYPE, FLOAT32 or a PACKED_FORMATS name

    @property
    def packed(self) -> PackedFormat | None:
        """The packed format of the rows (uint8), None when they hold plain values."""
        return PACKED_FORMATS.get(self.dtype)

    def row_bytes(self, model_dtype_bytes: int) -> int:
        """Bytes of one stored row."""
        if self.dtype in PACKED_FORMATS:
            return PACKED_FORMATS[self.dtype].row_bytes(self.width)
        return self.width * (4 if self.dtype == FLOAT32 else model_dtype_bytes)


@dataclass(frozen=True, slots=True)
class LayerCacheSpec:
    key: str  # parameter prefix of the layer: "layers.7" or "mtp.0"
    kind: str  # SWA, CSA or HCA
    ratio: int  # compression ratio m (0 for SWA)
    tensors: tuple[TensorSpec, ...]
    window_tail: int  # positions behind the next token that attention still reads
    state_tail: int  # positions behind the next token that the compressor still reads

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"{self.key} has no cache tensor {name!r}")


@dataclass(frozen=True, slots=True)
class CacheLayout:
    block_size: int
    layers: tuple[LayerCacheSpec, ...]
    # Positions before a cached block boundary that a prefix hit recomputes from the history pool alone
    # (DeepSeek-V4.1's encoder-side replay, spec §3.2: the window and state pools then leave the prefix cache,
    # ``kv/manager.py``, ``kv/prefix_hits.py``); 0: a hit keeps the boundary's window/state tails (or V4's bounded replay).
    prefix_replay: int = 0

    def layer(self, key: str) -> LayerCacheSpec:
        for spec in self.layers:
            if spec.key == key:
                return spec
        raise KeyError(f"no cache spec for layer {key!r}")

    def rows_per_block(self, t: TensorSpec) -> int:
        return self.block_size // t.stride

    def bytes_per_block(self, pool: str, model_dtype_bytes: int) -> int:
        total = 0
        for spec in self.layers:
            for t in spec.tensors:
                if t.pool == pool:
                    total += self.rows_per_block(t) * t.row_bytes(model_dtype_bytes)
        return total

    def tail(self, pool: str) -> int:
        """Positions behind the next token that some layer still reads from ``pool`` (0 for history)."""
        if pool == WINDOW:
            return max(s.window_tail for s in self.layers)
        if pool == STATE:
            return max((s.state_tail for s in self.layers), default=0)
        return 0


def _layer_spec(cfg: ModelConfig, key: str, kind: str, ratio: int) -> LayerCacheSpec:
    tensors = [TensorSpec("window_kv", WINDOW, 1, cfg.head_dim, MODEL_DTYPE)]
    state_tail = 0
    if kind == CSA:
        # Two series (Ca for the next window, Cb for this one) of kv and gate per position.
        tensors += [
            TensorSpec("entries", HISTORY, ratio, cfg.head_dim, MODEL_DTYPE),
            TensorSpec("index_keys", HISTORY, ratio, cfg.index_head_dim, MODEL_DTYPE),
            TensorSpec("compressor_state", STATE, 1, 2 * 2 * cfg.head_dim, FLOAT32),
            TensorSpec("indexer_state", STATE, 1, 2 * 2 * cfg.index_head_dim, FLOAT32),
        ]
        state_tail = 2 * ratio - 1
    elif kind == HCA:
        tensors += [
            TensorSpec("entries", HISTORY, ratio, cfg.head_dim, MODEL_DTYPE),
            TensorSpec("compressor_state", STATE, 1, 2 * cfg.head_dim, FLOAT32),
        ]
        state_tail = ratio - 1
    return LayerCacheSpec(key, kind, ratio, tuple(tensors), cfg.sliding_window - 1, state_tail)


def build_layout(cfg: ModelConfig, block_size: int = 256, include_mtp: bool = True) -> CacheLayout:
    if block_size <= 0 or block_size % 128:
        raise ValueError(f"block_size: must be a positive multiple of 128, got {block_size}")
    lcm = math.lcm(*[r for r in cfg.layer_compress_ratios if r] or [1])
    if block_size % lcm:
        raise ValueError(f"block_size: {block_size} is not a multiple of the compression ratios' lcm {lcm}")
    specs = [
        _layer_spec(cfg, f"layers.{i}", kind, cfg.layer_compress_ratios[i])
        for i, kind in enumerate(cfg.layer_types)
    ]
    if include_mtp:
        specs += [_layer_spec(cfg, f"mtp.{i}", SWA, 0) for i in range(cfg.num_nextn_predict_layers)]
    return CacheLayout(block_size, tuple(specs))
