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
streams back, one position further each time, for up to k drafts.

Draft tokens are a free choice for correctness (the target decides every emitted token), so they are
picked to agree with the coming draw as often as possible: greedy rows take the argmax; sampled rows take
argmax(logits / T + the Gumbel noise the target will use at that position) -- the MTP layer's own guess at
the target's seeded draw. Sharing the target's noise cannot bias the output because acceptance only
compares a draft with the draw; the draft salt (``SALT_DRAFT``) exists for rejection sampling, which this
engine does not use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.step_index import StepIndex, build_slot_index
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.mtp_graphs import MTPGraphs
from deepinfer.runner.transfer import to_device
from deepinfer.sampling.params import GREEDY_TEMPERATURE_EPS
from deepinfer.sampling.rng import SALT_TARGET, gumbel_noise
from deepinfer.sched.plan import SeqWork

_NONE = 1 << 40  # "no mismatch yet" in the first-mismatch reduction


@dataclass(frozen=True, slots=True, eq=False)
class Verification:
    """The accepted drafts of one step's drawing sequences (all on the device)."""

    accepted: torch.Tensor  # [S] int64: drafts accepted per drawing sequence
    keep: torch.Tensor  # [D] bool: drawn rows whose token is emitted (the first accepted + 1 of each)
    last: torch.Tensor  # [S] int64: drawn-row index of each sequence's last emitted token


def verify(tokens: torch.Tensor, work: list[SeqWork], device: torch.device) -> Verification:
    """Compare each drawing sequence's drafts with its draws (``tokens``: the drawn rows, sequence by
    sequence, ``w.num_samples`` each); the draw after the last draft has nothing to compare (never kept
    back: it is the target's own token)."""
    targets, seg, local, starts = [], [], [], []
    row = 0
    for s, w in enumerate(work):
        k = w.num_samples
        drafts = list(w.token_ids[len(w.token_ids) - w.num_drafts :]) if w.num_drafts else []
        # The drafts are the last num_drafts inputs and a draw predicts the input after its row, so the
        # draws from ``lead`` on are compared with the drafts, in order.
        lead = k - 1 - w.num_drafts  # draws before the first draft-verifying one (0 for a verify step)
        targets += [-1] * lead + drafts + [-1]
        seg += [s] * k
        local += list(range(-lead, k - lead))
        starts.append(row + lead)
        row += k
    n = len(work)
    host = np.asarray(targets + seg + local + starts, dtype=np.int64)
    both = to_device(host, torch.int64, device)
    d = len(targets)
    target, seg_t, local_t, start_t = both[:d], both[d : 2 * d], both[2 * d : 3 * d], both[3 * d :]
    miss = (tokens != target) & (local_t >= 0)
    first_miss = torch.full((n,), _NONE, dtype=torch.int64, device=device).scatter_reduce(
        0, seg_t, torch.where(miss, local_t, _NONE), "amin")
    accepted = first_miss  # the last draw has no draft to match, so at most num_drafts
    keep = local_t <= accepted[seg_t]
    return Verification(accepted, keep, start_t + accepted)


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
                accepted: torch.Tensor | None, graphed: bool = False) -> torch.Tensor | None:
        """Fill the MTP layer's cache for every row of the step and draft for the works that ask.

        ``draw_rows``/``tokens``: the step's drawn rows and their tokens; ``accepted``: per drawing work
        (in order) its accepted drafts; ``graphed``: the target ran in a verify graph (``streams`` and
        ``index`` are its static ones), so the pass over the rows replays the matching MTP graph.
        Returns [proposers, max proposals] int64 (-1 past a work's count), or None when no work asks."""
        dev = self.device
        next_ids = torch.empty_like(input_ids)
        next_ids[:-1] = input_ids[1:]
        fixed_rows, fixed_ids = [], []
        for w, start in zip(work, starts):
            if not w.num_samples:
                if w.next_token < 0:
                    raise ValueError(f"{w.seq_id}: a step that draws nothing must carry its next token")
                fixed_rows.append(start + w.num_tokens - 1)
                fixed_ids.append(w.next_token)
        if fixed_rows:
            pairs = to_device(fixed_rows + fixed_ids, torch.int64, dev)
            next_ids[pairs[: len(fixed_rows)]] = pairs[len(fixed_rows) :]
        if draw_rows:
            next_ids[to_device(draw_rows, torch.int64, dev)] = tokens
        if graphed:
            mtp_streams = self.graphs.run_rows(len(work), next_ids)
        else:
            mtp_streams = self.model.mtp_forward(streams, next_ids, None, self.storage, index=index)

        drawing = [i for i, w in enumerate(work) if w.num_samples]
        props = [(d, i) for d, i in enumerate(drawing) if work[i].num_proposals]
        if not props:
            return None
        pw = [work[i] for _, i in props]
        counts = [w.num_proposals for w in pw]
        # The base row of a proposer: its last emitted token (after ``accepted`` drafts).
        lead = [starts[i] + work[i].num_tokens - work[i].num_samples for _, i in props]
        base_first = [w.first_pos + w.num_tokens - w.num_samples for w in pw]
        host = to_device([d for d, _ in props] + lead + base_first, torch.int64, dev)
        m = len(props)
        acc = accepted[host[:m]] if accepted is not None else torch.zeros(m, dtype=torch.int64, device=dev)
        base_rows, base_pos = host[m : 2 * m] + acc, host[2 * m :] + acc
        prop_slots = [slots[i] for _, i in props]
        x = mtp_streams[base_rows]
        draft = self._pick(self.model.mtp_logits(x), prop_slots, base_pos + 2)
        out = torch.full((m, max(counts)), -1, dtype=torch.int64, device=dev)
        out[:, 0] = draft
        if max(counts) > 1:
            # The chain's positions decide its cache rows, built on the host: one sync for the accepted counts.
            pos_host = np.asarray(base_pos.tolist(), dtype=np.int64)
            active = np.arange(m)
            for j in range(1, max(counts)):
                keep = np.asarray([b for b, a in enumerate(active) if counts[a] > j], dtype=np.int64)
                active = active[keep]
                sel = to_device(keep, torch.int64, dev)
                x, draft = x[sel], draft[sel]
                q = pos_host[active] + j  # the MTP position whose next token is the previous draft
                chain_slots = np.asarray([prop_slots[a] for a in active], dtype=np.int64)
                if self.graphs is not None and len(active) <= self.graphs.max_chain:
                    x, logits = self.graphs.run_chain(x, draft, chain_slots, q, self.batch.tables)
                else:
                    index_j = build_slot_index(chain_slots, q, np.ones(len(active), dtype=np.int64),
                                               self.batch.tables, self.storage, self.window,
                                               pin_memory=dev.type == "cuda").to(dev)
                    x = self.model.mtp_forward(x, draft, None, self.storage, index=index_j)
                    logits = self.model.mtp_logits(x)
                qpos = to_device(q + 2, torch.int64, dev)
                draft = self._pick(logits, [prop_slots[a] for a in active], qpos)
                out[to_device(active, torch.int64, dev), j] = draft
        return out

    def _pick(self, logits: torch.Tensor, slots: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Draft tokens: the argmax for greedy rows; for sampled rows the argmax of the temperature-scaled
        logits plus the target's own Gumbel noise at the drafted position."""
        tokens = torch.argmax(logits, dim=-1)
        rows = [b for b, s in enumerate(slots) if self.batch.sampling[s].temperature >= GREEDY_TEMPERATURE_EPS]
        if not rows:
            return tokens
        dev = logits.device
        idx = to_device(rows, torch.int64, dev)
        temp = to_device([self.batch.sampling[slots[b]].temperature for b in rows], torch.float64, dev)
        seeds = to_device([self.batch.sampling[slots[b]].seed for b in rows], torch.int64, dev)
        noise = gumbel_noise(seeds, positions[idx], logits.shape[1], SALT_TARGET)
        scores = logits[idx].to(torch.float64) / temp[:, None] + noise
        return tokens.index_copy(0, idx, torch.argmax(scores, dim=-1))
