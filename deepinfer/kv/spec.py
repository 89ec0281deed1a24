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
class TensorSpec:
    name: str
    pool: str
    stride: int  # positions per row: 1 for per-token rows, m for compressed entries
    width: int  # elements per row
    dtype: str  # MODEL_DTYPE or FLOAT32


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
                    elem = 4 if t.dtype == FLOAT32 else model_dtype_bytes
                    total += self.rows_per_block(t) * t.width * elem
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
