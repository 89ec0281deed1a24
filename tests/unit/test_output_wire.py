"""The engine core's outputs cross the process boundary as deltas (server/output_wire.py): rebuilt on the
server side they must equal the engine's own cumulative RequestOutputs, field for field, through the codec,
for every kind of request the server makes (greedy with logprobs and chunked prompt logprobs, n > 1 seeded
samples with a stop string, an abort mid-generation)."""

from __future__ import annotations

from deepinfer import LLMEngine, SamplingParams
from deepinfer.executor.codec import decode, encode
from deepinfer.server.core_messages import MESSAGES, StepOutputs
from deepinfer.server.engine_stats import snapshot
from deepinfer.server.output_wire import DeltaBuilder, OutputAssembler, PlainDelta


def test_core_deltas_built_from_sequences_rebuild_the_engine_outputs() -> None:
    """The engine core's builder (no cumulative outputs made) against the engine's outputs: two engines run
    the same requests in lockstep, one building RequestOutputs, one DeltaBuilder deltas."""
    def start() -> LLMEngine:
        engine = LLMEngine.from_engine_args(device="cpu", block_size=128, load_progress=False,
                                            max_num_batched_tokens=32, num_cache_blocks=16)
        engine.add_request("greedy", "def " * 20, SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                                 prompt_logprobs=2, ignore_eos=True))
        engine.add_request("seeded", "class A:", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8,
                                                                stop=["\n"]))
        engine.add_request("aborted", "import os", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        # One sample, no logprobs (the builder's plain path): ended by its length, and by a stop string.
        engine.add_request("short", "x = ", SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))
        engine.add_request("stopped", "for i in", SamplingParams(temperature=1.0, seed=7, max_tokens=40, stop=["e"]))
        return engine

    plain, core = start(), start()
    finals = {}
    builder = DeltaBuilder()
    core.build_output = builder.build
    assembler, full_assembler = OutputAssembler(), OutputAssembler()
    seen: dict[str, int] = {}
    plain_deltas = 0
    steps = 0
    while plain.has_unfinished_requests():
        outputs, deltas = plain.step(), core.step()
        steps += 1
        if steps == 4:
            plain.abort_request("aborted")
            core.abort_request("aborted")
        assert [o.request_id for o in outputs] == [d.request_id for d in deltas]
        message = StepOutputs(tuple(deltas), snapshot(core))
        # Requests, not sequences ("seeded" has two samples).
        assert message.stats.running == len({s.request.request_id for s in core.scheduler.running})
        assert message.stats.waiting == len({s.request.request_id for s in core.scheduler.waiting})
        received = decode(encode(message, MESSAGES), MESSAGES)
        assert received.stats == message.stats
        for out, delta in zip(outputs, received.outputs):
            assert assembler.assemble(delta) == out
            if type(delta) is PlainDelta:  # a one-sample request without logprobs, after its first message
                plain_deltas += 1
                assert out.request_id in seen and out.request_id in {"short", "stopped", "aborted"}
                delta = delta.full()
            assert full_assembler.assemble(delta) == out
            if out.finished:
                finals[out.request_id] = out.outputs[0].finish_reason
            # Only what is new travels: the prompt once, each sample's tokens since the previous message.
            assert (delta.prompt_token_ids is None) == (out.request_id in seen)
            assert [len(s.token_ids) for s in delta.samples] == [len(d) for d in out.delta_token_ids]
            seen[out.request_id] = seen.get(out.request_id, 0) + 1
    assert set(seen) == {"greedy", "seeded", "aborted", "short", "stopped"} and seen["greedy"] > 2  # prompt logprobs came in chunks
    assert plain_deltas > 10
    assert finals["short"] == "length" and finals["stopped"] == "stop" and finals["aborted"] == "abort"
    assert not core.has_unfinished_requests() and steps > 4
    assert not builder._sent and not assembler._requests


def test_stats_count_requests_not_samples() -> None:
    engine = LLMEngine.from_engine_args(device="cpu", block_size=128, load_progress=False, num_cache_blocks=16)
    engine.add_request("three", "x", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True))
    engine.add_request("one", "y", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(2):
        engine.step()
    assert len(engine.scheduler.running) == 4
    assert snapshot(engine).running == 2 and snapshot(engine).waiting == 0
