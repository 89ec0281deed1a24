"""Engine loop benchmark: the synchronous loop against async scheduling, on the bundled demo model or on
dummy layers of a model's shapes.

    python bench/engine_loop.py [--device cuda] [--batches 1 64 256] [--tokens 128] [--profile-batch 64]
                                [--model deepinfer/assets/shapes/v4-flash --layers 12 --cache-gb 12]

For each batch size B and each loop (sync, async) in one process: B greedy requests with short prompts,
each generating --tokens tokens (ignore_eos), timed after the first (prefill) step, the faster of
--repeats runs. Per decode step:
wall time; on the GPU also the time the host spent blocked waiting for a step's results (``wait``) and the
rest (``host``: scheduling, inputs, launches, detokenization, stop checks, outputs); on the CPU the model
forward and the rest. ``--profile-batch B`` adds a profiler trace of B-sequence async decode: the share of
the steady-state span in which no kernel runs (GPU idle). ``--model`` (a config.json directory): its first
``--layers`` layers with random weights in the native formats (``load_format="dummy"``), the demo tokenizer.
Writes ``engine_loop_{device}[_{model}{layers}].{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.runner.model_runner import StepHandle


class Clock:
    """Seconds spent inside wrapped callables, per bucket."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, obj, name: str, bucket: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent[bucket] = self.spent.get(bucket, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)


def _engine(a: argparse.Namespace, batch: int, async_scheduling: bool) -> LLMEngine:
    shapes = {}
    if a.model:
        from deepinfer.assets import demo_model_dir

        shapes = dict(model=a.model, load_format="dummy", tokenizer=str(demo_model_dir()),
                      hf_overrides={"num_hidden_layers": a.layers})
    return LLMEngine.from_engine_args(device=a.device, load_progress=False, block_size=128 if not a.model else 256,
                                      max_num_seqs=max(batch, 1), max_num_batched_tokens=8192, max_model_len=4096,
                                      async_scheduling=async_scheduling,
                                      **({"cache_memory_gb": a.cache_gb} if a.device == "cuda" else {}), **shapes)


def _submit(engine: LLMEngine, batch: int, tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{i}", f"def function_{i}(x):", params)


def run(engine: LLMEngine, batch: int, tokens: int) -> dict:
    clock = Clock()
    if engine.config.device == "cpu":
        clock.wrap(engine.runner.model, "forward", "model")
        clock.wrap(engine.runner.model, "logits", "model")
    _submit(engine, batch, tokens)
    engine.step()  # the prefill step (and, async, the first decode's submission), not counted
    clock.spent.clear()
    _Wait.spent = 0.0
    steps, generated = 0, 0
    if engine.config.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        generated += sum(len(d) for o in outs for d in o.delta_token_ids)
    wall = time.perf_counter() - t0
    waited = _Wait.spent + clock.spent.get("model", 0.0)
    return {"batch": batch, "steps": steps, "tokens": generated, "tokens_per_s": generated / wall,
            "step_ms": wall / steps * 1e3, "wait_ms": waited / steps * 1e3, "host_ms": (wall - waited) / steps * 1e3}


class _Wait:
    """Time the engine spends blocked on a step's results reaching the host."""

    spent = 0.0
    result = StepHandle.result

    @staticmethod
    def timed(handle: StepHandle):
        t = time.perf_counter()
        if handle._done is not None:
            handle._done.synchronize()
        _Wait.spent += time.perf_counter() - t
        return _Wait.result(handle)


def gpu_idle(engine: LLMEngine, batch: int, tokens: int) -> dict:
    """Profile async decode of ``batch`` sequences; the idle share of the span from the 10th to the last step's
    kernels (kernel intervals merged)."""
    from torch.profiler import ProfilerActivity, profile

    _submit(engine, batch, tokens)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, cur_start, cur_end = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    span = spans[-1][1] - spans[0][0]
    return {"batch": batch, "span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_share": 1 - busy / span}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--profile-batch", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest is reported")
    p.add_argument("--model", default=None, help="a config.json directory: dummy layers of its shapes")
    p.add_argument("--layers", type=int, default=4, help="with --model: how many of its layers")
    p.add_argument("--cache-gb", type=float, default=4.0, help="CUDA cache budget (V4-Flash-shaped layers at batch "
                   "64 need ~8: their window and state pools alone take 5.7 GB for 12 layers)")
    p.add_argument("--commit", default=None, help="commit to record (a copied checkout may carry stale git metadata)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()
    StepHandle.result = _Wait.timed
    rows, idle = [], None
    for b in a.batches:
        for mode in (False, True):
            engine = _engine(a, b, mode)
            run(engine, min(b, 4), 8)  # warm-up: Triton compiles, first allocations
            # The better of two runs: a step is a few ms of host work, and one stray pause (the garbage
            # collector, the OS) moves a single run's mean by several percent.
            best = max((run(engine, b, a.tokens) for _ in range(a.repeats)), key=lambda r: r["tokens_per_s"])
            rows.append({"loop": "async" if mode else "sync", **best})
            print(rows[-1], flush=True)
            if mode and b == a.profile_batch:  # the profile reuses this engine (built and warm)
                idle = gpu_idle(engine, b, a.tokens)
            del engine
            gc.collect()
    if a.profile_batch and idle is None:
        idle = gpu_idle(_engine(a, a.profile_batch, True), a.profile_batch, a.tokens)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    dev = torch.cuda.get_device_name() if a.device == "cuda" else (platform.processor() or platform.machine())
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "device": dev, "torch": torch.__version__,
            "tokens": a.tokens}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"engine_loop_{a.device}" + (f"_{Path(a.model).name}{a.layers}" if a.model else "")
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "idle": idle}, indent=2))
    wait = "wait" if a.device == "cuda" else "model"
    what = f"{Path(a.model).name}-shaped dummy layers x {a.layers}" if a.model else "demo model"
    lines = [f"# Engine loop, sync vs async scheduling ({what}, {a.device})\n", f"{meta}\n",
             f"`python bench/engine_loop.py --device {a.device} --batches {' '.join(map(str, a.batches))} "
             f"--tokens {a.tokens} --repeats {a.repeats}"
             + (f" --model {a.model} --layers {a.layers} --cache-gb {a.cache_gb}" if a.model else "")
             + (f" --profile-batch {a.profile_batch}`\n" if a.profile_batch else "`\n"),
             f"| batch | loop | tok/s | async / sync | step ms | {wait} ms | host ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["loop"] == "sync")
        lines.append(f"| {r['batch']} | {r['loop']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
                     f"{r['step_ms']:.3f} | {r['wait_ms']:.3f} | {r['host_ms']:.3f} |")
    if idle:
        lines.append(f"\nGPU idle in async decode at batch {idle['batch']}: {idle['idle_share']:.1%} of "
                     f"{idle['span_ms']:.1f} ms (kernels busy {idle['busy_ms']:.1f} ms).")
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
