"""Verify-step cost of MTP speculation on V4-Flash-shaped layers, and the effective TPOT it implies.

    python bench/spec_verify.py [--model deepinfer/assets/shapes/v4-flash] [--layers 2 6] [--batches 1 8 32 128]
                                [--ks 0 1 2 3] [--acceptance 0.8] [--steps 24] [--async-scheduling auto]
                                [--draft-head auto]

Dummy weights (``load_format="dummy"``) in the checkpoint's native formats, the first --layers layers plus
the MTP layer, on the engine's own path (CUDA graphs for plain and verify steps). Random weights accept no
drafts, but with a fixed draft length (``DEEPINFER_ENABLE_MTP_VARLEN=0``, the default) every step still
verifies k drafts and runs the k-step MTP chain, which is what is timed: the mean wall time of --steps
decode steps with every sequence decoding, host included, one engine per (layers, k).

Two layer counts give a per-layer slope and a fixed part (embedding, head, MTP, host); the table
extrapolates both to the model's full depth. That holds only where the step is bound by the device at both
counts: a step whose host work outlasts its device time at the smaller count hides part of the slope (then
measure at more layers, or with --async-scheduling on, which overlaps the host's work with the device's).
Effective TPOT = step time / expected tokens per step, where a per-draft acceptance a gives
(1 - a^(k+1)) / (1 - a) tokens (each draft accepted independently with probability a, the usual model); the
speedup is against k = 0 in the same run. Acceptance is an input here (the published figure for V4-Flash is
~0.8; the demo model's is measured by ``bench/spec_decode.py``).
Writes ``spec_verify_{device}.{json,md}`` into --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.config.model import ModelConfig


# --async-scheduling -> the engine argument (None: the engine's default for the configuration).
ASYNC = {"auto": None, "on": True, "off": False}


def expected_tokens(k: int, a: float) -> float:
    """Tokens one verify step emits on average: the accepted prefix of k drafts plus the target's token."""
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_time(engine: LLMEngine, steps: int, top: int = 32) -> dict:
    """Where ``steps`` engine steps spend the device's time (torch.profiler, CUDA activity only, graph replays
    included kernel by kernel): per step, the time some kernel or copy runs (``busy_ms``: a step whose wall
    time exceeds it waits on the host), their sum, and the ``top`` kernel names by time per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, end, names = 0.0, float("-inf"), {}
    for s, e, name in spans:
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
        names[name] = names.get(name, 0.0) + (e - s)
    ranked = sorted(names.items(), key=lambda kv: -kv[1])[:top]
    return {"busy_ms": busy / 1e3 / steps, "kernel_ms": sum(names.values()) / 1e3 / steps,
            "top_us": {n[:80]: round(v / steps, 1) for n, v in ranked}}


def step_times(a, layers: int, k: int) -> dict[int, float]:
    """Mean step milliseconds per batch size for one engine (``layers`` layers, ``k`` drafts)."""
    spec = {"method": "mtp", "num_speculative_tokens": k, "draft_head": a.draft_head} if k else None
    engine = LLMEngine.from_engine_args(
        model=a.model, load_format="dummy", hf_overrides={"num_hidden_layers": layers}, device=a.device,
        load_progress=False, max_num_seqs=max(a.batches), max_model_len=4096, max_num_batched_tokens=8192,
        block_size=256, speculative_config=spec, tokenizer=a.tokenizer, async_scheduling=ASYNC[a.async_scheduling],
        **({"cache_memory_gb": a.cache_gb} if a.cache_gb else {}))
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 100 + a.prompt))}
    out = {}
    for b in a.batches:
        ids = [f"b{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, prompt, params)
        while any(q.num_tokens - q.num_computed > 1 + k for q in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()  # prefill until every sequence decodes
        for _ in range(4):  # warm-up: the decode shapes compile and their graphs are captured
            engine.step()
        _sync(a.device)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        _sync(a.device)
        out[b] = 1e3 * (time.perf_counter() - t0) / a.steps
        if a.profile:
            print(json.dumps({"layers": layers, "k": k, "batch": b, "step_ms": out[b],
                              **device_time(engine, a.profile)}), flush=True)
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        print(json.dumps({"layers": layers, "k": k, "batch": b, "step_ms": out[b]}), flush=True)
    del engine
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="deepinfer/assets/shapes/v4-flash", help="a config.json directory")
    ap.add_argument("--tokenizer", default=None, help="default: the bundled demo model's")
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 6], help="two layer counts for the slope")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--acceptance", type=float, default=0.8, help="per-draft acceptance for the projection")
    ap.add_argument("--lengths", type=float, nargs="+", default=None, metavar="L",
                    help="measured mean acceptance lengths for k = 1, 2, ... (e.g. the demo model's from deepinfer "
                         "eval): the table adds the TPOT and speedup they give")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cache-gb", type=float, default=None)
    ap.add_argument("--async-scheduling", choices=list(ASYNC), default="auto",
                    help="the engine's async_scheduling for every k (auto: its default, which is off with speculation)")
    ap.add_argument("--draft-head", choices=["auto", "model", "fp8"], default="auto",
                    help="speculative_config.draft_head (auto: an FP8 copy of the LM head on CUDA)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after timing, profile this many steps on the device: busy time per step against the "
                         "wall time, and the kernels by time (CUDA only)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if a.tokenizer is None:
        from deepinfer.assets import demo_model_dir
        a.tokenizer = str(demo_model_dir())
    depth = ModelConfig.from_model_dir(a.model).num_hidden_layers
    ks = sorted(set(a.ks) | {0})
    lo, hi = a.layers
    t = {(n, k): step_times(a, n, k) for n in (lo, hi) for k in ks}
    rows = []
    for b in a.batches:
        full = {}
        for k in ks:
            slope = (t[(hi, k)][b] - t[(lo, k)][b]) / (hi - lo)
            full[k] = t[(lo, k)][b] + slope * (depth - lo)
        for k in ks:
            tokens = expected_tokens(k, a.acceptance)
            rows.append({"batch": b, "k": k, "step_ms": {n: t[(n, k)][b] for n in (lo, hi)},
                         "per_layer_ms": (t[(hi, k)][b] - t[(lo, k)][b]) / (hi - lo), "full_step_ms": full[k],
                         "tokens_per_step": tokens, "tpot_ms": full[k] / tokens,
                         "speedup": (full[0] / 1.0) / (full[k] / tokens)})
            if a.lengths:  # at measured acceptance lengths (k = 0: one token per step)
                measured = 1.0 if k == 0 else a.lengths[k - 1] if k <= len(a.lengths) else None
                rows[-1]["measured"] = None if measured is None else {
                    "tokens_per_step": measured, "tpot_ms": full[k] / measured,
                    "speedup": full[0] / (full[k] / measured)}
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"spec_verify_{a.device}.json").write_text(json.dumps({"device": name, "depth": depth, "args": vars(a),
                                                                   "rows": rows}, indent=1))
    lines = [f"# MTP verify steps, {Path(a.model).name}-shaped dummy layers, {name}", "",
             f"`python bench/spec_verify.py --model {a.model} --layers {lo} {hi} --batches "
             f"{' '.join(map(str, a.batches))} --ks {' '.join(map(str, a.ks))} --acceptance {a.acceptance} "
             f"--steps {a.steps} --async-scheduling {a.async_scheduling} --draft-head {a.draft_head}"
             + (f" --lengths {' '.join(map(str, a.lengths))}" if a.lengths else "") + "`", "",
             f"Step times measured at {lo} and {hi} layers; full depth ({depth} layers) extrapolated from the "
             f"per-layer slope. Expected tokens per step at per-draft acceptance {a.acceptance}.", "",
             f"| batch | k | step ms ({lo} L) | step ms ({hi} L) | ms per layer | step ms ({depth} L) | tokens/step "
             "| TPOT ms | speedup vs k=0 |" + (" measured tokens/step | TPOT ms | speedup |" if a.lengths else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if a.lengths else "")]
    for r in rows:
        m = r.get("measured")
        extra = "" if not a.lengths else " - | - | - |" if m is None else (
            f" {m['tokens_per_step']:.2f} | {m['tpot_ms']:.2f} | {m['speedup']:.2f} |")
        lines.append(f"| {r['batch']} | {r['k']} | {r['step_ms'][lo]:.2f} | {r['step_ms'][hi]:.2f} | "
                     f"{r['per_layer_ms']:.3f} | {r['full_step_ms']:.2f} | {r['tokens_per_step']:.2f} | "
                     f"{r['tpot_ms']:.2f} | {r['speedup']:.2f} |" + extra)
    (out / f"spec_verify_{a.device}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
