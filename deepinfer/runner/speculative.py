"""Speculative decoding with the checkpoint's MTP layer: verifying drafts and proposing the next ones.

Verification is *coupled* (determinism.md §2.8): a step draws the target's own token at every verified
position exactly as a plain decode step would (same sampler, same (seed, position) noise, penalty counts
that include the drafts before the position), and a draft is accepted iff it equals that draw. The
emitted tokens are therefore the target's draws at positions whose history is the accepted prefix, i.e.
the tokens the sequence produces without speculation; drafts only decide how many positions one step
covers. Greedy rows are the special case "accept the longest prefix equal to the argmax, plus the target's
token".

Proposing (architecture note §2.7, §3.6): the MTP layer at target position p reads the target's final
streams at p and token p + 1, writes its own sliding-window row at p, and predicts token p + 2. Every step
runs it over all of the step's rows (prompt chunks too, so its window is filled before the first draft),
with token p + 1 being the next input, the step's draw at p, or the chunk's known next token; rows past a
rejected draft write MTP rows past the rolled-back length, which later steps rewrite before reading. The
first draft comes from the row of the last emitted token; the chain then feeds the MTP layer's own output
streams back, one position further each time, for up to k drafts. A window row needs only the layer's
attention half, so over the step's rows the FFN half (its MoE: 4 tokens of a k = 3 verify step hit ~4x
the experts of one) runs at the proposers' base rows alone.

Draft tokens are a free choice for correctness (the target decides every emitted token), so they are
picked to agree with the coming draw as often as possible: greedy rows take the argmax; sampled rows take
argmax(logits / T + the Gumbel noise the target will use at that position) -- the MTP layer's own guess at
the target's seeded draw. Sharing the target's noise cannot bias the output because acceptance only
compares a draft with the draw; the draft salt (``SALT_DRAFT``) exists for rejection sampling, which this
engine does not use.

Host work per step: the acceptance (``sampling/speculative.py``: ``accept_drafts``) and the MTP passes with
their head and pick (``runner/mtp_steps.py``) are device functions over the whole batch, fed by one upload
of host-known row lists each; nothing in between reads the device (the chain's positions are built for full
acceptance and moved by the accepted counts on the device), and the step's results go back in one packed
copy (``Readback``).
"""


from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.step_index import StepIndex, build_slot_index
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.mtp_graphs import MTPGraphs
from deepinfer.runner.mtp_steps import chain_step, rows_and_first_draft
from deepinfer.runner.transfer import to_device
from deepinfer.sampling.params import GREEDY_TEMPERATURE_EPS
from deepinfer.sampling.speculative import FREE, NO_DRAFT, accept_drafts
from deepinfer.sched.plan import SeqWork, StepPlan


@dataclass(frozen=True, slots=True, eq=False)
class Verification:
    """The accepted drafts of one step's drawing sequences (all on the device)."""

    accepted: torch.Tensor  # [S] int64: drafts accepted per drawing sequence
    keep: torch.Tensor  # [D] bool: drawn rows whose token is emitted (the first accepted + 1 of each)
    last: torch.Tensor  # [S] int64: drawn-row index of each sequence's last emitted token
    emitted: torch.Tensor  # [S, W] int64: each sequence's emitted tokens, -1 after them (W: most draws)
    kept: torch.Tensor  # [S] int64: emitted tokens per sequence (accepted drafts + the target's next)
    shift: torch.Tensor  # [S] int64: accepted - verified drafts (<= 0): how far the next step's positions move


def verify(tokens: torch.Tensor, work: list[SeqWork], device: torch.device, input_ids: torch.Tensor | None = None,
           starts: list[int] | None = None) -> Verification:
    """Compare each drawing sequence's drafts with its draws (``tokens``: the drawn rows, sequence by
    sequence, ``w.num_samples`` each); the draw after the last draft has nothing to compare (never kept
    back: it is the target's own token). The host lays the batch out as a [sequences, most draws] matrix
    with numpy (no loop over rows) and ships it in one copy; the comparison is ``accept_drafts``. Drafts
    the host does not know (placeholders: async scheduling) are read from the step's ``input_ids`` on the
    device (``starts``: each work's first input row)."""
    k = np.fromiter((w.num_samples for w in work), dtype=np.int64, count=len(work))
    d = np.fromiter((w.num_drafts for w in work), dtype=np.int64, count=len(work))
    s, width, nd = len(work), int(k.max()), int(k.sum())
    off = np.cumsum(k) - k  # each sequence's first drawn row
    # The drafts are the last num_drafts inputs and a draw predicts the input after its row, so the draws
    # from ``lead`` on are compared with the drafts, in order.
    lead = k - 1 - d  # draws before the first draft-verifying one (0 for a verify step)
    col = np.arange(width)[None, :]
    rel = col - lead[:, None]  # the draft a column's draw verifies
    targets = np.where(col < lead[:, None], FREE, NO_DRAFT)
    is_draft = (rel >= 0) & (rel < d[:, None])
    unknown = [i for i, w in enumerate(work) if len(w.token_ids) < w.num_drafts]  # placeholder drafts
    cells = rows = np.zeros(0, dtype=np.int64)
    if unknown:
        # Their cells (flat, in [sequences, most draws]) and input rows: the device fills them below.
        cells = np.flatnonzero(is_draft[unknown].ravel())
        cells = np.asarray(unknown, dtype=np.int64)[cells // width] * width + cells % width
        ends = [starts[i] + work[i].num_tokens for i in unknown]
        rows = np.concatenate([np.arange(e - work[i].num_drafts, e) for i, e in zip(unknown, ends)])
        is_draft[unknown] = False
    known = (w.token_ids[len(w.token_ids) - w.num_drafts :] for w in work
             if w.num_drafts and len(w.token_ids) >= w.num_drafts)
    targets[is_draft] = np.fromiter(chain.from_iterable(known), dtype=np.int64, count=int(is_draft.sum()))
    draw_idx = off[:, None] + np.minimum(col, k[:, None] - 1)  # padding repeats the last draw
    seg = np.repeat(np.arange(s), k)
    local = np.arange(nd) - off[seg]
    host = np.concatenate([draw_idx.ravel(), targets.ravel(), seg, local, off, lead, d, cells, rows])
    t = to_device(host, torch.int64, device)
    n2, nu = s * width, len(cells)
    draw_t, target_t = t[:n2].view(s, width), t[n2 : 2 * n2]
    seg_t, local_t = t[2 * n2 : 2 * n2 + nd], t[2 * n2 + nd : 2 * n2 + 2 * nd]
    at = 2 * n2 + 2 * nd
    off_t, lead_t, d_t = t[at : at + s], t[at + s : at + 2 * s], t[at + 2 * s : at + 3 * s]
    if nu:
        cells_t, rows_t = t[at + 3 * s : at + 3 * s + nu], t[at + 3 * s + nu :]
        target_t = target_t.index_put((cells_t,), input_ids[rows_t])
    emitted, kept = accept_drafts(tokens[draw_t], target_t.view(s, width))
    accepted = kept - 1 - lead_t
    return Verification(accepted=accepted, keep=local_t < kept[seg_t], last=off_t + kept - 1, emitted=emitted,
                        kept=kept, shift=accepted - d_t)


@dataclass(frozen=True, slots=True)
class Readback:
    """Where a speculative step's results sit in the one int64 tensor copied to the host (``pack``):
    [kept (S) | emitted (S x width) | drafts (proposers x max proposals)]."""

    num_seqs: int
    width: int
    num_proposers: int
    max_proposals: int

    @staticmethod
    def pack(v: Verification, drafts: torch.Tensor | None) -> tuple[torch.Tensor, "Readback"]:
        parts = [v.kept, v.emitted.reshape(-1)] + ([drafts.reshape(-1)] if drafts is not None else [])
        m, c = drafts.shape if drafts is not None else (0, 0)
        return torch.cat(parts), Readback(len(v.kept), v.emitted.shape[1], m, c)

    def unpack(self, values: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(emitted tokens per sequence, drafts per proposer without the -1 padding)."""
        s, w, c = self.num_seqs, self.width, self.max_proposals
        kept, base = values[:s], s
        tokens = [values[base + i * w : base + i * w + kept[i]] for i in range(s)]
        base += s * w
        drafts = [[t for t in values[base + i * c : base + (i + 1) * c] if t >= 0] for i in range(self.num_proposers)]
        return tokens, drafts


def mtp_passes(plan: StepPlan) -> int:
    """How many MTP passes with an FFN half (the MoE, whose expert-parallel collectives every rank joins)
    ``MTPDrafter.propose`` runs for ``plan``: one over the step's rows plus one chained pass per further
    draft of its most demanding proposer; none when nobody drafts (the pass over the rows then only fills
    the window). Host-known, so a parallel engine can have ranks with fewer passes join the others'."""
    return max((w.num_proposals for w in plan.work if w.num_samples), default=0)


class MTPDrafter:
    """Runs the MTP layer after a step's target forward and returns the next drafts."""

    def __init__(self, model: DeepseekV4, storage: KVStorage, batch: InputBatch,
                 graphs: MTPGraphs | None = None) -> None:
        self.model, self.storage, self.batch = model, storage, batch
        self.graphs = graphs  # CUDA graphs of the MTP passes (``runner/mtp_graphs.py``), used when they fit
        self.window = model.cfg.sliding_window
        self.device = next(model.parameters()).device

    def propose(self, streams: torch.Tensor, input_ids: torch.Tensor, index: StepIndex, work, starts: list[int],
                slots: list[int], draw_rows: list[int], tokens: torch.Tensor | None,
                kept: torch.Tensor | None, graphed: bool = False,
                shift: torch.Tensor | None = None) -> torch.Tensor | None:
        """Fill the MTP layer's cache for every row of the step and draft for the works that ask.

        ``draw_rows``/``tokens``: the step's drawn rows and their tokens; ``kept``: per drawing work (in
        order) its emitted tokens (None: every draw); ``graphed``: the target ran in a verify graph
        (``streams`` and ``index`` are its static ones), so the pass over the rows replays the matching MTP
        graph. ``shift``: per work, how far the step's positions were moved on the device (its verify
        step in flight, ``runner/step_shift.py``; ``index`` is moved already). Returns [proposers, max
        proposals] int64 (-1 past a work's count), or None when no work asks. Reads nothing back from the
        device: the chain's step indexes are built on the host at the positions of full acceptance and
        moved by the accepted counts (and ``shift``) on the device."""
        dev, batch = self.device, self.batch
        next_ids = torch.empty_like(input_ids)
        next_ids[:-1] = input_ids[1:]
        fixed_rows, fixed_ids = [], []
        for w, start in zip(work, starts):
            if not w.num_samples:
                if w.next_token < 0:
                    raise ValueError(f"{w.seq_id}: a step that draws nothing must carry its next token")
                fixed_rows.append(start + w.num_tokens - 1)
                fixed_ids.append(w.next_token)
        drawing = [i for i, w in enumerate(work) if w.num_samples]
        props = [(d, i) for d, i in enumerate(drawing) if work[i].num_proposals]
        m = len(props)
        pw = [work[i] for _, i in props]
        counts = np.fromiter((w.num_proposals for w in pw), dtype=np.int64, count=m)
        samples = np.fromiter((w.num_samples for w in pw), dtype=np.int64, count=m)
        prop_slots = np.fromiter((slots[i] for _, i in props), dtype=np.int64, count=m)
        # A proposer's first drawn row; its base row (last emitted token) is that + kept - 1.
        first_draw = np.fromiter((starts[i] + work[i].num_tokens - work[i].num_samples for _, i in props),
                                 dtype=np.int64, count=m)
        # One upload: [fixed rows | fixed ids | drawn rows | proposers' drawing index | first drawn rows | slots
        # | draws - 1 (the base row's offset at full acceptance) | proposers' work index].
        host = np.concatenate([np.asarray(fixed_rows + fixed_ids + draw_rows, dtype=np.int64),
                               np.fromiter((d for d, _ in props), dtype=np.int64, count=m), first_draw, prop_slots,
                               samples - 1, np.fromiter((i for _, i in props), dtype=np.int64, count=m)])
        t = to_device(host, torch.int64, dev)
        nf, nd = len(fixed_rows), len(draw_rows)
        if nf:
            next_ids[t[:nf]] = t[nf : 2 * nf]
        if nd:
            next_ids[t[2 * nf : 2 * nf + nd]] = tokens
        p = t[2 * nf + nd :]
        sampled = any(batch.sampling[s].temperature >= GREEDY_TEMPERATURE_EPS for s in prop_slots.tolist())
        if m:
            full = p[3 * m : 4 * m]
            offset = kept[p[:m]] - 1 if kept is not None else full
            base_rows = p[m : 2 * m] + offset
            temperature, seeds = batch.draft_params(p[2 * m : 3 * m])
        if graphed:
            x, draft = self.graphs.run_rows(len(work), next_ids, base_rows if m else None,
                                            temperature if m else None, seeds if m else None, sampled)
        elif m:
            x, draft = rows_and_first_draft(self.model, self.storage, streams, next_ids, index, base_rows,
                                            temperature, seeds, sampled)
        else:  # nothing to draft from: the rows only fill the MTP layer's window (no FFN half)
            self.model.mtp_forward(streams, next_ids, None, self.storage, index=index, rows=next_ids[:0])
        if not m:
            return None
        width = int(counts.max())
        out = torch.full((m, width), -1, dtype=torch.int64, device=dev)
        out[:, 0] = draft
        if width == 1:
            return out
        # The chain's index is built at the positions of full acceptance (the last drawn row's, + j) and moved
        # back on the device by offset - (samples - 1) = -(rejected drafts), and by the step's own shift.
        last_pos = np.fromiter((w.first_pos + w.num_tokens - 1 for w in pw), dtype=np.int64, count=m)
        shift = offset - full if shift is None else offset - full + shift[p[4 * m :]]
        active = np.arange(m)
        for j in range(1, width):
            keep = np.flatnonzero(counts[active] > j)
            if len(keep) < len(active):
                sel = to_device(keep, torch.int64, dev)
                x, draft, shift, temperature, seeds = x[sel], draft[sel], shift[sel], temperature[sel], seeds[sel]
                active = active[keep]
            q = last_pos[active] + j  # the MTP position whose next token is the previous draft (at full acceptance)
            chain_slots = prop_slots[active]
            if self.graphs is not None and len(active) <= self.graphs.max_chain:
                x, draft = self.graphs.run_chain(x, draft, chain_slots, q, batch.tables, shift, temperature, seeds,
                                                 sampled)
            else:
                index_j = build_slot_index(chain_slots, q, np.ones(len(active), dtype=np.int64), batch.tables,
                                           self.storage, self.window, pin_memory=dev.type == "cuda").to(dev)
                x, draft = chain_step(self.model, self.storage, x, draft, index_j, shift, temperature, seeds, sampled)
            if len(active) == m:
                out[:, j] = draft
            else:
                out[to_device(active, torch.int64, dev), j] = draft
        return out
