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
(``with_plan_masks``): the plan is the message to the ranks, so the same rows travel in it, computed before
on the coordinator (where the matchers live), each in its sequence's work item; the ranks apply them before
the acceptance, and the coordinator feeds the matchers the accepted tokens.
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
    """The schedule with each constrained sequence's masks in its work item (``SeqWork.grammar_masks``): the
    rows ``mask_source`` computes for the runner (``fill_rows``: in a verify step one per verified position,
    the matcher advanced over the drafts before it and rolled back), each job's rows being its sequence's
    last draws."""
    jobs, rows = mask_jobs(schedule.seqs, schedule.plan.work) if backend is not None else ([], 0)
    if not jobs:
        return schedule
    masks = backend.fill_rows(jobs, rows)
    work = list(schedule.plan.work)
    owner = [i for i, w in enumerate(work) for _ in range(w.num_samples)]  # drawn row -> its work item
    last = {i: row for row, i in enumerate(owner)}  # work item -> its last drawn row
    at = 0  # ``fill_rows`` writes the jobs' rows one job after another
    for j in jobs:
        n, i = 1 + len(j.drafts), owner[j.row]
        assert j.row + n - 1 == last[i], f"{work[i].seq_id}: masks of rows {j.row}..{j.row + n - 1}"
        work[i] = replace(work[i], grammar_masks=tuple(masks.words[r].tobytes() for r in range(at, at + n)))
        at += n
    return replace(schedule, plan=replace(schedule.plan, work=tuple(work)))
