"""What context parallelism asks of each device, for the memory plan (``deepinfer info``), from ``config.json`` alone.

CP borrows the data-parallel ranks (``distributed/config.py``), so it adds no process and no weights: every
rank holds what its DP x TP layout gives it. Its cost is transient, on the ranks of a CP group in a step that
splits a chunk (``model/parallel/context.py``):
  * each rank runs its zigzag share of the chunk (pieces r and 2·cp-1-r: ``ceil(chunk / cp)`` tokens at most)
    beside its own work of up to ``max_num_batched_tokens`` tokens, through the same layers;
  * per attention layer, every rank receives the whole chunk's per-token rows (the K=V row and the
    compressors' raw kv/gate projections, one all-gather) and, from the owner, the history rows its replica
    of the sequence lacks (``model/parallel/context_history.py``): for a chunk following the sequence's
    previous CP chunk, only the compressed entries and CSA index keys the chunk closes (``history_bytes``);
    for a chunk after positions that ran outside CP (a prefix hit, or chunks the group did not pick) also the
    127 window rows before it and the entries of those positions, at most the whole history
    (``catch_up_bytes``: what every chunk sent before the replicas; the owner reads that much from its cache
    for its own queries of every chunk);
  * each rank keeps the replica of one sequence per other DP rank of its group while that sequence's prefill
    runs: every layer's 127 window rows and entries / index keys up to the sequence's end
    (``replica_bytes`` at ``max_model_len``, held by each rank for up to cp - 1 sequences; its buffers grow
    by a quarter at a time, so the estimate counts 5/4 of it);
  * after the last layer the chunk's final streams are all-gathered.
The cache is not pooled: a sequence's rows stay on the DP rank that owns it (the helpers write nothing into
theirs), so the per-rank KV budget and the longest sequence are those of one DP rank, as without CP.
The longest chunk a step runs is ``max_num_batched_tokens``, so CP engages only when chunks of at least
``cp_min_chunk`` tokens fit in it: a layout where none can is refused here, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config.model import CSA, HCA, ModelConfig
from deepinfer.distributed.config import ParallelConfig
from deepinfer.kv.block_budget import cdiv

_ACT_BYTES = 2  # bf16 rows on the GPU path


@dataclass(frozen=True, slots=True)
class ContextParallelPlan:
    context_parallel_size: int
    groups: int  # CP groups (data_parallel_size / context_parallel_size)
    min_chunk_tokens: int  # the shortest prefill chunk split over a group (cp_min_chunk)
    max_chunk_tokens: int  # the longest: a step's token budget
    share_tokens: int  # per rank: its share of the longest chunk, run beside its own work
    gathered_bytes: int  # per attention layer: the whole chunk's per-token rows, on every rank of the group
    history_bytes: int  # per attention layer and chunk from the replica: the entries and index keys it closes
    catch_up_bytes: int  # per attention layer, at most: the window rows and every entry up to max_model_len
    replica_bytes: int  # per sequence: its history over all layers at max_model_len (a rank holds cp - 1)
    streams_bytes: int  # the chunk's final streams, gathered after the last layer

    def as_dict(self) -> dict:
        mib = 1 << 20
        return {
            "context_parallel_size": self.context_parallel_size, "groups": self.groups,
            "min_chunk_tokens": self.min_chunk_tokens, "max_chunk_tokens": self.max_chunk_tokens,
            "share_tokens_per_rank": self.share_tokens,
            "received_per_layer_mib": {"chunk_rows": round(self.gathered_bytes / mib, 2),
                                       "history_rows": round(self.history_bytes / mib, 2),
                                       "history_rows_catch_up": round(self.catch_up_bytes / mib, 2)},
            "history_replica_mib": {"per_sequence": round(self.replica_bytes / mib, 2),
                                    "sequences_per_rank": self.context_parallel_size - 1},
            "final_streams_mib": round(self.streams_bytes / mib, 2),
            "cache": "each sequence's rows stay on its own DP rank: the per-rank KV budget is one DP rank's",
        }


def check_chunk_budget(parallel: ParallelConfig, max_num_batched_tokens: int) -> None:
    """Raise ValueError naming the field when no prefill chunk (at most ``max_num_batched_tokens`` tokens) is
    ever long enough to be split over the CP group."""
    cp = parallel.context_parallel_size
    if cp == 1 or parallel.cp_min_chunk <= max_num_batched_tokens:
        return
    if 2 * cp > max_num_batched_tokens:
        raise ValueError(f"max_num_batched_tokens: {max_num_batched_tokens} is below 2 x context_parallel_size "
                         f"({2 * cp}), the shortest chunk a CP group can split (one token per zigzag piece); "
                         f"allowed: >= {2 * cp}, or a smaller context_parallel_size")
    raise ValueError(f"context_parallel_min_tokens: {parallel.context_parallel_min_tokens} exceeds "
                     f"max_num_batched_tokens ({max_num_batched_tokens}), the longest prefill chunk a step runs, so "
                     f"no chunk would ever be split over the {cp} context-parallel ranks; allowed: 1.."
                     f"{max_num_batched_tokens}")


def plan_context_parallel(cfg: ModelConfig, parallel: ParallelConfig, max_num_batched_tokens: int,
                          max_model_len: int) -> ContextParallelPlan | None:
    """Per device, what a CP step adds (None without CP). Per-layer bytes are the largest attention layer's."""
    cp = parallel.context_parallel_size
    if cp == 1:
        return None
    check_chunk_budget(parallel, max_num_batched_tokens)
    t, hd, ihd, w = max_num_batched_tokens, cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    widths, per_chunk, catch_up, replica = [hd], [0], [(w - 1) * hd], 0
    for ratio, kind in zip(cfg.layer_compress_ratios, cfg.layer_types):
        row = {CSA: hd + ihd, HCA: hd}.get(kind, 0)  # an entry (and a CSA index key)
        entries = max_model_len // ratio + 1 if row else 0
        if kind == CSA:  # overlapping compressor (2 x width kv and gate) and the indexer's, plus its weights
            widths.append(hd + 4 * hd + 4 * ihd + cfg.index_n_heads)
        elif kind == HCA:
            widths.append(hd + 2 * hd)
        if row:
            per_chunk.append(cdiv(t, ratio) * row)  # entries closed within t positions
            catch_up.append((w - 1) * hd + entries * row)
        replica += (w - 1) * hd + entries * row
    return ContextParallelPlan(
        context_parallel_size=cp, groups=parallel.data_parallel_size // cp, min_chunk_tokens=parallel.cp_min_chunk,
        max_chunk_tokens=t, share_tokens=cdiv(t, cp), gathered_bytes=t * max(widths) * _ACT_BYTES,
        history_bytes=max(per_chunk) * _ACT_BYTES, catch_up_bytes=max(catch_up) * _ACT_BYTES,
        replica_bytes=replica * _ACT_BYTES, streams_bytes=t * cfg.hc_mult * cfg.hidden_size * _ACT_BYTES)
