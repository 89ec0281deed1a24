"""Context parallelism (CP) for long prefill: one prompt chunk's queries split over the DP ranks of a CP group,
causally balanced by a zigzag layout; the sequence's cache stays on the DP rank that owns it.

What V4 attention lets us split, and what not (docs: deepseek-v4-architecture.md §2.3-2.4, §3.1):
  * Everything token-wise — embedding, mHC, every projection, the MoE, the LM head's input — is split by
    tokens with no exchange at all: this is most of a prefill's FLOPs.
  * Per query, attention costs a fixed 128-key window plus the compressed entries it sees: all visible HCA
    entries ((p+1)/128) and, in CSA layers, the indexer's scores over (p+1)/4 index keys before its top-k.
    Both grow with the query's position, so a chunk cut into contiguous pieces gives the last rank the most
    work. The zigzag layout cuts the chunk into 2·cp pieces and gives rank r pieces r and 2·cp-1-r (as ring
    attention's zigzag and Megatron's load-balanced CP): every rank gets the same number of tokens and the
    same summed positions, i.e. the same causal work (``zigzag_split``; measured in
    ``bench/context_parallel_cpu.py``).
  * What a query reads is small and per sequence: the window rows of the 127 positions before the chunk
    plus the chunk's own rows, and the compressed entries (and CSA index keys) up to the chunk's end —
    1/4 and 1/128 of the positions. So every CP rank gets the whole context instead of passing K/V around a
    ring: per attention layer, one all-gather of the chunk's per-token rows (the K=V row each rank computed
    for its tokens, and the compressors' raw kv/gate projections), and one broadcast from the owner of the
    history rows the other ranks lack. They keep what they received of the sequence's history across its
    chunks (``context_history.py``): the prior window rows are the tail of the last chunk's gathered rows, so a
    chunk that follows the sequence's previous CP chunk receives only the entries and index keys it closes
    (about 1/4 of its positions' rows in CSA layers, 1/128 in HCA), not the whole history again.
  * The compressors are computed where they are exact: on the owner, from the gathered per-token rows,
    by the same ops and the same cache rows as a single-process step (``attention_indexed._compress``):
    a window closing in the chunk pools raw rows that may come from several ranks and from earlier chunks
    (CSA overlaps the previous window; HCA pools 128 positions), which only the owner's state pool holds.
    The indexer's top-k is per query, so it runs on the query's rank over the broadcast index keys.
  * Cache entries land on the owner only (window rows, compressor state, entries, index keys), written
    before the broadcast so that the chunk's later queries see the entries its earlier positions closed,
    as in one step on one rank. The helpers write nothing into their own caches (their replica is apart).

A CP step also carries each rank's own DP work: the ranks run their own tokens through the usual batched
path (``model/attention_indexed.py``) and their share of the chunk through ``ShareStep.attention`` in the
same layers (one MoE call per layer for both, so expert parallelism's collectives see every token once).
After the last layer the share's final streams are gathered and the owner puts the chunk's back in its
step's token order, so sampling and prompt logprobs on the owner are unchanged.

At most one chunk per CP group per step (the engine picks the longest eligible one: ``executor/engine.py``).
Splitting a second one in the same step is left out: each split chunk has its own owner, so a layer would
run one share attention, all-gather and history broadcast per chunk (or pack several owners' rows into one
collective with per-chunk offsets), the streams gather and the owners' reordering would be per chunk, and
a rank would hold a replica per chunk in flight. It only helps while two DP ranks of a group both have a
chunk of at least ``context_parallel_min_tokens`` in the same step, and then the second chunk runs unsplit
on its owner beside its share of the first, which is the plain DP case (the group's step waits for the
slower rank either way). Not worth the second code path until a measurement says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from deepinfer.config.model import CSA, HCA, SWA
from deepinfer.distributed.collectives import all_gather_rows, broadcast_rows
from deepinfer.model.attention_indexed import _compress, attention_indexed
from deepinfer.model.parallel.context_history import GrowingRows, HistoryReplica
from deepinfer.model.context import StepContext


# ---- the split ----------------------------------------------------------------------------------------
def zigzag_pieces(length: int, cp_size: int) -> list[tuple[int, int]]:
    """The chunk's offsets [0, length) cut into 2·cp_size contiguous pieces, sizes as equal as possible
    (the first ``length % (2·cp_size)`` one longer)."""
    if cp_size < 1 or length < 0:
        raise ValueError(f"zigzag: length {length} and cp_size {cp_size} must be >= 0 and >= 1")
    n = 2 * cp_size
    base, extra = divmod(length, n)
    bounds = np.cumsum([0] + [base + (k < extra) for k in range(n)])
    return [(int(bounds[k]), int(bounds[k + 1])) for k in range(n)]


def zigzag_split(length: int, cp_size: int) -> tuple[np.ndarray, ...]:
    """Per CP rank, the chunk offsets of its queries (int64, ascending): pieces r and 2·cp_size-1-r."""
    pieces = zigzag_pieces(length, cp_size)
    return tuple(np.concatenate([np.arange(*pieces[r]), np.arange(*pieces[2 * cp_size - 1 - r])]).astype(np.int64)
                 for r in range(cp_size))


def contiguous_split(length: int, cp_size: int) -> tuple[np.ndarray, ...]:
    """The naive split (rank r: the r-th contiguous slice), for comparison only."""
    bounds = np.linspace(0, length, cp_size + 1).round().astype(np.int64)
    return tuple(np.arange(bounds[r], bounds[r + 1], dtype=np.int64) for r in range(cp_size))


def zigzag_merge(rows: torch.Tensor, splits: Sequence[np.ndarray]) -> torch.Tensor:
    """Rows gathered in rank order (rank 0's share, then rank 1's, ...) back in chunk order."""
    order = torch.from_numpy(np.concatenate(splits)).to(rows.device)
    if len(order) != len(rows):
        raise ValueError(f"zigzag_merge: {len(rows)} rows for a split of {len(order)}")
    out = torch.empty_like(rows)
    out[order] = rows
    return out


# ---- one step's roles -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ContextParallelChunk:
    """In a RunStep: the prefill chunk of ``seq_id`` (in DP rank ``owner``'s plan) runs over ``owner``'s CP
    group."""

    owner: int
    seq_id: str


@dataclass(frozen=True, eq=False)
class ContextShare:
    """This rank's part in one CP chunk."""

    group: dist.ProcessGroup
    cp_rank: int
    cp_size: int
    src: int  # global rank of the owner's member of this CP group (the broadcast source)
    is_owner: bool
    seq_id: str
    first_pos: int
    token_ids: tuple[int, ...]  # the whole chunk's
    # What this rank keeps of the sequence's history across its CP chunks (``context_history.py``); None: a
    # replica for this chunk only (the whole history is broadcast).
    replica: HistoryReplica | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def splits(self) -> tuple[np.ndarray, ...]:
        return zigzag_split(self.length, self.cp_size)


class ShareStep:
    """What the layers of a CP step read besides the usual step context (``StepContext.cp``): this rank's own
    tokens' context (``own``, first ``n_own`` rows) and its share of the chunk (the remaining rows)."""

    def __init__(self, model, storage, share: ContextShare, own: StepContext | None, chunk: StepContext | None):
        self.share, self.storage, self.own, self.chunk = share, storage, own, chunk
        self.n_own = 0 if own is None else len(own.input_ids)
        self.replica = share.replica if share.replica is not None else HistoryReplica(-1, share.seq_id)
        if share.first_pos < self.replica.pos:
            raise ValueError(f"context parallel: {share.seq_id!r} chunk from {share.first_pos}, but its replica holds "
                             f"positions up to {self.replica.pos} (HistoryReplicas.track resets it)")
        self.known = self.replica.pos  # the history every rank of the group holds: positions [0, known)
        cfg, dev = model.cfg, next(model.parameters()).device
        self.window = cfg.sliding_window
        self.splits = share.splits
        self.sizes = [len(s) for s in self.splits]
        mine = torch.from_numpy(self.splits[share.cp_rank]).to(dev)
        self.positions = share.first_pos + mine
        self.ids = torch.tensor(share.token_ids, dtype=torch.long, device=dev)[mine]
        self.rope = {t: model.ropes.cos_sin(t, self.positions, model.dtype) for t in ("main", "compress")}
        s, w = len(mine), self.window
        self.rows = torch.arange(s, dtype=torch.long, device=dev)
        # The local window pool: row i holds position first_pos - (w - 1) + i (the 127 positions before the
        # chunk, then the chunk); query p reads positions p - w + 1 .. p, oldest first, as ``step_rows``.
        k = torch.arange(w, device=dev)
        local = mine[:, None] + k
        self.window_keys = torch.where(self.positions[:, None] - (w - 1) + k >= 0, local, -1).to(torch.int32)
        end = share.first_pos + share.length
        # Per compressed kind: entries visible to the chunk's last query, and each share query's limit.
        self.entries: dict[int, int] = {}
        self.limits: dict[int, torch.Tensor] = {}
        self.visible: dict[int, torch.Tensor] = {}
        self.seq_rows: dict[int, torch.Tensor] = {}
        for m in sorted({r for r, kind in zip(cfg.layer_compress_ratios, cfg.layer_types) if kind != SWA}):
            n = end // m
            self.entries[m] = n
            limits = ((self.positions + 1) // m).to(torch.int32)
            j = torch.arange(max(n, 1), device=dev)  # at least one column, -1 when none (as step_rows)
            self.limits[m] = limits
            self.visible[m] = torch.where(j[None, :] < limits[:, None], j, -1).to(torch.int32)
            self.seq_rows[m] = torch.where(j < n, j, -1).to(torch.int32)[None, :]
        self.token_seq = torch.zeros(s, dtype=torch.long, device=dev)

    # -- collectives ---------------------------------------------------------------------------------------
    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's share rows -> the whole chunk's, in chunk order."""
        return zigzag_merge(all_gather_rows(rows, self.sizes, self.share.group), self.splits)

    def _broadcast(self, parts: list[torch.Tensor | None], shapes: list[tuple[int, ...]], dtype, device):
        """The owner's ``parts`` (row blocks of one width and dtype) on every rank, in one broadcast."""
        if self.share.is_owner:
            flat = torch.cat(parts)
        else:
            flat = torch.empty(sum(s[0] for s in shapes), *shapes[0][1:], dtype=dtype, device=device)
        flat = broadcast_rows(flat, self.share.src, self.share.group)
        return list(flat.split([s[0] for s in shapes]))

    # -- the layers --------------------------------------------------------------------------------------
    def attention(self, attn, x: torch.Tensor, layer_key: str) -> torch.Tensor:
        """``Attention.forward`` of a CP step: own rows by the batched path, then the share's rows."""
        n = self.n_own
        share = self._share_attention(attn, x[n:], layer_key)
        if not n:
            return share
        return torch.cat([attention_indexed(attn, x[:n], self.own, layer_key), share])

    def _share_attention(self, attn, x: torch.Tensor, layer_key: str) -> torch.Tensor:
        ops, storage, share = attn.ops, self.storage, self.share
        cos, sin = self.rope[attn.table]
        s = len(x)
        window = storage.get(layer_key, "window_kv")
        # This rank's tokens: the K=V row (into a local buffer, not the cache) and the compressors' inputs.
        side = cols = None
        if attn.kind != SWA:
            side, cols = attn.side_proj(x), attn.side_proj.cols
        xq = attn.x_proj(x)
        kv = window.new_empty(s, window.shape[1])
        q_res = ops.latent_norms(xq, attn.x_proj.cols["kv"], attn.q_norm.weight, attn.q_norm.eps,
                                 attn.kv_norm.weight, attn.kv_norm.eps, cos, sin, window=kv, rows=self.rows)
        # The whole chunk's rows on every CP rank (one all-gather): K=V rows | raw compressor projections.
        d = kv.shape[1]
        packed = kv if side is None else torch.cat([kv, side.to(kv.dtype)], dim=1)
        full = self.gather(packed)
        kv_chunk = full[:, :d]
        # The owner writes the chunk into its cache exactly as a single-process step would, then hands out
        # the history every query of the chunk may read.
        key = (attn.ratio, attn.kind == CSA)
        if share.is_owner:
            c = self.chunk
            window.index_copy_(0, c.index.window_rows, kv_chunk)
            if side is not None:
                side_chunk = full[:, d:].to(side.dtype)
                ci = c.index.compress[key]
                emit_cos, emit_sin = c.emit_rope[key]
                _compress(attn.compressor, side_chunk, cols["kv"], c, layer_key, "compressor_state", "entries", ci,
                          emit_cos, emit_sin, ops)
                if attn.kind == CSA:
                    _compress(attn.indexer.compressor, side_chunk, cols["ix_kv"], c, layer_key, "indexer_state",
                              "index_keys", ci, emit_cos, emit_sin, ops)
        prior, entries, keys = self._history(attn, layer_key, key, window)
        local_window = torch.cat([prior, kv_chunk])
        if not share.is_owner:  # the replica's window rows for the next chunk: positions end-127 .. end-1
            self.replica.window[layer_key] = local_window[-(self.window - 1) :].clone()

        q_all = attn.q_proj(q_res)
        q = q_all[:, : attn.n_heads * attn.head_dim].view(s, attn.n_heads, attn.head_dim)
        if attn.kind == CSA:
            ix = attn.indexer
            q_ix = q_all[:, attn.q_proj.cols["ix_q"] :].view(s, ix.n_heads, ix.head_dim)
            q, q_ix = ops.heads_norm_rope(q, cos, sin, attn.eps, q_ix)
        else:
            q = ops.norm_rope_heads(q, cos, sin, attn.eps)
        extra_kv = extra_idx = None
        if attn.kind == HCA:
            extra_kv, extra_idx = entries, self.visible[attn.ratio]
        elif attn.kind == CSA:
            weights = side[:, cols["ix_w"] : cols["ix_w"] + ix.n_heads]
            extra_kv = entries
            extra_idx = ix.ops.indexer_topk(q_ix, weights, keys, self.seq_rows[attn.ratio], self.limits[attn.ratio],
                                            ix.topk, ix.head_dim**-0.5, self.token_seq, as_rows=True,
                                            weight_scale=ix.n_heads**-0.5)
        out = ops.sparse_attention_indexed(q, local_window, self.window_keys, attn.attn_sink, attn.head_dim**-0.5,
                                           extra_kv, extra_idx)
        out = ops.rope(out, cos, sin, inverse=True)
        return attn.wo_b(attn.wo_a.grouped_flat(out.reshape(s, -1), attn.groups))

    def _history(self, attn, layer_key: str, key, window: torch.Tensor):
        """(prior window rows [w-1, D], entries [n+1, D] or None, index keys [n+1, Di] or None): the 127
        positions before the chunk (zeros before position 0) and the compressed entries up to the chunk's end,
        each pool with one zero row past the last (what the -1 padding columns name). The owner reads them from
        its cache and broadcasts what the other ranks' replica lacks (``context_history.py``): the window rows
        of positions [lo, first_pos) and the entries [have, n); they add those to their replica."""
        storage, w, rep, first = self.storage, self.window, self.replica, self.share.first_pos
        names = ["entries"] + (["index_keys"] if attn.kind == CSA else []) if attn.kind != SWA else []
        n = self.entries.get(attn.ratio, 0)
        have = self.known // attn.ratio if names else 0  # entries the replica holds
        lo = max(self.known, first - (w - 1))  # the first window position it lacks
        pools = [storage.get(layer_key, name) for name in names]
        shapes = [(first - lo, window.shape[1])] + [(n - have, p.shape[1]) for p in pools]
        parts = full = None
        if self.share.is_owner:
            c = self.chunk
            prior_rows = c.index.window_keys[0, : w - 1].long()  # positions first_pos - 127 .. first_pos - 1
            prior = torch.where((prior_rows >= 0)[:, None], window[prior_rows.clamp(min=0)], 0)
            full = [prior]
            if pools:
                rows = c.index.compress[key].seq_rows[0, :n].long()
                full += [torch.cat([p[rows], p.new_zeros(1, p.shape[1])]) for p in pools]
            parts = [prior[w - 1 - (first - lo) :]] + [f[have:n] for f in full[1:]]
        # One broadcast per (width, dtype) of what is not empty: window rows and entries share both in V4.
        got: list[torch.Tensor | None] = [None] * len(shapes)
        dtypes = [window.dtype] + [p.dtype for p in pools]
        groups: dict[tuple, list[int]] = {}
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            if shape[0]:
                groups.setdefault((shape[1], dtype), []).append(i)
        for (_, dtype), idx in groups.items():
            sent = self._broadcast([parts[i] for i in idx] if parts else [], [shapes[i] for i in idx], dtype,
                                   window.device)
            for i, t in zip(idx, sent):
                got[i] = t
        if full is None:  # not the owner: the replica, completed by what was received
            full = [self._replica_window(layer_key, window, got[0])]
            for name, p, t in zip(names, pools, got[1:]):
                held = rep.pools.setdefault((layer_key, name), GrowingRows())
                if held.count != have:
                    raise RuntimeError(f"context parallel: {self.share.seq_id!r} {layer_key} {name}: the replica "
                                       f"holds {held.count} rows, the owner assumed {have}")
                if t is not None:
                    held.append(t)
                full.append(held.padded(p[:1]))
        return full[0], (full[1] if len(full) > 1 else None), (full[2] if len(full) > 2 else None)

    def _replica_window(self, layer_key: str, window: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor:
        """The prior window rows from the replica's (positions known-127 .. known-1) and the received ones."""
        w, first = self.window, self.share.first_pos
        keep = self.known - (first - (w - 1))  # replica rows still in the chunk's window
        parts = []
        if keep > 0:
            held = self.replica.window.get(layer_key)
            parts.append(window.new_zeros(keep, window.shape[1]) if held is None else held[w - 1 - keep :])
        if received is not None:
            parts.append(received)
        return torch.cat(parts) if len(parts) > 1 else parts[0]


@torch.no_grad()
def forward_with_share(model, storage, share: ContextShare, own_ids: torch.Tensor | None = None,
                       own_index=None, chunk_index=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One CP step on this rank: its own tokens (``own_ids`` with their step index, or none) and its share of
    the chunk; ``chunk_index``: on the owner, the chunk's step index (its cache rows). Returns (own tokens'
    final streams or None, the whole chunk's final streams on the owner, else None)."""
    dev = next(model.parameters()).device
    own = model.context(own_ids, None, storage, own_index) if own_ids is not None and len(own_ids) else None
    chunk = None
    if share.is_owner:
        chunk = model.context(torch.tensor(share.token_ids, dtype=torch.long, device=dev), None, storage, chunk_index)
    step = ShareStep(model, storage, share, own, chunk)
    ids = step.ids if own is None else torch.cat([own.input_ids, step.ids])
    ctx = StepContext(ids, None, None, storage, None, None, None, cp=step)
    streams = model.run_layers(ctx)
    step.replica.pos = share.first_pos + share.length
    n = step.n_own
    chunk_streams = step.gather(streams[n:])
    return (streams[:n] if own is not None else None), (chunk_streams if share.is_owner else None)
