"""Speculative decoding with the MTP layer on the bundled demo model: speed and exactness in one run.

    python bench/spec_decode.py [--device cuda] [--batches 1 8 32] [--ks 0 1 2 3] [--tokens 128]
                                [--loops sync async]  # the engine loop: synchronous and/or async scheduling
                                [--profile]  # host profile (cProfile) of each timed loop, top functions printed

For each batch size B and draft length k (0 = no speculation, with CUDA graphs on the GPU as served): B
greedy requests with held-out Python prompts, --tokens tokens each (stopping at EOS like a user's request),
all in one engine per (B, k), timed on a second pass of the same requests (the first compiles every step
shape's kernels). Reports decode tokens per second after the prefill step, the mean tokens per
verify step (accepted drafts + 1), the speedup over k = 0 in the same run, and whether every request's
tokens equal the k = 0 tokens (they must: verification never changes greedy output). With several
``--loops``, each loop's rows also give the speedup over the first loop at the same (B, k).
Writes ``spec_decode_{device}.{json,md}`` into --out.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.corpus import heldout_files, iter_texts


def _prompts(n: int) -> list[str]:
    """The first 160 characters of ``n`` held-out functions (never trained on), every seventh one."""
    found: list[str] = []
    for text in iter_texts(heldout_files()):
        starts = [i for i in range(len(text) - 200) if text.startswith("\ndef ", i)]
        found += [text[s + 1 : s + 161] for s in starts]
        if len(found) >= 7 * n:
            break
    return found[::7][:n]


def run(device: str, batch: int, k: int, tokens: int, profile: bool = False, async_scheduling: bool = False) -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    engine = LLMEngine.from_engine_args(device=device, load_progress=False, block_size=128, max_num_seqs=max(batch, 1),
                                        max_num_batched_tokens=8192, max_model_len=2048, speculative_config=spec,
                                        async_scheduling=async_scheduling,
                                        **({"cache_memory_gb": 4.0} if device == "cuda" else {}))
    params = SamplingParams(temperature=0, max_tokens=tokens)
    prompts = _prompts(batch)
    # Warm-up: the same requests once, so the kernels of every step shape are compiled before timing.
    for i, p in enumerate(prompts):
        engine.add_request(f"w{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    warm = (engine.spec_stats.num_drafts, engine.spec_stats.num_accepted_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # prefill
    if device == "cuda":
        torch.cuda.synchronize()
    out: dict[str, list[int]] = {}
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if prof:
        prof.disable()
        print(f"--- host profile, batch {batch}, k {k} (times inflated by the profiler) ---")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(20)
        stats.sort_stats("cumulative").print_stats("deepinfer", 30)
    generated = sum(len(v) for v in out.values()) - batch  # the prefill step drew the first token of each
    stats = engine.spec_stats
    drafts, accepted = stats.num_drafts - warm[0], stats.num_accepted_tokens - warm[1]
    return {"loop": "async" if async_scheduling else "sync", "batch": batch, "k": k, "steps": steps,
            "seconds": seconds, "tok_s": generated / seconds, "step_ms": 1e3 * seconds / max(steps, 1), "tokens_per_step": 1 + accepted / drafts if drafts else None,
            "outputs": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--loops", nargs="+", choices=["sync", "async"], default=["sync"],
                    help="engine loops to run: synchronous, async scheduling (default: sync)")
    ap.add_argument("--profile", action="store_true", help="print a host profile of each timed loop")
    a = ap.parse_args()
    rows = []
    first_loop: dict[tuple[int, int], float] = {}
    for b in a.batches:
        for loop in a.loops:
            base = None
            for k in sorted(set(a.ks) | {0}):
                r = run(a.device, b, k, a.tokens, a.profile, loop == "async")
                if k == 0:
                    base = r
                r["speedup"] = r["tok_s"] / base["tok_s"]
                r["vs_first_loop"] = r["tok_s"] / first_loop.setdefault((b, k), r["tok_s"])
                r["same_tokens"] = r["outputs"] == base["outputs"]
                rows.append({key: v for key, v in r.items() if key != "outputs"})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    (out / f"spec_decode_{a.device}.json").write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    lines = [f"# Speculative decoding (MTP), demo model, {name}", "",
             f"`python bench/spec_decode.py --device {a.device} --batches {' '.join(map(str, a.batches))} "
             f"--ks {' '.join(map(str, a.ks))} --tokens {a.tokens} --loops {' '.join(a.loops)}`", "",
             f"| loop | batch | k | decode tok/s | step ms | tokens/step | speedup vs k=0 | vs {a.loops[0]} "
             "| same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "1"
        lines.append(f"| {r['loop']} | {r['batch']} | {r['k']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | {tps} | "
                     f"{r['speedup']:.2f} | {r['vs_first_loop']:.2f} | {r['same_tokens']} |")
    (out / f"spec_decode_{a.device}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
