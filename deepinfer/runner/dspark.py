"""Speculative decoding of DeepSeek-V4.1 with its DSpark drafter: proposing the next block after a step.

The runner treats it as it treats V4's MTP layer (``runner/speculative.py``): the step verifies each
decoding sequence's drafts with the coupled rule (``verify``: a draft is kept iff it equals the target's own
draw there, so the tokens are those of plain decoding), then asks the drafter for the next drafts of every
sequence whose work has ``num_proposals``. What differs is where the drafter's state comes from:

  * Context. The target's forward (``model/v41/paged.py``) has already stored the drafter's context row of
    every position it computed, in the ``mtp.S`` window tensors (``kv/spec_v41.py``). The block after the
    last emitted token (position p = the row whose draw is the sequence's newest token, i.e. the first
    draw plus the accepted drafts) reads positions (p - W, p] of those: all from accepted inputs, since
    p is the last accepted one. Rows past p (rejected drafts) are past the length the engine rolls back
    to, and the next step rewrites them before any block reads them. So rollback is "set the length", as
    for every other row, and preemption (recompute) and prefix hits (kept window tails) need nothing else.
  * Block. ``DSpark.draft`` -- the plain module's own function -- runs on the gathered rows, so the engine
    drafts exactly what ``DeepseekV41.propose`` drafts from a per-sequence cache holding the same rows.
    Greedy rows take the argmax of each row's Markov-corrected logits; seeded rows take the argmax of
    logits / T plus the Gumbel noise the target's (seed, position) draw will use there (the drafter's guess
    at the coming draw; ``runner/speculative.py`` says why sharing the noise cannot bias the output).
  * Verify length. A block always drafts ``dspark_block_size`` tokens (its rows attend to each other); the
    work's ``num_proposals`` (k, cut by the output limit) of them are verified next step, or, with
    ``DEEPINFER_ENABLE_MTP_VARLEN=1``, the prefix whose confidence-head survival stays above the threshold
    (``model/v41/speculative.verify_length``, possibly none).

Two paths draft the same blocks. The CPU reference (the plain model's step) drafts one block per sequence
with ``DSpark.draft``, reading the accepted counts and drawn tokens to the host once per step to place each
block. The device build (``PagedV41.key_lists``) drafts every proposer's block at once from device values
(``dspark_lists.draft_lists``): the base position and anchor token move by the accepted counts on the device,
each block's W context slots are looked up there, and the verify length is counted there
(``verify_lengths``), so proposing reads nothing back, as V4's MTP chain does not; the drafts reach the host
with the step's emitted tokens in its one packed copy (``Readback``).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from deepinfer.kv.spec_v41 import dspark_key
from deepinfer.kv.storage import KVStorage
from deepinfer.model.step_index import StepIndex
from deepinfer.model.v41.cache_rows import load_rows
from deepinfer.model.v41.paged import PagedV41
from deepinfer.model.v41.dspark_lists import draft_lists
from deepinfer.model.v41.speculative import verify_length, verify_lengths
from deepinfer.ops.ref.step_rows import lookup
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.transfer import to_device
from deepinfer.sampling.params import GREEDY_TEMPERATURE_EPS
from deepinfer.sampling.rng import SALT_TARGET, gumbel_noise
from deepinfer.sched.plan import SeqWork


class DSparkDrafter:
    """Drafts the next DSpark block of each proposing sequence after a step's verification."""

    def __init__(self, model: PagedV41, storage: KVStorage, batch: InputBatch, varlen: bool) -> None:
        if model.model.mtp is None:
            raise ValueError("dspark: the model was loaded without its DSpark drafter (load_paged_v41(..., "
                             "dspark=True))")
        self.model, self.storage, self.batch, self.varlen = model, storage, batch, varlen
        self.window = model.cfg.sliding_window

    def propose(self, streams: torch.Tensor, input_ids: torch.Tensor, index: StepIndex, work: tuple[SeqWork, ...],
                starts: list[int], slots: list[int], draw_rows: list[int], tokens: torch.Tensor | None,
                kept: torch.Tensor | None, graphed: bool = False,
                shift: torch.Tensor | None = None) -> torch.Tensor | None:
        """``MTPDrafter.propose``'s contract (the runner calls either): [proposers, most proposals] int64, -1
        past each proposer's verify length, or None when no work asks. ``streams``/``input_ids`` are unused
        (the context rows are in the cache already)."""
        if graphed:
            raise ValueError("dspark: no CUDA graphs for the DSpark drafter")
        if shift is not None:  # its positions come from the host's accepted counts
            raise ValueError("dspark: no steps planned before the previous one's drafts are verified")
        drawing = [(i, w) for i, w in enumerate(work) if w.num_samples]
        firsts = np.cumsum([0] + [w.num_samples for _, w in drawing])[:-1]  # each drawing work's first draw
        props = [(d, i, w) for d, (i, w) in enumerate(drawing) if w.num_proposals]
        if not props:
            return None
        if self.model.key_lists:
            return self._propose_lists(index, props, firsts, slots, tokens, kept)
        dev = tokens.device
        d_idx = torch.tensor([d for d, _, _ in props], dtype=torch.int64, device=dev)
        accepted_kept = kept[d_idx] if kept is not None else torch.tensor(
            [w.num_samples for _, _, w in props], dtype=torch.int64, device=dev)
        base = torch.tensor([int(firsts[d]) for d, _, _ in props], dtype=torch.int64, device=dev) + accepted_kept - 1
        # The step's one read for drafting: each proposer's emitted count and newest token.
        host = torch.cat((accepted_kept, tokens[base])).tolist()
        m = len(props)
        out = torch.full((m, max(w.num_proposals for _, _, w in props)), -1, dtype=torch.int64, device=dev)
        mtp, embed, head = self.model.model.mtp, self.model.model.embed, self.model.model.head
        for j, (_, i, w) in enumerate(props):
            n_kept, token = host[j], host[m + j]
            p = w.first_pos + w.num_tokens - w.num_samples + n_kept - 1  # the newest token's row
            block = mtp.draft(embed, head, self._context(index, i, p), p, token, self.model.model.cache_qdq,
                              **self._noise(slots[i], p))
            n = verify_length(block.confidence, w.num_proposals, self.varlen)
            out[j, :n] = block.tokens[:n]
        return out

    def _propose_lists(self, index: StepIndex, props: list[tuple[int, int, SeqWork]], firsts: np.ndarray,
                       slots: list[int], tokens: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """``propose`` of the device build: every proposer's block at once, nothing read back."""
        m, dev = len(props), tokens.device
        counts = np.fromiter((w.num_proposals for _, _, w in props), dtype=np.int64, count=m)
        # One upload: [drawing index | table row | first draw's row | newest row's position before the accepted
        # draws (p = that + emitted) | slot | draws | proposals].
        host = np.concatenate([np.fromiter(chain.from_iterable(
            (d, i, firsts[d], w.first_pos + w.num_tokens - w.num_samples - 1, slots[i], w.num_samples)
            for d, i, w in props), dtype=np.int64, count=6 * m).reshape(m, 6).T.ravel(), counts])
        d_idx, seq, first_draw, before, slot, draws, num = to_device(host, torch.int64, dev).view(7, m)
        emitted = kept[d_idx] if kept is not None else draws
        p = before + emitted  # the newest token's row
        pos = p.unsqueeze(1) - self.window + 1 + torch.arange(self.window, device=dev)
        rows = lookup(index.window_table, seq, pos, index.block_size)
        if dev.type == "cpu" and bool(((pos >= 0) & (rows < 0)).any()):  # a device trusts the manager (paged.py)
            raise IndexError("dspark context: a needed cache block was released or is missing")
        flat = rows.clamp_min(0).flatten()
        context = [load_rows(self.storage, dspark_key(s), "window_kv", flat) for s in range(len(self.model.model.mtp))]
        temperature, seeds = self.batch.draft_params(slot)
        sampled = any(self.batch.sampling[slots[i]].temperature >= GREEDY_TEMPERATURE_EPS for _, i, _ in props)
        mm = self.model.model
        block = draft_lists(mm.mtp, mm.embed, mm.head, context, rows >= 0, p, tokens[first_draw + emitted - 1],
                            mm.cache_qdq, temperature, seeds, sampled)
        width = int(counts.max())
        n = verify_lengths(block.confidence[:, :width], num, self.varlen)
        cols = torch.arange(width, device=dev)
        return torch.where(cols < n.unsqueeze(1), block.tokens[:, :width], -1)

    def _context(self, index: StepIndex, seq: int, p: int) -> list[torch.Tensor]:
        """Each stage's context rows of positions (p - W, p] of the step's sequence ``seq``."""
        pos = torch.arange(max(0, p + 1 - self.window), p + 1, device=index.positions.device)
        rows = lookup(index.window_table, torch.full_like(pos, seq), pos, index.block_size)
        if bool((rows < 0).any()):
            raise IndexError("dspark context: a needed cache block was released or is missing")
        return [load_rows(self.storage, dspark_key(s), "window_kv", rows) for s in range(len(self.model.model.mtp))]

    def _noise(self, slot: int, p: int) -> dict:
        """The target's seeded-draw noise at the block's drafted positions p + 2 .. (sampled rows only)."""
        temperature, seed = self.batch.draft_params(torch.tensor([slot], device=self.batch.last_tokens.device))
        t = float(temperature[0])
        if t < GREEDY_TEMPERATURE_EPS:
            return {}
        cfg = self.model.cfg
        block = cfg.dspark.block_size
        positions = torch.arange(p + 2, p + 2 + block, device=seed.device)
        return {"temperature": t, "noise": gumbel_noise(seed.expand(block), positions, cfg.vocab_size, SALT_TARGET)}
