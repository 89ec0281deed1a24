"""Which grammar masks a step needs, and when they are computed.

A step's drawn rows are its drawing works' ``num_samples`` rows each, in plan order. A constrained
sequence's rows get ``MaskJob``s: in a plain step one row, the matcher's next-token mask; in a verify step
(speculative decoding) one row per verified position, the mask of the matcher advanced over the drafts
before it (``GrammarBackend.fill`` advances over the drafts tentatively and rolls back). The engine feeds the
matcher the accepted tokens afterwards, as in a plain step, so a rejected draft never reaches it. A sequence
still in its thinking block is unconstrained up to ``</think>``: when a draft is that token, the rows after
it are masked from the grammar's start.

Single-process engine (``mask_source``): the masks are computed by the runner's callback once the step's
forward is launched, so the host's grammar work overlaps the device's forward; only the constrained rows'
(``StepMasks``: their words and row numbers in one host buffer, one upload). Parallel engine
(``with_plan_masks``): the plan is the message to the ranks, so the masks travel in it, computed before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

from deepinfer.structured.backend import GrammarBackend, MaskJob, StepMasks


def mask_jobs(seqs, work) -> tuple[list[MaskJob], int]:
    """The mask jobs of a step (``seqs[i]`` the sequence of ``work[i]``) and its number of drawn rows."""
    jobs, row = [], 0
    for seq, w in zip(seqs, work):
        k = w.num_samples
        if k and seq.grammar is not None and not seq.finished:  # (finished by a late stop: its draw is dropped)
            drafts = tuple(w.token_ids[len(w.token_ids) - w.num_drafts :]) if w.num_drafts else ()
            # Draws other than the one after the last known token and those after drafts cannot be planned
            # (the scheduler draws several times only to verify drafts).
            assert k == len(drafts) + 1, f"{w.seq_id}: {k} draws with {len(drafts)} drafts"
            first = row
            if seq.grammar_after is not None:  # thinking: constrained only after a draft that closes it
                if seq.grammar_after in drafts:
                    i = drafts.index(seq.grammar_after)
                    jobs.append(MaskJob(seq.grammar, first + i + 1, drafts[i + 1 :]))
            else:
                jobs.append(MaskJob(seq.grammar, first, drafts))
        row += k
    return jobs, row


def mask_source(backend: GrammarBackend | None, seqs, work) -> Callable[[], StepMasks] | None:
    """The runner's callback that computes the step's masks (its constrained rows' only), or None."""
    if backend is None:
        return None
    jobs, rows = mask_jobs(seqs, work)
    return partial(backend.fill_rows, jobs, rows) if jobs else None


def with_plan_masks(backend: GrammarBackend | None, schedule):
    """The schedule with each constrained draw's mask in its work item (one draw per sequence)."""
    jobs, rows = mask_jobs(schedule.seqs, schedule.plan.work) if backend is not None else ([], 0)
    if not jobs:
        return schedule
    work = list(schedule.plan.work)
    drawing = [i for i, w in enumerate(work) if w.num_samples]
    if rows != len(drawing):
        raise ValueError("structured outputs: several draws of one sequence in a step need the single-process "
                         "engine")
    bitmask = backend.fill(jobs, rows)
    for j in jobs:
        i = drawing[j.row]
        work[i] = replace(work[i], grammar_mask=bitmask[j.row].tobytes())
    return replace(schedule, plan=replace(schedule.plan, work=tuple(work)))
