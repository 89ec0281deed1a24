"""The full-size model on several devices, offline, in one command: dummy V4-Flash weights through the engine.

    python bench/multi_gpu.py --data-parallel-size 4 --enable-expert-parallel          # 4 GPUs, DP4 + EP
    python bench/multi_gpu.py --tensor-parallel-size 4                                  # 4 GPUs, TP4
    python bench/multi_gpu.py --tensor-parallel-size 2 --data-parallel-size 4 --enable-expert-parallel
    python bench/multi_gpu.py --data-parallel-size 4 --enable-expert-parallel --context-parallel-size 4 \
        --prefill 32768 --max-num-batched-tokens 8192                                    # + one long prompt, CP4
    python bench/multi_gpu.py --data-parallel-size 2 --enable-expert-parallel --layers 2 --ranks-share-device \
        --batches 1 8 --prefill 2048                                                     # one GPU, two ranks on it
    python bench/multi_gpu.py --model deepinfer/assets/demo --layers 2 --device cpu \\
        --data-parallel-size 2 --enable-expert-parallel --batches 1 2 --prefill 64 --tokens 4   # CPU smoke test

No server and no checkpoint: ``LLM(model=<config dir>, load_format="dummy", ...)`` (default: the published
V4-Flash shapes, ``deepinfer/assets/shapes/v4-flash``), so each rank builds its sharded modules and generates
only its slices of the native-format weights (FP8 + UE8M0, packed FP4 experts) on its device, through the same
weight loaders as a checkpoint load. ``--layers N`` truncates the model (``hf_overrides={"num_hidden_layers": N}``).
The tokenizer is the demo model's (V4's is not bundled): prompts are random token ids, and the texts are
meaningless; the work per token is the real model's.

Measured, after a warm-up request (kernel compilation):
  * load: engine construction (worker processes, world, load, cache sizing), seconds;
  * decode at each global batch B (the engine spreads the requests over the DP ranks): B requests with
    --prompt-len random prompt tokens, prefilled first, then --tokens greedy tokens each (ignore_eos); the
    decode steps alone are timed: per-step latency and output tokens/s over all ranks;
  * prefill: --prefill-seqs requests (default one per DP rank) of --prefill tokens each, one output token:
    wall time to finish them and prompt tokens/s (chunked by --max-num-batched-tokens);
  * with --context-parallel-size > 1, also one request of --prefill tokens alone (its chunks split over a CP
    group: time to its first token, and how many chunks ran context-parallel).
Writes ``multi_gpu_<layout>.json`` and ``.md`` into --out (default: $OUT when set, else bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.assets import demo_model_dir, shapes_dir  # noqa: E402
from deepinfer.engine.llm_engine import LLMEngine  # noqa: E402


def _layout(a: argparse.Namespace) -> str:
    cp = f"-cp{a.context_parallel_size}" if a.context_parallel_size > 1 else ""
    mtp = f"-mtp{json.loads(a.speculative_config)['num_speculative_tokens']}" if a.speculative_config else ""
    shared = "-one-gpu" if a.ranks_share_device else ""
    return (f"tp{a.tensor_parallel_size}-dp{a.data_parallel_size}" + ("-ep" if a.enable_expert_parallel else "") + cp
            + mtp + shared)


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(n)]


def _run(engine: LLMEngine, prompts: list[dict], tokens: int, tag: str) -> tuple[float, int, float, int]:
    """(seconds until every request has its first token, steps, seconds of the decode steps after that,
    decode steps): the requests are added at once and stepped to the end."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    started, first_done, decode_steps, prefill_steps = time.perf_counter(), None, 0, 0
    have_first: set[str] = set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first_done is None:
            prefill_steps += 1
            have_first |= {o.request_id for o in outs if o.outputs and o.outputs[0].token_ids}
            if len(have_first) == len(prompts):
                first_done = time.perf_counter()
        else:
            decode_steps += 1
    end = time.perf_counter()
    assert first_done is not None
    return first_done - started, prefill_steps, end - first_done, decode_steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(shapes_dir("v4-flash")), help="directory with config.json (shapes)")
    p.add_argument("--tokenizer", default=str(demo_model_dir()), help="tokenizer directory (default: the demo's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--context-parallel-size", type=int, default=1, help="DP ranks a long prefill chunk is split over")
    p.add_argument("--context-parallel-min-tokens", type=int, default=1024)
    p.add_argument("--speculative-config", default=None,
                   help='MTP speculation, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\' (dummy weights: '
                        'drafts are almost never accepted, so this times the verify steps\' worst case)')
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers override (default: all)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128], help="decode global batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each decode request")
    p.add_argument("--tokens", type=int, default=32, help="output tokens of each decode request")
    p.add_argument("--prefill", type=int, default=4096, help="prompt tokens of each prefill request")
    p.add_argument("--prefill-seqs", type=int, default=None, help="prefill requests (default: one per DP rank)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="step token budget (default: --prefill)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-share-device", action="store_true",
                   help="every rank on one GPU (a rehearsal of the multi-GPU path, not a performance figure)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)

    budget = a.max_num_batched_tokens or max(a.prefill, a.prompt_len)
    args = dict(model=a.model, tokenizer=a.tokenizer, load_format="dummy", device=a.device, dtype=a.dtype,
                tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size,
                enable_expert_parallel=a.enable_expert_parallel, context_parallel_size=a.context_parallel_size,
                context_parallel_min_tokens=a.context_parallel_min_tokens, max_num_seqs=max(a.batches),
                max_num_batched_tokens=budget, max_model_len=max(a.prefill + 1, a.prompt_len + a.tokens) + 1,
                gpu_memory_utilization=a.gpu_memory_utilization, seed=a.seed, load_progress=False,
                speculative_config=a.speculative_config, ranks_share_device=a.ranks_share_device,
                hf_overrides={"num_hidden_layers": a.layers} if a.layers else None)
    t = time.perf_counter()
    llm = LLM(**args)
    load_s = time.perf_counter() - t
    engine = llm.engine
    try:
        cfg = engine.config.model
        rng = random.Random(a.seed)
        _run(engine, _prompts(1, min(a.prompt_len, 16), cfg.vocab_size, rng), 2, "warmup")
        decode = []
        for b in a.batches:
            ttft, psteps, dt, steps = _run(engine, _prompts(b, a.prompt_len, cfg.vocab_size, rng), a.tokens, f"d{b}")
            decode.append({"batch": b, "prefill_s": round(ttft, 4), "prefill_steps": psteps, "decode_steps": steps,
                           "step_ms": round(1e3 * dt / max(steps, 1), 3),
                           # Speculation emits several tokens a step: count the tokens after each first one.
                           "tokens_per_s": round(b * (a.tokens - 1 if a.speculative_config else steps) / dt, 2)
                           if dt > 0 else None})
            print(f"decode batch {b}: {decode[-1]['step_ms']} ms/step, {decode[-1]['tokens_per_s']} tok/s", flush=True)
        n = a.prefill_seqs or a.data_parallel_size
        ttft, psteps, _, _ = _run(engine, _prompts(n, a.prefill, cfg.vocab_size, rng), 1, "p")
        prefill = {"seqs": n, "tokens": a.prefill, "steps": psteps, "seconds": round(ttft, 4),
                   "tokens_per_s": round(n * a.prefill / ttft, 1)}
        print(f"prefill {n} x {a.prefill}: {prefill['seconds']} s, {prefill['tokens_per_s']} tok/s", flush=True)
        long_prefill = None
        if a.context_parallel_size > 1:
            before = engine.context_parallel_chunks
            ttft, psteps, _, _ = _run(engine, _prompts(1, a.prefill, cfg.vocab_size, rng), 1, "cp")
            long_prefill = {"tokens": a.prefill, "steps": psteps, "seconds": round(ttft, 4),
                            "tokens_per_s": round(a.prefill / ttft, 1),
                            "cp_chunks": engine.context_parallel_chunks - before}
            print(f"long prefill 1 x {a.prefill} (CP{a.context_parallel_size}): {long_prefill['seconds']} s, "
                  f"{long_prefill['cp_chunks']} of {psteps} chunks split", flush=True)
    finally:
        engine.close()
    result = {
        "layout": _layout(a), "model": a.model, "layers": cfg.num_hidden_layers, "device": a.device,
        "device_name": torch.cuda.get_device_name(0) if a.device == "cuda" else platform.processor() or "cpu",
        "world_size": a.tensor_parallel_size * a.data_parallel_size, "dtype": str(engine.config.dtype),
        "load_s": round(load_s, 2), "prompt_len": a.prompt_len, "tokens": a.tokens, "step_token_budget": budget,
        "decode": decode, "prefill": prefill, "context_parallel_size": a.context_parallel_size,
        "long_prefill": long_prefill, "speculative_config": a.speculative_config,
        "mean_acceptance_length": engine.spec_stats.mean_acceptance_length if a.speculative_config else None,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"multi_gpu_{_layout(a)}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(result))
    print(f"wrote {stem}.json and .md")
    return result


def _markdown(r: dict) -> str:
    lines = [f"# {r['layout']}: {Path(r['model']).name}, {r['layers']} layers, dummy weights",
             "",
             f"{r['world_size']} x {r['device_name']} ({r['device']}, {r['dtype']}); engine built and loaded in "
             f"{r['load_s']} s. Decode: each request {r['prompt_len']} prompt tokens, then {r['tokens']} greedy "
             "tokens; the decode steps alone are timed.",
             "",
             "| global batch | ms / decode step | output tok/s | prefill of the batch (s) |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {d['batch']} | {d['step_ms']} | {d['tokens_per_s']} | {d['prefill_s']} |" for d in r["decode"]]
    pf = r["prefill"]
    lines += ["", f"Prefill: {pf['seqs']} x {pf['tokens']} tokens in {pf['seconds']} s ({pf['steps']} steps of at "
              f"most {r['step_token_budget']} tokens): {pf['tokens_per_s']} prompt tok/s.", ""]
    lp = r.get("long_prefill")
    if lp:
        lines += [f"Long prefill under context parallelism (CP{r['context_parallel_size']}): 1 x {lp['tokens']} tokens "
                  f"in {lp['seconds']} s ({lp['cp_chunks']} of {lp['steps']} chunks split over the CP group): "
                  f"{lp['tokens_per_s']} prompt tok/s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
