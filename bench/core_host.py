"""Host CPU time per generated token of the served path, without HTTP and without the model's own work.

    PYTHONPATH=. python bench/core_host.py [--batch 64] [--tokens 128] [--prompt 512] [--repeats 3] [--async-scheduling]

The engine core's loop body (``engine.step()`` with the core's delta builder installed, then the step's
``StepOutputs`` through the codec: ``EngineCore._send_step`` into a pipe stand-in) over ``--batch`` requests
of ``--prompt`` random token ids decoding ``--tokens`` tokens each (temperature 1, ignore_eos, as
``deepinfer bench serve`` asks), and the API server's side of the same messages (decode, ``OutputAssembler``,
the completions chunk, its SSE line). A one-layer dummy model of tiny width on the CPU; the model's forward,
its logits and the sampler's draw are timed apart and left out: what remains is the host work that the
device does not do (scheduling, input building, applying tokens, detokenizing, output deltas, the codec).
CPU time of this thread (``time.thread_time``), so other processes on the machine move it little. Prints
us/token of each side per repeat and the best.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import deepinfer.runner.model_runner as model_runner
from deepinfer import LLMEngine, SamplingParams
from deepinfer.executor.codec import decode
from deepinfer.server.app import _sse
from deepinfer.server.completions import CompletionBuilder
from deepinfer.server.core_messages import MESSAGES
from deepinfer.server.engine_process import EngineCore
from deepinfer.server.output_wire import OutputAssembler

# The demo model cut to one sliding-window layer of tiny width (a valid config: see config/model.py).
TINY = {"num_hidden_layers": 1, "compress_ratios": [0, 0], "layer_types": ["sliding_attention"], "num_hash_layers": 0,
        "hidden_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 1, "hc_mult": 1, "index_n_heads": 1}


class _Device:
    """Thread CPU seconds spent in the wrapped callables (the device's share of a step)."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, owner, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.thread_time() - t

        setattr(owner, name, timed)


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--async-scheduling", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    b = a.batch
    engine = LLMEngine.from_engine_args(
        device="cpu", load_progress=False, block_size=256, max_num_seqs=b, max_num_batched_tokens=8192,
        max_model_len=a.prompt + a.tokens + 256, load_format="dummy", hf_overrides=TINY,
        num_cache_blocks=b * (3 + (a.prompt + a.tokens) // 256) + 8, async_scheduling=a.async_scheduling)
    device = _Device()
    device.wrap(engine.runner.model, "forward")
    device.wrap(engine.runner.model, "logits")
    device.wrap(model_runner, "draw")  # the runner calls the sampler through its module global
    pipe = _Pipe()
    core = EngineCore(engine, pipe)
    best_core = best_api = float("inf")
    for rep in range(a.repeats):
        rng = random.Random(rep)
        params = SamplingParams(temperature=1.0, max_tokens=a.tokens, ignore_eos=True)
        for i in range(b):
            rid = f"cmpl-{rep}-{i}-0"
            engine.add_request(rid, {"prompt_token_ids": [rng.randrange(5, 4000) for _ in range(a.prompt)]}, params)
            core.known.add(rid)
        pipe.sent.clear()
        while any(s.num_computed < s.num_prompt for r in engine.requests.values() for s in r.seqs):
            core._send_step(engine.step())  # prefill: not counted
        device.spent = 0.0
        t = time.thread_time()
        while engine.has_unfinished_requests():
            core._send_step(engine.step())
        core_s = time.thread_time() - t - device.spent
        assembler, builders, tokens = OutputAssembler(), {}, 0
        t = time.thread_time()
        for data in pipe.sent:
            for delta in decode(data, MESSAGES).outputs:
                out = assembler.assemble(delta)
                builder = builders.get(out.request_id)
                if builder is None:
                    builder = builders[out.request_id] = CompletionBuilder(out.request_id.rsplit("-", 1)[0], "m", 1,
                                                                           None)
                for chunk in builder.chunks(out):
                    _sse(chunk)
                tokens += sum(len(d) for d in out.delta_token_ids)
        api_s = time.thread_time() - t
        core_us, api_us = 1e6 * core_s / tokens, 1e6 * api_s / tokens
        best_core, best_api = min(best_core, core_us), min(best_api, api_us)
        print(f"batch {b}, {tokens} tokens: engine core {core_us:.1f} us/token (host), API side {api_us:.1f} us/token",
              flush=True)
    print(f"best: engine core {best_core:.1f} us/token, API side {best_api:.1f} us/token")


if __name__ == "__main__":
    main()
