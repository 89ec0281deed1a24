"""The engine's V4.1 step: one batched forward of many sequences' new tokens over the paged cache.

The runner hands every model the same thing (``runner/model_runner.py``): the step's token ids, the cache
storage and a ``StepIndex`` (each token's sequence and position, each sequence's block tables and end). V4
turns that index into row lists that its batched attention kernels read (``StepIndex.rows``). V4.1 does not
fit those lists: a compressed layer reads the entries of *another* layer (its KV source), the top-k and the
candidate blocks are handed from layer to layer, compression groups are disjoint pairs or single tokens, and
Engram hashes the token history. So V4.1 runs its own path here, on V4's index and pools
(``kv/spec_v41.py``):

  * token-wise work is batched over the whole step: embedding, Engram, mHC, the q/KV projections, the
    compressors (their new entries and index keys go straight to the history pool, ratio-2 pair inputs
    through the state pool), MoE and the head;
  * the attention core runs per sequence, over that sequence's window rows and its KV source's entries
    gathered from the pools, with the plain model's own code (``Attention.add_entries``, ``Indexer.select``,
    ``_attend``): the same widths and the same operations as ``DeepseekV41.forward`` on one sequence, so the
    discrete choices (indexer top-k, candidate blocks) see what the plain model sees, tie order included.
    The device build (``key_lists``) runs the whole core for every sequence at once: the indexer's top-k of
    all the step's queries, each scored against its own sequence's index keys (``select_lists``: the same
    choices as the per-sequence code's, ties and last-bit roundings at the cut apart), handed from layer to
    layer as rows of the sequences' concatenated entries (``SharedLists``), and the attention over each
    query's keys given as row lists into the gathered rows (``ops.v41_attend_lists``): the same keys and
    formula in other reduction shapes (fp32 rounding apart). A compressed layer's ops no longer grow with the
    number of sequences (before: ~100 torch ops per sequence in an index source, ~40 in every attention).

With the DSpark drafter (``model.mtp``: speculative decoding) the step also stores the drafter's context
rows of each of its positions (``DSpark.context_rows`` from the taps of ``dspark_target_layer_ids``) in the
``mtp.S`` window tensors, the same rows by position as the plain model's ``V41Cache.draft``; the drafter
itself runs after verification (``runner/dspark.py``).

With ``decoder_replay`` (``replay.py``, the engine's ``v41_decoder_replay``) a long prefill chunk of a sequence
whose step reads only its last row runs the decoder layers on its kept tail: the step is cut to those rows
(``_Step.narrowed``) after the last KV source, and the final rows it skipped come back as NaN.

With the encoder-side replay of prefix hits (spec §3.2; the engine's ``v41_prefix_replay="v41"``, the cache
layout's ``prefix_replay`` = W) a sequence admitted on a hit at H starts at H - W (``StepIndex.emit_from`` = H
while it is before H): its steps write the window rows (and ratio-2 pair inputs, DSpark context) of the
replayed positions, read no window row below H - W (``_Run.window_from``: the replay's kv_start, which the
decoder replay's bound can only raise), and emit no compressed entry, index key or token id for positions
before H: those history rows are shared cached blocks and stay exactly as first computed. Engram's lookback
reads the token ids from the history pool, where that layout keeps them.

Without ``key_lists`` this is the engine's reference path on the CPU (one sequence loop per compressed layer).
Built by ``device.py`` (with ``key_lists``) it runs on a GPU with the op table's kernels that ``device.py`` lists:
the dense FP8 linears, the fused experts, the mHC coefficients, the attention core, a ratio-2 source's pooling of
its state rows, the index sources' scoring and choice, Engram's hash and the gather of its rows from the tables'
FP8 codes among them (``bench/results/layer_sweep_v41.md``). The forward makes no host sync: the per-sequence
layout (runs, spans, which tokens close an entry) comes from host values the runner hands over
(``StepIndex.host``), and the residency / id checks that would read the device run on the CPU only.
Cache rounding (FP8 window KV, MXFP4 index keys, NVFP4 compressed KV) is the model's ``cache_qdq``. A packed
layout (``kv/spec_v41.py``, the engine's ``kv_cache_dtype="auto"``) stores those rows in the released formats: the
step hands them unrounded to ``cache_rows.store_rows``, which quantizes them, and reads them back dequantized
(``load_rows``), the same values as ``qdq``'s bit for bit. An unpacked layout keeps them in the activation dtype,
rounded by the step itself when ``cache_qdq`` (``_Step.round_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config.v41 import V41Config
from deepinfer.kv.spec import HISTORY
from deepinfer.kv.spec_v41 import ENGRAM_KEY, dspark_key
from deepinfer.kv.storage import KVStorage
from deepinfer.model.step_index import StepIndex
from deepinfer.model.v41 import mhc
from deepinfer.model.v41.attention import Attention
from deepinfer.model.v41.cache import LayerCache
from deepinfer.model.v41.cache_rows import load_rows, store_rows
from deepinfer.model.v41.context import SharedKV, SharedLists, StepContext
from deepinfer.model.v41.invariant import token_steps
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.model.v41.replay import DecoderReplay
from deepinfer.model.v41.rope import angles
from deepinfer.model.v41.select_lists import EntryLists, select_lists
from deepinfer.ops.ref.step_rows import lookup
from deepinfer.ops.table import OpTable
from deepinfer.runner.transfer import to_device


@dataclass(frozen=True, slots=True)
class _Run:
    """One sequence's tokens in the step: flat rows [lo, hi), positions [first, end), its table row; its
    queries read no window KV below ``window_from`` (the replays' bound, ``replay.py``)."""

    seq: int
    lo: int
    hi: int
    first: int
    end: int
    window_from: int = 0


@dataclass(frozen=True)
class _Step:
    index: StepIndex
    storage: KVStorage
    window_rows: torch.Tensor  # [T] where each token's per-position rows go (window pool)
    state_rows: torch.Tensor  # [T] ... (state pool)
    runs: tuple[_Run, ...]
    angles: dict[str, torch.Tensor]  # "main" / "compress" -> [T, rope_dim / 2]
    cache_qdq: bool
    positions: torch.Tensor  # [T] each token's position
    # [T] or None: per token, the encoder-side replay's boundary H (positions before it are in cached history
    # blocks: no entry, index key or token id is written for them), 0 outside a replay
    emit_from: torch.Tensor | None = None
    # Per compression ratio r: the flat rows of the tokens that close an entry (and are not before their
    # replay's boundary), laid out on the host from the runs (a mask selection on the device is a host sync);
    # for r = 1, None: every token. None after ``narrowed`` (no KV source runs on a narrowed step).
    closing: dict[int, torch.Tensor | None] | None = None
    # What layers of the step share (``EntryLists`` per KV-source ratio, built by the first index source).
    memo: dict = field(default_factory=dict)

    @property
    def round_rows(self) -> bool:
        """Whether the step rounds the cache rows it stores itself: a packed storage rounds them as it packs."""
        return self.cache_qdq and not self.storage.packed

    def narrowed(self, kept: list[int]) -> tuple["_Step", torch.Tensor]:
        """The step of each run's last ``kept[r]`` tokens, their window bounded at the first of them when the
        run was cut (``replay.py``), and the flat rows [T'] of those tokens in this step."""
        runs, rows, lo = [], [], 0
        for run, k in zip(self.runs, kept):
            first = run.end - k
            runs.append(_Run(run.seq, lo, lo + k, first, run.end, first if first > run.first else run.window_from))
            rows.append(torch.arange(run.hi - k, run.hi, device=self.positions.device))
            lo += k
        sel = torch.cat(rows)
        return _Step(self.index, self.storage, self.window_rows[sel], self.state_rows[sel], tuple(runs),
                     {k: a[sel] for k, a in self.angles.items()}, self.cache_qdq, self.positions[sel],
                     None if self.emit_from is None else self.emit_from[sel]), sel


@dataclass(frozen=True)
class _WindowSpans:
    """The window keys of a step's runs (``PagedV41._window_spans``): run r's positions [starts[r], starts[r] +
    lens[r]) as rows of the gathered window, flat ``positions`` [sum lens] and their window-pool ``rows``."""

    starts: np.ndarray
    lens: np.ndarray
    positions: torch.Tensor
    rows: torch.Tensor


def _resident(rows: torch.Tensor, wanted: torch.Tensor, what: str) -> torch.Tensor:
    """``rows`` from ``lookup``; every wanted one must exist (the manager keeps what a step reads)."""
    # Checked where it costs no host sync: on a device the host built the index from tables whose residency
    # it checked (``step_index``), and the manager keeps every block a running sequence reads.
    if rows.device.type == "cpu" and bool((wanted & (rows < 0)).any()):
        raise IndexError(f"{what}: a needed cache block was released or is missing")
    return rows.clamp_min(0)


class PagedV41(nn.Module):
    """``DeepseekV41``'s weights run as the engine's model: ``forward(ids, None, storage, index)`` -> the final
    collapsed residual [T, H]; ``logits(rows)`` -> fp32 logits."""

    wants_host_runs = True  # the runner hands the step's per-sequence facts as host values (``StepIndex.host``)

    def __init__(self, model: DeepseekV41, decoder_replay: str = "off", batch_invariant: bool = False,
                 key_lists: bool = False) -> None:
        """``decoder_replay``: the decoder-side bounded replay of long prefill chunks (``replay.py``: off / v41
        / exact), applied to the sequences whose step reads only their last row (``StepIndex.last_row_only``).
        ``batch_invariant``: every token runs alone, the head on one row at a time (``invariant.py``).
        ``key_lists``: the attention core runs for all sequences at once over per-query key lists
        (``ops.v41_attend_lists``: one kernel on CUDA per layer instead of ~40 per sequence; the device build),
        else per sequence with the plain model's code (the CPU reference: its bits)."""
        super().__init__()
        self.model = model
        self.key_lists = key_lists
        self.cfg: V41Config = model.cfg
        self.replay = DecoderReplay.of(self.cfg, decoder_replay)
        if batch_invariant and self.replay.keep is not None:
            raise ValueError(f"v41_decoder_replay: {decoder_replay!r} narrows chunks by their length; the "
                             "batch-invariant mode needs 'off'")
        self.batch_invariant = batch_invariant
        # The KV sources' ratios, and 1: the tokens not before their replay's boundary (Engram's new ids).
        self._ratios = sorted({1} | {self.cfg.role(i).ratio for i in range(self.cfg.num_hidden_layers)
                                     if self.cfg.role(i).kv_source})
        self._taps = frozenset(self.cfg.dspark.target_layer_ids) if model.mtp is not None else frozenset()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and hidden.shape[0] > 1:
            return torch.cat([self.model.logits(hidden[i:i + 1]) for i in range(hidden.shape[0])])
        return self.model.logits(hidden)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: None, storage: KVStorage, index: StepIndex) -> torch.Tensor:
        """The runner's call (V4's signature; ``batch`` is V4's per-run form of the index, unused): the step's
        tokens [T] -> the final collapsed residual [T, H] (``logits`` turns rows of it into logits)."""
        if batch is not None or index is None:
            raise ValueError("index: the V4.1 step takes a StepIndex (build_slot_index), not a ForwardBatch")
        if self.batch_invariant and input_ids.numel() > 1:
            return torch.cat([self._forward(input_ids[i:i + 1], storage, one) for i, one in token_steps(index)])
        return self._forward(input_ids, storage, index)

    def _forward(self, input_ids: torch.Tensor, storage: KVStorage, index: StepIndex) -> torch.Tensor:
        m, cfg = self.model, self.cfg
        step = self._step(storage, index)
        engram = self._engram_rows(input_ids, step) if m.hasher is not None else None
        x = m.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1)
        pre = mhc.one_hot_pre(x.shape[0], cfg.hc_mult, x.device)
        image_mask = None  # text only (the intake refuses image ids): every token routes with gate.bias
        # The CSA2 state handed from layer to layer: each sequence's, or every sequence's at once (key lists).
        shared = SharedLists() if self.key_lists else [SharedKV() for _ in step.runs]
        taps: list[torch.Tensor] = []
        kept = self._kept(step)
        sel = None  # the flat rows the decoder layers compute, when the replay narrows the step
        for i, block in enumerate(m.layers):
            if sel is None and i == self.replay.first_layer and kept is not None:
                step, sel = step.narrowed(kept)
                shared = shared.narrowed(sel) if self.key_lists else [sh.narrowed(k) for sh, k in zip(shared, kept)]
                streams, pre, taps = streams[sel], pre[sel], [t[sel] for t in taps]
                engram = engram[sel] if engram is not None else None
            rows = engram[:, block.engram.table_index] if hasattr(block, "engram") else None

            def attend(h: torch.Tensor, att: Attention = block.attn, key: str = f"layers.{i}") -> torch.Tensor:
                return self._attention(att, key, h, step, shared)

            streams, pre = block.run(streams, pre, attend, rows, image_mask, taps if i in self._taps else None)
        if m.mtp is not None:
            context = m.mtp.context_rows(torch.stack(taps, dim=1), step.angles["main"], step.round_rows)
            for s, rows in enumerate(context):
                store_rows(storage, dspark_key(s), "window_kv", step.window_rows, rows)
        hidden = mhc.collapse(streams, pre)
        if sel is None:
            return hidden
        # Rows the decoder layers skipped are NaN: the runner reads none of them (``last_row_only``).
        return hidden.new_full((input_ids.numel(), hidden.shape[-1]), torch.nan).index_copy_(0, sel, hidden)

    def _kept(self, step: _Step) -> list[int] | None:
        """Per run, how many trailing tokens the decoder layers compute; None when that is every token."""
        only = step.index.last_row_only
        if self.replay.keep is None or only is None:
            return None
        kept = [self.replay.kept(r.hi - r.lo) if only[r.seq] else r.hi - r.lo for r in step.runs]
        return kept if any(k < r.hi - r.lo for k, r in zip(kept, step.runs)) else None

    # ---- the step's shared facts ----------------------------------------------------------------------
    def _step(self, storage: KVStorage, index: StepIndex) -> _Step:
        rows = index.rows()
        # The runner lays every sequence's tokens out contiguously, in table-row order, and hands their counts
        # and ends as host values (``StepIndex.host``); direct callers' indexes are read back (host syncs).
        if index.host is not None:
            lens, ends, emit = list(index.host.lens), list(index.host.ends), list(index.host.emit_from)
        else:
            lens = torch.bincount(index.token_seq, minlength=index.seq_end.numel()).tolist()
            ends = index.seq_end.tolist()
            emit = [0] * len(ends) if index.emit_from is None else index.emit_from.tolist()
        replay = storage.layout.prefix_replay
        if storage.packed and not self.model.cache_qdq:
            raise ValueError("storage: packed cache rows (kv_cache_dtype 'auto') hold the released formats' "
                             "roundings; the model was loaded without them (cache_qdq=False)")
        if any(emit) and not replay:
            raise ValueError("index: emit_from (a bounded replay) without the encoder-side replay's cache layout; "
                             "V4.1's exact prefix hits replay nothing")
        runs, lo = [], 0
        for s, (n, end) in enumerate(zip(lens, ends)):
            if n:
                # A step of an encoder-side replay reads no window row below the replay's start H - W.
                runs.append(_Run(s, lo, lo + n, end - n, end, emit[s] - replay if emit[s] else 0))
                lo += n
        pos = index.positions
        ang = {"main": angles(self.cfg.main_rope, pos), "compress": angles(self.cfg.compress_rope, pos)}
        per_token = index.emit_from[index.token_seq] if any(emit) else None
        return _Step(index, storage, rows.window_rows, rows.state_rows, tuple(runs), ang, self.model.cache_qdq, pos,
                     per_token, self._closing(runs, emit, pos.device))

    def _closing(self, runs: list[_Run], emit: list[int], device: torch.device) -> dict[int, torch.Tensor | None]:
        """``_Step.closing`` of the model's KV-source ratios, from the runs' host values (one copy)."""
        out, arrays = {}, []
        for ratio in self._ratios:
            if ratio == 1 and not any(emit):
                out[ratio] = None
                continue
            picked = []
            for run in runs:
                p = np.arange(run.first, run.end)
                keep = ((p + 1) % ratio == 0) & (p >= emit[run.seq])
                picked.append(np.flatnonzero(keep) + run.lo)
            arrays.append((ratio, np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)))
        if arrays:
            flat = to_device(np.concatenate([a for _, a in arrays]).astype(np.int64), torch.int64, device)
            for (ratio, _), t in zip(arrays, flat.split([len(a) for _, a in arrays])):
                out[ratio] = t
        return out

    def _engram_rows(self, input_ids: torch.Tensor, step: _Step) -> torch.Tensor:
        """Write the step's token ids to the cache, read each token's n-gram lookback back, hash it."""
        ids = step.storage.get(ENGRAM_KEY, "token_ids")
        idx = step.index
        if step.storage.layout.layer(ENGRAM_KEY).tensor("token_ids").pool == HISTORY:
            # The token history (encoder-side replay layout): a replayed position's id is in a cached block.
            table = idx.history_table
            new = slice(None) if step.emit_from is None else step.closing[1]
            where = lookup(table, idx.token_seq[new], idx.positions[new], idx.block_size)
            ids[_resident(where, where.new_ones(where.shape, dtype=torch.bool), "engram ids")] = \
                input_ids[new].to(ids.dtype).unsqueeze(-1)
        else:
            table = idx.window_table
            ids[step.window_rows] = input_ids.to(ids.dtype).unsqueeze(-1)
        back = idx.positions.unsqueeze(-1) - torch.arange(self.cfg.engram_max_ngram_size, device=ids.device)
        rows = _resident(lookup(table, idx.token_seq, back, idx.block_size), back >= 0, "engram lookback")
        lookback = torch.where(back < 0, -1, ids[rows, 0].long())
        return self.model.hasher.rows_from_lookback(lookback)

    @staticmethod
    def _window_spans(w: int, step: _Step) -> "_WindowSpans":
        """Where every run's window keys lie (the same for each layer of the step: computed by the first)."""
        spans = step.memo.get(("window", w))
        if spans is not None:
            return spans
        idx, runs = step.index, step.runs
        # Window keys: positions (first - W, end), of which each query sees (t - W, t]; none below window_from.
        # Every sequence's rows are read at once (one gather, one dequantization of packed rows), then split.
        # The spans are laid out on the host (the runs' positions are host facts): one copy, no per-run op.
        starts = np.array([max(run.window_from, run.first - w + 1) for run in runs], dtype=np.int64)
        lens = np.array([run.end for run in runs], dtype=np.int64) - starts
        flat = to_device(np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens)] +
                                        [np.repeat([run.seq for run in runs], lens)]), torch.int64,
                         idx.positions.device)
        kp, seq = flat.split([int(lens.sum())] * 2)
        rows = _resident(lookup(idx.window_table, seq, kp, idx.block_size), kp >= 0, "window")
        spans = step.memo[("window", w)] = _WindowSpans(starts, lens, kp, rows)
        return spans

    # ---- one layer's attention ------------------------------------------------------------------------
    def _attention(self, att: Attention, key: str, x: torch.Tensor, step: _Step,
                   shared: list[SharedKV] | SharedLists) -> torch.Tensor:
        ang = step.angles[att.table]
        q, qr, kv = att.project(x, ang, step.round_rows)
        store_rows(step.storage, key, "window_kv", step.window_rows, kv, att.ops)
        if att.kv_source:
            self._publish_entries(att, key, x, step)
        runs = step.runs
        spans = self._window_spans(att.window, step)
        window = load_rows(step.storage, key, "window_kv", spans.rows, att.ops)
        lens, kp = spans.lens, spans.positions
        if att.kv_source:  # the sequences' entries after the step, for this layer and the ones reusing it
            entries, index_keys, counts = self._entries(key, att.ratio, step, att.ops)
            if self.key_lists:
                shared.entries, shared.index_keys, shared.ratio = entries, index_keys, att.ratio
                shared.rows = shared.candidates = None
            else:
                for sh, e, k in zip(shared, entries.split(counts), index_keys.split(counts)):
                    sh.source, sh.ratio = LayerCache(entries=e, index_keys=k), att.ratio
                    sh.topk = sh.candidates = None
        if self.key_lists:
            return att._output(self._attend_lists(att, x, q, qr, ang, step, shared, window, spans), ang)
        out = []
        for run, sh, kp, keys in zip(runs, shared, kp.split(lens.tolist()), window.split(lens.tolist())):
            rows = slice(run.lo, run.hi)
            t = step.positions[rows]
            allowed = (kp <= t.unsqueeze(1)) & (kp > t.unsqueeze(1) - att.window)
            if att.ratio:
                ctx = StepContext(t, run.first, {}, None, step.cache_qdq)
                keys, allowed = att.add_entries(x[rows], qr[rows], ang[rows], ctx, sh, keys, allowed)
            out.append(att._attend(q[rows], keys, allowed))
        return att._output(torch.cat(out), ang)

    def _attend_lists(self, att: Attention, x: torch.Tensor, q: torch.Tensor, qr: torch.Tensor, ang: torch.Tensor,
                      step: _Step, shared: SharedLists, window: torch.Tensor, spans: _WindowSpans) -> torch.Tensor:
        """``_attention``'s core for every sequence at once (``key_lists``): each query's keys as row lists into
        the step's gathered window rows and the sequences' entries (``ops.v41_attend_lists``), an index
        source's top-k selected for every sequence at once as rows of those entries (``select_lists``: the
        per-sequence choices), a reusing layer's the latest index source's. [T, heads, D]."""
        runs, w = step.runs, att.window
        window_ids = step.memo.get(("window_ids", w))  # the same for every layer of the step
        if window_ids is None:
            # Per query (run r, row i at position t = first + i): window rows max(start, t - W + 1) .. t, as rows
            # of ``window`` (run r's span from base[r]).
            per = np.array([run.hi - run.lo for run in runs], dtype=np.int64)
            base = np.cumsum(spans.lens) - spans.lens
            t = np.concatenate([np.arange(run.first, run.end) for run in runs])  # a run's rows are its positions
            start, b = np.repeat(spans.starts, per), np.repeat(base, per)
            lo = np.maximum(start, t - w + 1)
            cols = np.arange(w)
            ids = np.where(cols[None, :] < (t - lo + 1)[:, None], (b + lo - start)[:, None] + cols[None, :], -1)
            window_ids = step.memo[("window_ids", w)] = to_device(ids, torch.int32, x.device)
        if not att.ratio:
            return att.ops.v41_attend_lists(q, att.attn_sink, window, window_ids)
        if shared.entries is None or shared.ratio != att.ratio:
            raise ValueError(f"a ratio-{att.ratio} layer found no preceding KV source of that ratio")
        if att.index_source:
            lists = step.memo.get(("entry_lists", att.ratio))  # where each query's entries lie, once per step
            if lists is None:
                lists = step.memo[("entry_lists", att.ratio)] = EntryLists.of(
                    [run.first for run in runs], [run.end for run in runs], att.ratio, x.device)
            shared.rows, shared.candidates = select_lists(att.indexer, x, qr, ang, step.cache_qdq, shared.index_keys,
                                                          lists, shared.candidates)
        if shared.rows is None:
            raise ValueError(f"a ratio-{att.ratio} layer found no preceding index source's top-k")
        return att.ops.v41_attend_lists(q, att.attn_sink, window, window_ids, shared.entries, shared.rows)

    def _publish_entries(self, att: Attention, key: str, x: torch.Tensor, step: _Step) -> None:
        """A KV source: the entries the step's tokens close, with their index keys, into the history pool."""
        idx, comp, ratio = step.index, att.compressor, att.ratio
        pos, seq = idx.positions, idx.token_seq
        # An encoder-side replay: entries closing before the boundary are cached; they stay as first computed.
        if step.closing is None:
            raise ValueError(f"{key}: a KV source on a narrowed step (the decoder replay starts after the last one)")
        closing = step.closing[ratio]
        if ratio == 1:  # one entry per token: a projection
            latent = comp.norm(F.linear(x, comp.wkv.weight.to(x.dtype)))
            if closing is not None:
                pos, seq, latent = pos[closing], seq[closing], latent[closing]
        else:
            # Each position's fp32 value and gate rows go to the state pool; entry j pools positions
            # j * r .. j * r + r - 1, closed by the last of them (earlier ones may be from an earlier step).
            state = step.storage.get(key, "compressor_state")
            state[step.state_rows] = torch.cat((F.linear(x.float(), comp.wkv.weight.float()),
                                                F.linear(x.float(), comp.wgate.weight.float())), dim=-1)
            pos, seq = pos[closing], seq[closing]
            group = pos.unsqueeze(-1) - ratio + 1 + torch.arange(ratio, device=pos.device)
            rows = _resident(lookup(idx.state_table, seq, group, idx.block_size), group >= 0, f"{key} state")
            latent = comp.norm(att.ops.v41_compress_pool(state, rows, x.dtype))
        if not pos.numel():
            return
        entry = pos // ratio
        ang = angles(att.rope, entry * ratio)
        entries = att.ops.v41_rope(latent, ang)
        where = _resident(lookup(idx.history_table, seq, entry, idx.block_size // ratio), entry >= 0, f"{key} entries")
        if step.round_rows:
            entries = att.ops.v41_qdq(entries, "nvfp4")
        store_rows(step.storage, key, "entries", where, entries, att.ops)
        store_rows(step.storage, key, "index_keys", where, att.indexer.keys(latent, ang, step.round_rows), att.ops)

    @staticmethod
    def _entries(key: str, ratio: int, step: _Step, ops: OpTable) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The compressed entries and index keys of source ``key`` after the step of every run's sequence (its
        first ``end // ratio``, as the plain model's per-sequence cache holds them), concatenated in run order
        (read for all runs at once; the rows laid out on the host, one copy), and their counts per run."""
        counts = [run.end // ratio for run in step.runs]
        rows = step.memo.get(("entry_rows", ratio))  # the same for every KV source of this ratio in the step
        if rows is None:
            idx, total = step.index, sum(counts)
            entry = np.concatenate([np.arange(n) for n in counts] + [np.zeros(0, dtype=np.int64)])
            flat = to_device(np.concatenate((entry, np.repeat([run.seq for run in step.runs], counts))),
                             torch.int64, idx.positions.device)
            entry, seq = flat[:total], flat[total:]
            rows = step.memo[("entry_rows", ratio)] = _resident(
                lookup(idx.history_table, seq, entry, idx.block_size // ratio), entry >= 0, f"{key} entries")
        return (load_rows(step.storage, key, "entries", rows, ops),
                load_rows(step.storage, key, "index_keys", rows, ops), counts)


def load_paged_v41(model_dir: str | Path, cfg: V41Config, dtype: torch.dtype, cache_quantization: bool,
                   dspark: bool = False, decoder_replay: str = "off", load_format: str = "auto", seed: int = 0,
                   tokenizer_dir: str | Path | None = None, batch_invariant: bool = False,
                   device: str = "cpu", ops: OpTable | None = None, keep=None) -> PagedV41:
    """The engine's V4.1 model from a checkpoint directory (its tokenizer.json is part of Engram's hash);
    ``dspark``: with the DSpark drafter (speculative decoding); ``decoder_replay``: ``PagedV41``'s.
    ``load_format="dummy"``: random weights seeded by ``seed`` (``dummy.py``); Engram then hashes with the
    tokenizer of ``tokenizer_dir`` (the engine's), since a shapes directory has none. ``batch_invariant``:
    ``PagedV41``'s (``DEEPINFER_BATCH_INVARIANT=1``). ``ops`` (an op table): built quantized-first on ``device``
    with it (``device.py``: FP4 experts fused, dense FP8 as ``FP8Dense32``); None: the plain model on the CPU.
    ``keep``: ``load_v41_model``'s (a rank's share, the plain model only)."""
    from deepinfer.model.v41.loader import load_tokenizer, load_v41_model

    tokenizer = None
    if load_format == "dummy" and cfg.active_engram_layers:
        tokenizer = load_tokenizer(Path(tokenizer_dir if tokenizer_dir is not None else model_dir))
    if ops is not None:
        from deepinfer.model.v41.device import dummy_v41_on_device, load_v41_on_device

        if tokenizer is None and cfg.active_engram_layers:
            tokenizer = load_tokenizer(Path(model_dir))
        if keep is not None:
            raise ValueError("device: DeepSeek-V4.1 on several ranks runs on the CPU so far; allowed: cpu")
        kw = dict(tokenizer=tokenizer, cache_qdq=cache_quantization, dspark=dspark)
        model = dummy_v41_on_device(cfg, dtype, device, ops, seed=seed, **kw) if load_format == "dummy" else \
            load_v41_on_device(model_dir, cfg, dtype, device, ops, **kw)
        return PagedV41(model, decoder_replay, batch_invariant, key_lists=True)
    model, _ = load_v41_model(model_dir, dtype, cfg=cfg, tokenizer=tokenizer, cache_qdq=cache_quantization,
                              dspark=dspark, load_format=load_format, seed=seed, keep=keep)
    return PagedV41(model.eval(), decoder_replay, batch_invariant)
