"""The model runner on the reference ops: multi-token steps and placeholder inputs change nothing.

A step may give a sequence k+1 tokens and draw at every one of them (what draft verification needs): fed
the tokens that one-token steps drew, it must draw the same continuation, with the same logprobs (to
fp32 rounding: the GEMMs see other row counts). A placeholder input (the token the sequence's previous
step drew, taken from the device) must give exactly what feeding that token from the host gives.
"""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.kv.block_budget import cdiv
from deepinfer.kv.manager import CacheManager
from deepinfer.kv.spec import POOLS, build_layout
from deepinfer.kv.storage import KVStorage
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.sampling import SamplingParams
from deepinfer.sched.plan import JoinedSeq, SeqSampling, SeqWork, StepPlan, TableEdit
from tests.unit.test_sequence_state import MODEL

MAX_LEN = 512
PROMPT = torch.randint(3, 97, (150,), generator=torch.Generator().manual_seed(4)).tolist()


class Harness:
    """A cache manager, batch state and runner driven by hand-written plans."""

    def __init__(self) -> None:
        model = copy.deepcopy(MODEL)
        layout = build_layout(model.cfg, 128)
        counts = {p: 16 for p in POOLS}
        self.cache = CacheManager(layout, counts)
        self.cache.track_edits()
        batch = InputBatch(4, cdiv(MAX_LEN, 128), model.cfg.vocab_size, "cpu")
        self.runner = ModelRunner(model, KVStorage(layout, counts, torch.float32), batch)
        self.lengths: dict[str, int] = {}

    def step(self, work: list[SeqWork], joined: tuple[JoinedSeq, ...] = ()):
        for w in work:
            self.cache.allocate(w.seq_id, w.num_tokens)
            self.lengths[w.seq_id] = w.first_pos + w.num_tokens
            self.cache.commit(w.seq_id, self.lengths[w.seq_id])
        edits = tuple(TableEdit(*e) for e in self.cache.drain_edits())
        result = self.runner.submit(StepPlan(tuple(work), joined, (), edits)).result()
        return {s.seq_id: s for s in result.samples()}


def _join(seq_id: str, params: SamplingParams, seed: int = 5) -> JoinedSeq:
    return JoinedSeq(seq_id, SeqSampling.of(params, seed, (1,)), len(PROMPT), (), ())


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, logprobs=2),
                                    SamplingParams(temperature=1.0, seed=9, logprobs=2)])
def test_draws_at_several_positions_equal_one_token_steps(params) -> None:
    k = 5
    one = Harness()
    first = one.step([SeqWork("a", 0, tuple(PROMPT), 0, 1)], (_join("a", params),))["a"]
    tokens, lps = [first.token_ids[0]], [first.logprobs[0]]
    for _ in range(k):
        pos = len(PROMPT) + len(tokens) - 1
        s = one.step([SeqWork("a", pos, (tokens[-1],), 0, 1)])["a"]
        tokens.append(s.token_ids[0])
        lps.append(s.logprobs[0])

    many = Harness()
    assert many.step([SeqWork("a", 0, tuple(PROMPT), 0, 1)], (_join("a", params),))["a"].token_ids == (tokens[0],)
    # A second sequence decoding in the same step: the multi-token run shares the batch with it.
    many.step([SeqWork("b", 0, tuple(PROMPT[:40]), 0, 1)], (_join("b", SamplingParams(temperature=0)),))
    s = many.step([SeqWork("a", len(PROMPT), tuple(tokens[:k]), 0, k),
                   SeqWork("b", 40, (7,), 0, 1)])["a"]
    assert s.token_ids == tuple(tokens[1:])
    for got, want in zip(s.logprobs, lps[1:]):
        assert (got.token_id, got.rank, [t for t, _ in got.top]) == (want.token_id, want.rank, [t for t, _ in want.top])
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_placeholder_inputs_equal_host_inputs() -> None:
    params = SamplingParams(temperature=0.8, seed=3, logprobs=1, frequency_penalty=0.4)
    runs = []
    for use_placeholder in (False, True):
        h = Harness()
        drawn = h.step([SeqWork("a", 0, tuple(PROMPT), 0, 1), SeqWork("b", 0, tuple(PROMPT[:70]), 0, 1)],
                       (_join("a", params), _join("b", params, seed=6)))
        out = {sid: [s.token_ids[0]] for sid, s in drawn.items()}
        lps = []
        for _ in range(6):
            work = []
            for sid in ("a", "b"):
                pos = h.lengths[sid]
                work.append(SeqWork(sid, pos, (), 1, 1) if use_placeholder else SeqWork(sid, pos, (out[sid][-1],), 0, 1))
            for sid, s in h.step(work).items():
                out[sid].append(s.token_ids[0])
                lps.append(s.logprobs[0])
        runs.append((out, lps))
    assert runs[0] == runs[1]
