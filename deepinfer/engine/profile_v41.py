"""The largest step of a DeepSeek-V4.1 engine, run once at start-up to read its activation peak
(``engine/sizing.py``: on CUDA the cache gets what ``gpu_memory_utilization`` leaves after the weights and it).

V4's profile runs an all-padding step: its kernels read row lists of fixed widths, so ``max_num_batched_tokens``
padding tokens have the largest step's shapes. V4.1's step (``model/v41/paged.py``) lays its work out per
sequence from host facts and gathers what each sequence reads: its window rows, and per KV source every
compressed entry and index key up to its end (``PagedV41._entries``), which the layers reusing the source hold
on to; each query's keys in chunks (``ops.v41_attend_lists``; the reference's). What it allocates grows with the tokens, the
sequences and their lengths, so its largest step is the one the scheduler could plan with the most of all three:
``min(max_num_seqs, max_num_batched_tokens)`` sequences ending at ``max_model_len``, the first with every token
the others leave (a prefill chunk at the end of a long prompt, at most ``max_model_len``), the others one each
(decodes), every layer on every row (no decoder replay narrowing), then the head over the rows such a step
draws from (each sequence's k + 1 with speculative decoding). An upper bound: a cache too small to hold every
sequence at full length never plans it. With ``DEEPINFER_BATCH_INVARIANT=1`` every token runs alone
(``invariant.py``), so the largest step is one token of a sequence at ``max_model_len``.

The step runs on a throw-away storage of one block per pool whose tables send every position to that block:
the rows it reads are garbage and its writes land there, but every gather, every entry list and every chunk has
the real step's shape. Not profiled: the DSpark drafter's blocks after the step (a few rows per sequence).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.kv.block_budget import cdiv
from deepinfer.kv.spec import POOLS
from deepinfer.kv.storage import KVStorage
from deepinfer.model.step_index import HostRuns, SlotTables, StepIndex, build_slot_index


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileStep:
    """The largest step: its tokens [T], its index (on the storage's device) and how many rows it draws."""

    input_ids: torch.Tensor
    index: StepIndex
    draw_rows: int


def largest_v41_step(config: EngineConfig, storage: KVStorage) -> ProfileStep:
    """The step ``profile_v41_step`` runs, on ``storage`` (one block per pool: every table entry is block 0)."""
    sc = config.scheduler
    budget = 1 if config.batch_invariant else sc.max_num_batched_tokens
    seqs = min(sc.max_num_seqs, budget)
    lens = np.ones(seqs, dtype=np.int64)
    lens[0] = min(budget - (seqs - 1), sc.max_model_len)
    first = np.full(seqs, sc.max_model_len, dtype=np.int64) - lens
    tables = SlotTables(seqs, cdiv(sc.max_model_len, config.cache.block_size))
    for table in tables.arrays.values():
        table[:] = 0
    index = build_slot_index(np.arange(seqs), first, lens, tables, storage, config.model.sliding_window)
    index = dataclasses.replace(index.to(config.device), host=HostRuns.of(first, lens, [0] * seqs))
    k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    tokens = int(lens.sum())
    ids = torch.zeros(tokens, dtype=torch.long, device=config.device)
    return ProfileStep(ids, index, min(tokens, seqs * (k + 1)))


@torch.no_grad()
def run_largest_v41_step(model, config: EngineConfig, layout) -> None:
    """Run ``largest_v41_step`` and its head through ``model`` (a ``PagedV41``) on a throw-away storage."""
    scratch = KVStorage(layout, {p: 1 for p in POOLS}, config.dtype, config.device)
    step = largest_v41_step(config, scratch)
    hidden = model(step.input_ids, None, scratch, step.index)
    model.logits(hidden[-step.draw_rows:])
