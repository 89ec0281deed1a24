"""ModelRunner: turns a StepPlan into one model forward, logits for the rows that need them, and samples.

Rows needing logits: the last new token of every sequence that samples this step, plus prompt positions
of requests that asked for ``prompt_logprobs`` (sample 0 only; siblings share the prompt).
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from itertools import islice

import torch

from deepinfer.engine.sequence import Sequence
from deepinfer.kv.manager import CacheManager
from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch, SeqRun
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.runner.cuda_graphs import DecodeGraphs
from deepinfer.sampling import Sampler, SamplingRow, TokenLogprobs, prompt_logprobs
from deepinfer.sched.scheduler import StepPlan


@dataclass(frozen=True, slots=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True, slots=True)
class PromptLogprobChunk:
    seq: Sequence
    first_target: int  # prompt index of the first target token covered
    values: tuple[TokenLogprobs, ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: tuple[SampledToken, ...]
    prompt_logprobs: tuple[PromptLogprobChunk, ...]


class _Span(SequenceABC):
    """``items[lo:hi]`` without the copy. ``SamplingRow.build`` takes a row's prompt and output ids but
    reads only their lengths unless a penalty is on (then it iterates them once), while slicing them
    copies the whole history of every sampled row at every step (microseconds per thousand tokens)."""

    __slots__ = ("_items", "_lo", "_hi")

    def __init__(self, items: list[int], lo: int, hi: int) -> None:
        self._items, self._lo, self._hi = items, lo, hi

    def __len__(self) -> int:
        return self._hi - self._lo

    def __iter__(self) -> Iterator[int]:
        return islice(self._items, self._lo, self._hi)

    def __getitem__(self, i):
        return self._items[self._lo : self._hi][i]


class ModelRunner:
    def __init__(self, model: DeepseekV4, storage: KVStorage, cache: CacheManager, eos_token_id: int,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.graphs = graphs
        self.storage = storage
        self.cache = cache
        self.eos_token_id = eos_token_id
        self.sampler = Sampler()
        self.device = next(model.parameters()).device

    def execute(self, plan: StepPlan) -> StepResult:
        ids, runs, offset = [], [], 0
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new_tokens
            ids.extend(seq.token_ids[item.first_pos : item.first_pos + n])
            runs.append(SeqRun(offset, n, item.first_pos, self.cache.block_tables(seq.seq_id)))
            offset += n
        batch = ForwardBatch(tuple(runs))
        sample_rows, sample_items, prompt_jobs = self._select_rows(plan, runs)
        rows = sample_rows + [r for job in prompt_jobs for r in job[2]]
        if self.graphs is not None and not prompt_jobs and len(sample_rows) == len(runs) and self.graphs.fits(batch):
            # A decode step: every sequence samples its one new token; replay the captured graph.
            logits = self.graphs.run(ids, batch).float()
            return StepResult(self._sample(logits, sample_items), ())
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        streams = self.model(input_ids, batch, self.storage)
        if not rows:
            return StepResult((), ())
        logits = self.model.logits(streams[torch.tensor(rows, device=self.device)]).float()
        sampled = self._sample(logits[: len(sample_rows)], sample_items)
        prompt = self._prompt_logprobs(logits[len(sample_rows) :], prompt_jobs)
        return StepResult(sampled, prompt)

    def _select_rows(self, plan: StepPlan, runs: list[SeqRun]):
        sample_rows, sample_items, prompt_jobs = [], [], []
        for item, run in zip(plan.scheduled, runs):
            if item.samples:
                sample_rows.append(run.start + run.length - 1)
                sample_items.append(item)
            job = self._prompt_job(item, run)
            if job is not None:
                prompt_jobs.append(job)
        return sample_rows, sample_items, prompt_jobs

    def _prompt_job(self, item, run: SeqRun):
        seq, req = item.seq, item.seq.request
        if req.params.prompt_logprobs is None or seq.index != 0:
            return None
        # Position p predicts prompt token p + 1; only positions not already reported (preemption).
        lo = max(item.first_pos, req.prompt_logprobs_done)
        hi = min(item.first_pos + item.num_new_tokens, seq.num_prompt - 1)
        if lo >= hi:
            return None
        rows = [run.start + (p - item.first_pos) for p in range(lo, hi)]
        return (seq, lo, rows)

    def _sample(self, logits: torch.Tensor, items) -> tuple[SampledToken, ...]:
        if not items:
            return ()
        eos = (self.eos_token_id,)
        rows = []
        for it in items:
            seq = it.seq
            ids, n_prompt = seq.token_ids, seq.num_prompt
            rows.append(SamplingRow.build(seq.params, seed=seq.seed, prompt_token_ids=_Span(ids, 0, n_prompt),
                                          output_token_ids=_Span(ids, n_prompt, len(ids)), eos_token_ids=eos))
        out = self.sampler(logits, rows)
        tokens = out.tolist()
        return tuple(SampledToken(it.seq, tok, lp) for it, tok, lp in zip(items, tokens, out.logprobs))

    def _prompt_logprobs(self, logits: torch.Tensor, jobs) -> tuple[PromptLogprobChunk, ...]:
        out, offset = [], 0
        for seq, lo, rows in jobs:
            n = len(rows)
            targets = torch.tensor(seq.token_ids[lo + 1 : lo + 1 + n], device=logits.device)
            values = prompt_logprobs(logits[offset : offset + n], targets, seq.params.prompt_logprobs)
            out.append(PromptLogprobChunk(seq, lo + 1, tuple(values)))
            offset += n
        return tuple(out)
