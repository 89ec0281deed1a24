"""ModelRunner: turns a StepPlan into one model forward, logits for the rows that need them, and draws.

``submit(plan)`` edits the persistent batch state (``input_batch.py``), launches the step and returns a
``StepHandle`` at once; ``StepHandle.result()`` waits for the step's results to reach the host (the one
host sync of a step). Between the two the host is free: the engine plans and submits the next step, whose
placeholder inputs the device takes from this step's draws (async scheduling).

Rows needing logits: the last ``num_samples`` new tokens of every sequence that draws this step, plus the
prompt positions of ``prompt_logprobs`` jobs. Every step runs the batched path (``model/attention_indexed``,
the reference ops on the CPU); decode steps replay a CUDA graph when one is captured.

With speculative decoding (``drafter``) a verifying sequence draws at every one of its inputs, the draws
are compared with its drafts (``runner/speculative.py``), the MTP layer (V4.1: the DSpark drafter,
``runner/dspark.py``) then proposes the next drafts, and
the accepted prefix plus the target's next token reach the host with those drafts in one copy (the step's
one read). On the GPU a full verify step (every sequence k drafts) replays a verify graph that keeps the
final streams, and the MTP passes replay theirs, head and draft pick included (``runner/mtp_graphs.py``);
other steps (prefill chunks, fewer drafts) run eagerly, through the same functions. With async scheduling a
verifying sequence whose previous step is still in flight has only placeholder inputs (that step's last
emitted token and its drafts, from ``InputBatch``), planned at the positions of that step's full acceptance;
``runner/step_shift.py`` moves them back on the device (the eager index, or the graph's static one after its
copy), and its drafts are verified against the filled inputs.

Structured outputs: ``submit(plan, masks)`` launches the forward and the logits first and only then calls
``masks()`` for the step's grammar masks (``StepMasks``: the constrained rows' words and row numbers,
computed on the host by the engine into one page-locked buffer), so on the GPU the grammar work overlaps the
forward; the buffer is uploaded in one queued copy and the op table's ``token_mask`` writes -inf over the
forbidden tokens of those rows in place just before the draw (one launch; unconstrained rows cost nothing),
adding no host sync (vLLM orders it the same way). With drafts, each verified row has its own mask: the
grammar's state after the drafts before that row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from deepinfer.frozen_init import fast_init
from deepinfer.kv.storage import KVStorage
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.parallel.context import ContextShare, forward_with_share
from deepinfer.model.step_index import HostRuns, build_slot_index
from deepinfer.ops.table import REF
from deepinfer.runner.cuda_graphs import DecodeGraphs
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.mtp_graphs import MTPGraphs
from deepinfer.runner.speculative import MTPDrafter, Readback, verify
from deepinfer.runner.step_shift import StepShift
from deepinfer.runner.transfer import to_device
from deepinfer.sampling import TokenLogprobs
from deepinfer.sampling.logprobs import LogprobTensors
from deepinfer.sampling.sampler import argmax_tokens, draw
from deepinfer.sched.plan import StepPlan
from deepinfer.structured.backend import StepMasks, words_of


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class SeqSamples:
    seq_id: str
    token_ids: tuple[int, ...]  # the emitted tokens (with drafts: the accepted ones plus the target's next)
    logprobs: tuple[TokenLogprobs | None, ...]
    drafts: tuple[int, ...] = ()  # the MTP layer's drafts for the tokens after these


_NO_LOGPROBS = (None,)  # SeqSamples.logprobs of one token drawn without logprobs


@dataclass(frozen=True, slots=True)
class PromptLogprobChunk:
    seq_id: str
    first_target: int  # prompt index of the first target token covered
    values: tuple[TokenLogprobs, ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: tuple[SeqSamples, ...] = ()
    prompt_logprobs: tuple[PromptLogprobChunk, ...] = ()
    # A plain decode step's draws (one per drawing sequence, no logprobs, no drafts) as (seq ids, tokens), with
    # ``sampled`` left empty: no object per sequence and step. ``samples()`` reads either form.
    plain: tuple[tuple[str, ...], list[int]] | None = None

    def samples(self) -> tuple[SeqSamples, ...]:
        if self.plain is None:
            return self.sampled
        return tuple(SeqSamples(seq_id, (token,), _NO_LOGPROBS) for seq_id, token in zip(*self.plain))


@dataclass(frozen=True, slots=True)
class _Draws:
    """Where a step's draws go: per drawing sequence, its id and its rows among the drawn rows."""

    seq_ids: tuple[str, ...]
    counts: tuple[int, ...]
    num_logprobs: tuple[int | None, ...]  # per drawn row
    proposers: tuple[int, ...] = ()  # indices into seq_ids of the sequences that got drafts


class StepHandle:
    """A submitted step. Its result tensors were copied towards the host when it was submitted;
    ``result()`` waits for those copies (not for later steps) and builds plain Python values."""

    def __init__(self, draws: _Draws | None = None, tokens: torch.Tensor | None = None,
                 logprobs: LogprobTensors | None = None, prompt: list | None = None,
                 done: torch.cuda.Event | None = None, spec: tuple[torch.Tensor, Readback] | None = None) -> None:
        self._draws, self._tokens, self._logprobs, self._prompt, self._done = draws, tokens, logprobs, prompt, done
        self._spec = spec  # speculative steps: (host copy of the packed results, its layout)
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            if self._done is not None:
                self._done.synchronize()
            d = self._draws
            if (d is not None and d.seq_ids and self._spec is None and self._logprobs is None
                    and len(d.counts) == len(self._tokens)):
                # One draw per sequence and no logprobs (a plain decode step): the tokens as they are.
                self._result = StepResult((), self._prompt_chunks(), (d.seq_ids, self._tokens.tolist()))
            else:
                self._result = StepResult(self._sampled(), self._prompt_chunks())
        return self._result

    def _sampled(self) -> tuple[SeqSamples, ...]:
        d = self._draws
        if d is None or not d.seq_ids:
            return ()
        if self._spec is not None:  # one read: emitted tokens and next drafts together
            packed, layout = self._spec
            emitted, drafted = layout.unpack(packed.tolist())
            drafts = dict(zip(d.proposers, drafted))
        else:
            tokens = self._tokens.tolist()
            emitted, drafts, row = [], {}, 0
            for k in d.counts:
                emitted.append(tokens[row : row + k])
                row += k
        lps: list[TokenLogprobs | None] = [None] * sum(d.counts)
        if self._logprobs is not None:
            want = [b for b, n in enumerate(d.num_logprobs) if n is not None]
            for b, lp in zip(want, self._logprobs.resolve([d.num_logprobs[b] for b in want])):
                lps[b] = lp
        out, row = [], 0
        for s, (seq_id, k) in enumerate(zip(d.seq_ids, d.counts)):
            mine = emitted[s]  # verified: the accepted drafts' draws and the one after them
            out.append(SeqSamples(seq_id, tuple(mine), tuple(lps[row : row + len(mine)]), tuple(drafts.get(s, ()))))
            row += k
        return tuple(out)

    def _prompt_chunks(self) -> tuple[PromptLogprobChunk, ...]:
        if not self._prompt:
            return ()
        tensors, jobs = self._prompt
        values = tensors.resolve([k for _, _, n, k in jobs for _ in range(n)])
        out, row = [], 0
        for seq_id, first_target, n, _ in jobs:
            out.append(PromptLogprobChunk(seq_id, first_target, values[row : row + n]))
            row += n
        return tuple(out)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    # From the GPU: an asynchronous copy into pinned memory, ordered after the kernels that produce it.
    return t.to("cpu", non_blocking=True) if t.is_cuda else t


class ModelRunner:
    def __init__(self, model: DeepseekV4, storage: KVStorage, batch: InputBatch,
                 graphs: DecodeGraphs | None = None, speculative: bool = False,
                 mtp_graphs: MTPGraphs | None = None, drafter=None) -> None:
        self.model, self.storage, self.batch, self.graphs = model, storage, batch, graphs
        # Speculative decoding: the MTP layer runs after every step (its cache needs every position). With
        # graphs, ``graphs`` are the verify steps' (k + 1 tokens per sequence, streams kept) and
        # ``mtp_graphs`` the MTP passes'. ``drafter``: another drafter with ``MTPDrafter.propose``'s
        # contract (V4.1: ``runner/dspark.DSparkDrafter``), used instead.
        self.drafter = drafter or (MTPDrafter(model, storage, batch, mtp_graphs) if speculative else None)
        self.device = next(model.parameters()).device
        # A model that lays its step out from each sequence's count and end gets them as host values
        # (``StepIndex.host``; V4.1's step) rather than reading the device index back.
        self.host_runs = bool(getattr(model, "wants_host_runs", False))
        self.window = model.cfg.sliding_window

    def submit(self, plan: StepPlan, masks: Callable[[], StepMasks | np.ndarray | None] | None = None,
               share: ContextShare | None = None) -> StepHandle:
        """Run ``plan``; ``masks`` (constrained steps): called once the forward is launched, it returns the
        grammar masks of the step's constrained drawn rows (or [drawn rows, words] int32, rows without a
        constraint all bits set). ``share``: this rank's part in a context-parallel chunk
        (``model/parallel/context.py``), run with the plan's work."""
        self.batch.apply(plan)
        if plan.empty:
            if share is not None:  # a helper without work of its own: its share of the chunk only
                forward_with_share(self.model, self.storage, share)
            return StepHandle()
        batch, work = self.batch, plan.work
        slot_of = batch.slot_of
        # The work items' numbers in one pass: slot, first position, inputs, draws, drafts, replay boundary.
        cols = np.array([(slot_of[w.seq_id], w.first_pos, len(w.token_ids) + w.num_placeholders, w.num_samples,
                          w.num_drafts, w.emit_from) for w in work], dtype=np.int64).reshape(len(work), 6)
        slots, first, lens = cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy()
        draws, drafted, replays = cols[:, 3], cols[:, 4], cols[:, 5]
        starts = np.cumsum(lens) - lens
        ids = np.fromiter(chain.from_iterable(w.token_ids + (-1,) * w.num_placeholders for w in work),
                          dtype=np.int64, count=int(lens.sum()))
        placeholders = self._placeholders(work, slots, starts)
        shift = StepShift.of(work, slots.tolist(), batch)  # a verify step in flight (async speculation)
        draw_rows, draw_slots, draw_pos, last_rows, counts, history = [], [], [], [], [], []
        n = len(work)
        plain_decode = int(lens.max()) == 1 and int(draws.min()) == 1 and not drafted.any()
        if plain_decode:
            # A decode step (one input and one draw per sequence, no drafts): what the loop below builds, at
            # once. Row i is sequence i's; its token goes to the position after its input.
            draw_rows, draw_slots, draw_pos = list(range(n)), slots.tolist(), (first + 1).tolist()
            last_rows, counts, history = list(range(n)), [1] * n, [()] * n
            work_rows = ()
        else:
            work_rows = zip(work, slots.tolist(), starts.tolist())
        for w, slot, start in work_rows:
            k = w.num_samples
            if k:
                if k > 1 and batch.sampling[slot].has_penalty and (w.num_drafts != k - 1 or w.num_placeholders > 1):
                    # (Placeholder drafts: their penalty counts would need tokens the host does not have.)
                    raise ValueError(f"{w.seq_id}: several draws in one step are not supported with penalties")
                end = start + w.num_tokens
                draw_rows.extend(range(end - k, end))
                draw_slots.extend([slot] * k)
                # The token drawn from row r's logits goes to position (r's position) + 1.
                draw_pos.extend(range(w.first_pos + w.num_tokens - k + 1, w.first_pos + w.num_tokens + 1))
                last_rows.append(len(draw_rows) - 1)
                counts.append(k)
                # Verifying draws see the drafts before them as generated tokens (penalty counts): a draw
                # only counts when those drafts are accepted, i.e. equal to the tokens drawn there.
                drafts = w.token_ids[len(w.token_ids) - w.num_drafts :] if w.num_drafts else ()
                history.extend(drafts[: max(0, i - (k - 1 - w.num_drafts))] for i in range(k))
        jobs = [(w, start) for w, start in zip(work, starts.tolist()) if w.prompt_logprobs is not None]
        prompt_rows = [start + w.prompt_logprobs.offset + i for w, start in jobs
                       for i in range(len(w.prompt_logprobs.targets))]
        q = self.graphs.tokens_per_seq if self.graphs is not None else 0
        # Every sequence draws at each of its q inputs (decode; with speculation, a full verify step).
        graph_ok = (self.graphs is not None and share is None and not jobs
                    and self.graphs.fits_slots(len(work), len(ids))
                    and bool((lens == q).all() and (draws == q).all() and not replays.any()))
        streams = index = input_ids = None
        if graph_ok:
            logits = self.graphs.run_slots(ids, slots, first, batch.tables, placeholders, shift)
            if self.drafter is not None:  # the MTP graphs read the verify graph's streams, index and ids
                g = self.graphs.bucket(len(work))
                streams, index, input_ids = g.streams[: len(ids)], g.index, g.ids[: len(ids)]
        else:
            emit_from = replays.tolist()
            if share is None:
                # Whose outputs before the last row nobody reads (V4.1's decoder replay may skip them).
                last_only = tuple(w.num_samples <= 1 and w.prompt_logprobs is None for w in work)
                streams, index, input_ids = self._forward(ids, slots, first, lens, placeholders, emit_from, last_only,
                                                          shift)
            else:
                streams, index, input_ids = self._forward_share(ids, slots, first, lens, placeholders, emit_from,
                                                                work, share)
            rows = draw_rows + prompt_rows
            logits = (self.model.logits(streams[to_device(rows, torch.int64, self.device)]) if rows
                      else streams.new_zeros(0, self.model.cfg.vocab_size))
        nd = len(draw_rows)
        handle_args: dict = {}
        tokens = v = None
        if nd:
            drawing = [w for w in work if w.num_samples]
            # The host computes the masks now, while the device runs the forward launched above.
            bitmask = masks() if masks is not None else None
            if bitmask is None:
                bitmask = self._plan_masks(drawing, last_rows)
            tokens, extra = self._draw(logits[:nd], drawing, draw_slots, draw_pos, last_rows, counts,
                                       history if any(w.num_drafts for w in drawing) else None, bitmask,
                                       shift.draws if shift is not None else None)
            handle_args.update(extra)
            if self.drafter is not None:  # the batched acceptance (without drafts: every draw is kept)
                draw_starts = [start for w, start in zip(work, starts.tolist()) if w.num_samples]
                v = verify(tokens, drawing, self.device, input_ids, draw_starts)
                batch.record([slot for w, slot in zip(work, slots.tolist()) if w.num_samples], tokens, v.last, v.keep,
                             draw_slots, v.shift)
            else:
                handle_args["tokens"] = _to_host(tokens)
                # A decode step's last rows are all of them: its drawing slots are the rows' (one list, one copy).
                last_slots = draw_slots if plain_decode else [draw_slots[i] for i in last_rows]
                batch.record(last_slots, tokens, last_rows, None, draw_slots)
        if self.drafter is not None:
            drafts = self.drafter.propose(streams, input_ids, index, work, starts.tolist(), slots.tolist(),
                                          draw_rows, tokens, v.kept if v is not None else None, graphed=graph_ok,
                                          shift=shift.seqs if shift is not None else None)
            if v is not None:
                if drafts is not None:
                    batch.record_drafts([slot for w, slot in zip(work, slots.tolist())
                                         if w.num_samples and w.num_proposals], drafts)
                    drawing_ids = [w for w in work if w.num_samples]
                    props = tuple(i for i, w in enumerate(drawing_ids) if w.num_proposals)
                    handle_args["draws"] = dataclasses.replace(handle_args["draws"], proposers=props)
                # Emitted tokens and next drafts reach the host in one copy (one read in ``result``).
                packed, layout = Readback.pack(v, drafts)
                handle_args["spec"] = (_to_host(packed), layout)
        if jobs:
            handle_args["prompt"] = self._prompt_logprobs(logits[nd:].float(), [w for w, _ in jobs])
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return StepHandle(**handle_args, done=done)

    def _draw(self, logits: torch.Tensor, work, slots: list[int], positions: list[int], last_rows: list[int],
              counts: list[int], history: list[tuple[int, ...]] | None,
              bitmask: StepMasks | np.ndarray | None = None,
              shift: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Draw a token from each row of ``logits`` (``work``: the drawing works, in order); the tokens and
        the StepHandle fields that describe them (the caller ships the tokens). ``history``: per row, drafts
        that precede it; ``bitmask``: per row, the allowed tokens (structured outputs); ``shift``: per row,
        on the device, how far its position moves (``StepShift.draws``)."""
        batch = self.batch
        seq_ids = tuple(w.seq_id for w in work)
        if bitmask is not None:  # in place, in the logits' dtype: -inf and the float32 conversion commute
            self._apply_grammar_masks(logits, bitmask)
        if batch.plain_greedy(slots, positions):
            # Greedy rows with nothing to apply: the sampler would return this argmax (the conversion to
            # float32 is exact, so it is skipped too); a dozen fewer small launches per step.
            tokens = argmax_tokens(logits)
            return tokens, {"draws": _Draws(seq_ids, tuple(counts), (None,) * len(slots))}
        logits = logits.float()
        t = batch.sampling_tensors(slots, positions, history, shift)
        tokens = draw(logits, t)
        out = {"draws": _Draws(seq_ids, tuple(counts), t.num_logprobs)}
        lp_rows = [b for b, n in enumerate(t.num_logprobs) if n is not None]
        if lp_rows:
            idx = to_device(lp_rows, torch.int64, self.device)
            lp = LogprobTensors.compute(logits[idx], tokens[idx], max(t.num_logprobs[b] for b in lp_rows))
            out["logprobs"] = LogprobTensors(*(_to_host(x) for x in (lp.token_ids, lp.chosen, lp.ranks, lp.top_vals,
                                                                    lp.top_ids)))
        return tokens, out

    def _plan_masks(self, drawing, last_rows: list[int]) -> StepMasks | None:
        """The masks a plan carries in its work items (the parallel engine's): a work's ``grammar_masks`` are
        those of its last draws, up to the one at ``last_rows`` (a verify step: one per verified position)."""
        owned = [(w, row) for w, row in zip(drawing, last_rows) if w.grammar_masks]
        if not owned:
            return None
        for w, _ in owned:
            if len(w.grammar_masks) > w.num_samples:
                raise ValueError(f"{w.seq_id}: {len(w.grammar_masks)} grammar masks for {w.num_samples} draws")
        words = (self.model.cfg.vocab_size + 31) // 32
        masks = StepMasks.allocate(sum(len(w.grammar_masks) for w, _ in owned), words,
                                   pin_memory=self.device.type == "cuda")
        at = 0
        for w, row in owned:
            n = len(w.grammar_masks)
            masks.rows[at : at + n] = range(row - n + 1, row + 1)
            for i, mask in enumerate(w.grammar_masks):
                masks.words[at + i] = words_of(mask)[:words]
            at += n
        return masks

    def _apply_grammar_masks(self, logits: torch.Tensor, masks: StepMasks | np.ndarray) -> None:
        """Disallowed tokens of constrained draws to -inf, in place (``masks`` as an array: every drawn row's,
        rows without a constraint all bits set)."""
        words = (logits.shape[1] + 31) // 32
        cuda = self.device.type == "cuda"
        if isinstance(masks, np.ndarray):
            if masks.shape[0] != len(logits) or masks.shape[1] < words:
                raise ValueError(f"grammar masks: expected {len(logits)} rows of >= {words} words, got {masks.shape}")
            masks = StepMasks.of_rows(masks, range(len(logits)), words, pin_memory=cuda)
        if masks.num_words < words or (masks.num_rows and int(masks.rows.max()) >= len(logits)):
            raise ValueError(f"grammar masks: rows below {len(logits)} of >= {words} words expected, got "
                             f"{masks.num_rows} rows of {masks.num_words}")
        flat = masks.host.to(self.device, non_blocking=True) if cuda else masks.host
        getattr(self.model, "ops", REF).token_mask(logits, *masks.split(flat))

    def _placeholders(self, work, slots: np.ndarray, starts: np.ndarray):
        """(flat rows, device values) of the inputs still on the device, or None: a work's last input, or
        (async speculation) all of its inputs, the last emitted token and the drafts of its step in flight."""
        rows, owners, cols = [], [], []
        for w, slot, start in zip(work, slots.tolist(), starts.tolist()):
            m = w.num_placeholders
            if m:
                if m != 1 and (w.token_ids or m != w.num_drafts + 1 or self.batch.drafts is None):
                    raise ValueError(f"{w.seq_id}: {m} placeholder inputs; the step in flight drew one (and "
                                     f"proposed the {w.num_drafts} drafts verified)")
                end = start + w.num_tokens
                rows.extend(range(end - m, end))
                owners.extend([slot] * m)
                cols.extend(range(m))
        if not rows:
            return None
        n = len(rows)
        t = to_device(rows + owners + cols, torch.int64, self.device)
        return t[:n], self.batch.placeholder_values(t[n : 2 * n], t[2 * n :])

    def _forward(self, ids: np.ndarray, slots, first, lens, placeholders, emit_from: list[int],
                 last_row_only: tuple[bool, ...], shift: StepShift | None = None):
        """The target's final streams [T, N, H] of the step, with its index and input ids (the MTP layer
        reuses both). ``emit_from``: per sequence, the bounded replay's boundary (0: none); ``last_row_only``:
        per sequence, whether only its last row's output is read (``StepIndex.last_row_only``); ``shift``:
        moves the index's positions on the device (a verify step in flight)."""
        index = build_slot_index(slots, first, lens, self.batch.tables, self.storage, self.window,
                                 pin_memory=self.device.type == "cuda", last_row_only=last_row_only).to(self.device)
        if shift is not None:
            shift.apply(index)
        if any(emit_from):
            index = dataclasses.replace(index, emit_from=to_device(emit_from, torch.int64, self.device))
        if self.host_runs and shift is None:  # a shifted index's positions moved on the device: read there
            index = dataclasses.replace(index, host=HostRuns.of(first, lens, emit_from))
        input_ids = to_device(ids, torch.int64, self.device)
        if placeholders is not None:
            input_ids[placeholders[0]] = placeholders[1]
        return self.model(input_ids, None, self.storage, index), index, input_ids

    def _forward_share(self, ids: np.ndarray, slots, first, lens, placeholders, emit_from: list[int], work,
                       share: ContextShare):
        """``_forward`` of a context-parallel step: on the chunk's owner the chunk's run is taken out of the
        batch and comes back as the whole chunk's streams; the other runs (and a helper's) go as usual.
        Returns the streams in the step's token order, no index (no drafter runs in such worlds)."""
        k = next((i for i, w in enumerate(work) if w.seq_id == share.seq_id), None) if share.is_owner else None
        if share.is_owner and k is None:
            raise ValueError(f"context parallel: {share.seq_id!r} is not in this rank's step")
        input_ids = to_device(ids, torch.int64, self.device)
        if placeholders is not None:
            input_ids[placeholders[0]] = placeholders[1]
        starts = np.cumsum(lens) - lens
        own = [i for i in range(len(work)) if i != k]
        own_rows = np.concatenate([np.arange(starts[i], starts[i] + lens[i]) for i in own]) if own else None
        own_ids = own_index = chunk_index = None
        if own:
            sel = np.array(own)
            own_ids = input_ids[to_device(own_rows, torch.int64, self.device)]
            own_index = self._index(slots[sel], first[sel], lens[sel], [emit_from[i] for i in own])
        if k is not None:
            chunk_index = self._index(slots[k : k + 1], first[k : k + 1], lens[k : k + 1], emit_from[k : k + 1])
        own_streams, chunk_streams = forward_with_share(self.model, self.storage, share, own_ids, own_index,
                                                        chunk_index)
        if k is None:
            return own_streams, None, input_ids
        streams = chunk_streams.new_empty(len(ids), *chunk_streams.shape[1:])
        streams[int(starts[k]) : int(starts[k] + lens[k])] = chunk_streams
        if own:
            streams[to_device(own_rows, torch.int64, self.device)] = own_streams
        return streams, None, input_ids

    def _index(self, slots, first, lens, emit_from: list[int]):
        index = build_slot_index(slots, first, lens, self.batch.tables, self.storage, self.window,
                                 pin_memory=self.device.type == "cuda").to(self.device)
        if any(emit_from):
            index = dataclasses.replace(index, emit_from=to_device(emit_from, torch.int64, self.device))
        return dataclasses.replace(index, host=HostRuns.of(first, lens, emit_from)) if self.host_runs else index


    def _prompt_logprobs(self, logits: torch.Tensor, work) -> tuple[LogprobTensors, list]:
        jobs = [w.prompt_logprobs for w in work]
        targets = to_device([t for j in jobs for t in j.targets], torch.int64, self.device)
        lp = LogprobTensors.compute(logits, targets, max(j.num_logprobs for j in jobs))
        host = LogprobTensors(*(_to_host(x) for x in (lp.token_ids, lp.chosen, lp.ranks, lp.top_vals, lp.top_ids)))
        return host, [(w.seq_id, j.first_target, len(j.targets), j.num_logprobs) for w, j in zip(work, jobs)]
