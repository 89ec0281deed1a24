"""DeepSeek-V4.1's per-sequence state as cache specs of the engine's three pools (``kv/spec.py``).

V4.1 keeps the V4 principle: every row belongs to one absolute position (or one compressed entry), so any
chunking writes the same rows and rolling back is "set n". What each layer stores (spec §2.4-§2.6):

  * every layer: ``window_kv``, the rope'd shared K=V row of each position (``window`` pool; the last
    ``sliding_window - 1`` positions behind the next token are read);
  * KV sources (``kv_source_layer_ids``): ``entries``, the compressed KV, and ``index_keys``, the indexer's keys
    of those entries (``history`` pool, one row per ``ratio`` positions: ratio 2 pools pairs, ratio 1 is one
    entry per token). Reusing and re-indexing layers store nothing compressed: they read their source's rows;
  * ratio-2 sources: ``compressor_state``, the fp32 value and gate projections of each position (``state``
    pool): entry j pools positions 2j and 2j + 1, so a step that ends between them leaves one position for
    the next step (``state_tail`` 1). At an even position nothing before it is read, so block boundaries
    need no state (prefix hits stay exact without a replay: ``replay_length`` is 0 for V4.1);
  * Engram (when a layer has it): ``token_ids``, the sequence's token ids (``window`` pool, float32: exact
    for ids below 2**24), of which the n-gram hash reads the last ``engram_max_ngram_size - 1`` positions.
    Kept in the cache rather than taken from the scheduler's token lists so that placeholder inputs (async
    scheduling), prefix hits and recomputation after preemption need nothing else. With the encoder-side
    replay of prefix hits (``prefix_replay``, spec §3.2) they live in the ``history`` pool instead (one row per
    position, kept for the sequence's life, 4 B each): a hit then keeps no window row at all, and the replayed
    positions' lookback comes from the token history.

  * the DSpark drafter (with ``speculative_config`` method ``dspark`` only): ``mtp.S`` holds ``window_kv``,
    stage S's context row of each target position (``window`` pool), written by the target's forward for
    every position it computes, like the layers' rows. A block drafted after position p reads (p - W, p],
    i.e. ``sliding_window`` positions behind the next token. Position-addressed, so a rejected draft's row
    is past the rolled-back length and is rewritten before it is read, preemption recomputes the rows with
    the rest, and a prefix hit finds them in the kept window tail, exact like the layers' rows (or, with
    ``prefix_replay``, recomputes them with the replayed window).

With ``packed`` (the engine's ``kv_cache_dtype="auto"``) the rows that the reference rounds are stored in its
released formats (spec §4.1, ``kv/spec.py`` PackedFormat): window KV and DSpark context rows as FP8 e4m3 with a
UE8M0 scale per 32 channels (528 B for 512), compressed entries as NVFP4 (288 B), index keys as MXFP4 (68 B
for 128). Without it they are kept in the activation dtype (rounded or not, as the model's ``cache_qdq``
says). The compressor state stays fp32 and the Engram token ids float32 either way.

With ``prefix_replay`` (``v41_prefix_replay="v41"``) the layout says so (``CacheLayout.prefix_replay``, the
sliding window): a hit at H keeps the history blocks only and recomputes [H - W, H) (``kv/prefix_hits.py``,
``model/v41/paged.py``), so no window or state block of a boundary needs to stay cached.

The top-k selection and the candidate blocks are recomputed by every query and the mHC coefficients are per
token, so nothing else crosses steps. The layer kinds are ``SWA`` (ratio 0) and ``CSA2`` (ratio 1 or 2): V4's
step-row derivation (``compress_kinds``) and bounded replay (``replay_length``) look for V4's CSA/HCA only.
"""

from __future__ import annotations

from deepinfer.config.model import SWA
from deepinfer.config.v41 import V41Config
from deepinfer.config.v41_engine import check_prefix_replay
from deepinfer.kv.spec import (E2M1_E4M3_16, E2M1_UE8M0_32, FLOAT32, FP8_UE8M0_32, HISTORY, MODEL_DTYPE, STATE,
                               WINDOW, CacheLayout, LayerCacheSpec, TensorSpec)

CSA2 = "CSA2"  # a V4.1 layer that attends compressed entries too (of its own or of its KV source)
ENGRAM_KEY = "engram"  # the layout entry holding the token ids Engram's lookback reads
EXACT_FLOAT32_IDS = 1 << 24  # token ids below this are exact in float32


def _formats(packed: bool) -> tuple[str, str, str]:
    """The dtypes of window KV (and DSpark context), compressed entries and index keys."""
    if packed:
        return FP8_UE8M0_32.name, E2M1_E4M3_16.name, E2M1_UE8M0_32.name
    return MODEL_DTYPE, MODEL_DTYPE, MODEL_DTYPE


def _layer_spec(cfg: V41Config, layer: int, packed: bool) -> LayerCacheSpec:
    role = cfg.role(layer)
    window, entries, keys = _formats(packed)
    tensors = [TensorSpec("window_kv", WINDOW, 1, cfg.head_dim, window)]
    state_tail = 0
    if role.kv_source:
        tensors += [TensorSpec("entries", HISTORY, role.ratio, cfg.head_dim, entries),
                    TensorSpec("index_keys", HISTORY, role.ratio, cfg.index_head_dim, keys)]
        if role.ratio > 1:
            # [value | gate] projections of one position, fp32 as the reference pools them.
            tensors.append(TensorSpec("compressor_state", STATE, 1, 2 * cfg.head_dim, FLOAT32))
            state_tail = role.ratio - 1
    kind = CSA2 if role.ratio else SWA
    return LayerCacheSpec(f"layers.{layer}", kind, role.ratio, tuple(tensors), cfg.sliding_window - 1, state_tail)


def dspark_key(stage: int) -> str:
    """The layout entry of DSpark stage ``stage``'s context rows (its checkpoint prefix)."""
    return f"mtp.{stage}"


def build_v41_layout(cfg: V41Config, block_size: int = 256, dspark: bool = False,
                     prefix_replay: str = "exact", packed: bool = False) -> CacheLayout:
    """The engine's cache layout of a V4.1 backbone; ``dspark``: with the DSpark drafter's context rows;
    ``prefix_replay``: how prefix hits are taken (``config/v41_engine.py`` PREFIX_REPLAY_MODES); ``packed``:
    the rounded rows in the released FP8/FP4 formats (the model must round them: ``cache_qdq``)."""
    replay = cfg.sliding_window if check_prefix_replay(prefix_replay) == "v41" else 0
    if block_size <= 0 or block_size % 128:
        raise ValueError(f"block_size: must be a positive multiple of 128, got {block_size}")
    specs = [_layer_spec(cfg, i, packed) for i in range(cfg.num_hidden_layers)]
    if cfg.active_engram_layers:
        if cfg.vocab_size > EXACT_FLOAT32_IDS:
            raise ValueError(f"vocab_size: {cfg.vocab_size} ids do not fit the float32 token-id cache of Engram "
                             f"(at most {EXACT_FLOAT32_IDS})")
        lookback = 0 if replay else cfg.engram_max_ngram_size - 1  # in the history pool: kept, no tail
        specs.append(LayerCacheSpec(ENGRAM_KEY, SWA, 0, (TensorSpec("token_ids", HISTORY if replay else WINDOW, 1, 1,
                                                                    FLOAT32),), lookback, 0))
    if dspark:
        context = TensorSpec("window_kv", WINDOW, 1, cfg.head_dim, _formats(packed)[0])
        specs += [LayerCacheSpec(dspark_key(s), SWA, 0, (context,), cfg.sliding_window, 0)
                  for s in range(cfg.num_nextn_predict_layers)]
    return CacheLayout(block_size, tuple(specs), replay)
