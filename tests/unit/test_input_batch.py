"""The runner's persistent batch state against the reference sampler inputs.

``InputBatch`` keeps sampling settings per slot and penalty state on the device, updated by each draw; the
sampler inputs it gathers for a step must be the tensors ``SamplingRow.build`` gives from the whole token
history, so the draws are the reference sampler's bit for bit. Table edits must leave each slot's tables
equal to the cache manager's.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from deepinfer.kv.manager import CacheManager
from deepinfer.kv.spec import POOLS
from deepinfer.runner.input_batch import InputBatch
from deepinfer.sampling import Sampler, SamplingParams, SamplingRow
from deepinfer.sampling.penalties import apply_penalties_and_masks
from deepinfer.sampling.sampler import draw
from deepinfer.sampling.tensors import from_rows
from deepinfer.sched.plan import JoinedSeq, SeqSampling, StepPlan, TableEdit
from tests.unit.test_cache_manager import layout as cache_layout

VOCAB = 97
EOS = (2,)
PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_k=5, seed=1),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02, seed=2, logprobs=3),
    SamplingParams(temperature=0, repetition_penalty=1.4, min_tokens=3, stop_token_ids=[5, 6]),
    SamplingParams(temperature=0.9, presence_penalty=0.7, frequency_penalty=-0.4, seed=4, min_tokens=2),
    SamplingParams(temperature=1.0, repetition_penalty=0.8, frequency_penalty=0.5, top_k=30, top_p=0.95, seed=5,
                   ignore_eos=True, min_tokens=6),
]


def _histories(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    return [([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))],
             [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 5))]) for _ in PARAMS]


def test_gathered_sampler_inputs_equal_the_reference_rows_step_after_step() -> None:
    rng = random.Random(0)
    hist = _histories(rng)
    batch = InputBatch(num_slots=8, max_blocks=2, vocab_size=VOCAB, device="cpu")
    # Slot 0 is taken while they join and free afterwards: rows and slots differ.
    batch.apply(StepPlan(joined=(JoinedSeq("x", SeqSampling.of(PARAMS[0], 9, EOS), 1, (), ()),)))
    joined = tuple(JoinedSeq(f"s{i}", SeqSampling.of(p, 100 + i, EOS), len(pr),
                             tuple(pr) if p.repetition_penalty != 1.0 else (), tuple(out))
                   for i, (p, (pr, out)) in enumerate(zip(PARAMS, hist)))
    batch.apply(StepPlan(joined=joined))
    batch.apply(StepPlan(left=("x",)))
    slots = [batch.slot_of[f"s{i}"] for i in range(len(PARAMS))]
    assert slots == list(range(1, len(PARAMS) + 1))
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 3
        positions = [len(pr) + len(out) for pr, out in hist]
        rows = [SamplingRow.build(p, seed=100 + i, prompt_token_ids=pr, output_token_ids=out, eos_token_ids=EOS)
                for i, (p, (pr, out)) in enumerate(zip(PARAMS, hist))]
        want_t = from_rows(rows, VOCAB, torch.float32, "cpu")
        got_t = batch.sampling_tensors(slots, positions)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions", "salts"):
            assert torch.equal(getattr(got_t, name), getattr(want_t, name)), name
        assert (got_t.random_rows, got_t.use_truncation, got_t.use_top_p, got_t.use_min_p, got_t.num_logprobs) == \
            (want_t.random_rows, want_t.use_truncation, want_t.use_top_p, want_t.use_min_p, want_t.num_logprobs)
        assert torch.equal(apply_penalties_and_masks(logits, got_t.penalties, got_t.masked),
                           apply_penalties_and_masks(logits, want_t.penalties, want_t.masked))
        tokens = draw(logits, got_t)
        assert torch.equal(tokens, Sampler()(logits, rows).token_ids)
        batch.record(slots, tokens, list(range(len(slots))))
        assert batch.last_tokens[slots].tolist() == tokens.tolist()
        for (_, out), t in zip(hist, tokens.tolist()):
            out.append(t)


def test_table_edits_mirror_the_cache_manager() -> None:
    layout = cache_layout()
    cache = CacheManager(layout, {p: 40 for p in POOLS})
    cache.track_edits()
    batch = InputBatch(num_slots=4, max_blocks=8, vocab_size=VOCAB, device="cpu")
    rng = random.Random(3)
    live: dict[str, int] = {}
    sampling = SeqSampling.of(SamplingParams(), 0, EOS)
    for step in range(60):
        joined, left = [], []
        if len(live) < 4 and rng.random() < 0.4:
            sid = f"q{step}"
            live[sid] = 0
            joined.append(JoinedSeq(sid, sampling, 1, (), ()))
        for sid in list(live):
            if rng.random() < 0.08 and not (joined and joined[0].seq_id == sid):  # a plan's leavers left before
                cache.free(sid) if sid in cache else None
                del live[sid]
                left.append(sid)
                continue
            n = rng.choice([1, 1, 1, 37, 130])
            if live[sid] + n > 8 * layout.block_size:
                continue
            if rng.random() < 0.1 and live[sid] > 3:  # a rollback
                live[sid] -= 2
                cache.truncate(sid, live[sid])
            cache.allocate(sid, n)
            live[sid] += n
            cache.commit(sid, live[sid])
        edits = tuple(TableEdit(*e) for e in cache.drain_edits())
        batch.apply(StepPlan(joined=tuple(joined), left=tuple(left), table_edits=edits))
        for sid in live:
            tables = cache.block_tables(sid)
            for pool in POOLS:
                row = batch.tables.arrays[pool][batch.slot_of[sid]]
                want = np.full(len(row), -1)
                want[: len(tables[pool])] = tables[pool]
                assert row.tolist() == want.tolist(), (step, sid, pool)


def test_sampler_inputs_reused_across_steps_follow_positions_and_slot_changes() -> None:
    """A step with the same slots as the step before reuses its inputs with new positions (no penalty row
    here, one with min_tokens, whose mask ends at step 4 while the inputs are reused): every step equals the
    reference rows', and a slot that changed hands (left, then taken by a sequence with other settings) is
    not served the old inputs."""
    params = [SamplingParams(temperature=0.7, top_k=5, seed=1),
              SamplingParams(temperature=0.9, min_tokens=4, stop_token_ids=[5], seed=2),
              SamplingParams(temperature=1.3, top_p=0.8, seed=3, logprobs=2)]
    batch = InputBatch(num_slots=4, max_blocks=2, vocab_size=VOCAB, device="cpu")
    batch.apply(StepPlan(joined=tuple(JoinedSeq(f"s{i}", SeqSampling.of(p, 10 + i, EOS), 4, (), ())
                                      for i, p in enumerate(params))))
    slots = [batch.slot_of[f"s{i}"] for i in range(len(params))]
    for step in range(6):
        if step == 3:  # s0 leaves; a greedy sequence takes its slot (the same slot list as before)
            batch.apply(StepPlan(left=("s0",)))
            params[0] = SamplingParams(temperature=0)
            batch.apply(StepPlan(joined=(JoinedSeq("g", SeqSampling.of(params[0], 10, EOS), 4, (), ()),)))
            assert batch.slot_of["g"] == slots[0]
        positions = [4 + step] * len(params)
        rows = [SamplingRow.build(p, seed=10 + i, prompt_token_ids=[7] * 4, output_token_ids=[8] * step,
                                  eos_token_ids=EOS) for i, p in enumerate(params)]
        want, got = from_rows(rows, VOCAB, torch.float32, "cpu"), batch.sampling_tensors(slots, positions)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions", "salts", "random_idx"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
        assert (got.random_rows, got.use_truncation, got.use_top_p, got.num_logprobs) == \
            (want.random_rows, want.use_truncation, want.use_top_p, want.num_logprobs), step
        assert (got.masked is None) == (want.masked is None), step
        if want.masked is not None:
            assert all(torch.equal(a, b) for a, b in zip(got.masked, want.masked)), step


def test_draw_positions_start_on_a_16_byte_boundary_of_their_copy() -> None:
    """Slots and positions share one host-to-device copy; the positions a draw kernel reads must start 16 bytes
    into it at any batch parity (Triton compiles a kernel variant per pointer alignment)."""
    batch = InputBatch(num_slots=8, max_blocks=2, vocab_size=VOCAB, device="cpu")
    batch.apply(StepPlan(joined=tuple(JoinedSeq(f"s{i}", SeqSampling.of(PARAMS[1], 100 + i, EOS), 3, (), ())
                                      for i in range(5))))
    for n in (1, 2, 3, 5):
        slots = [batch.slot_of[f"s{i}"] for i in range(n)]
        positions = [10 + i for i in range(n)]
        batch._last_inputs = None  # the gathering path, not the reused inputs of the last step
        t = batch.sampling_tensors(slots, positions)
        assert t.positions.tolist() == positions
        assert (t.positions.data_ptr() - t.positions.untyped_storage().data_ptr()) % 16 == 0, n
