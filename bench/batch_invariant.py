"""What ``DEEPINFER_BATCH_INVARIANT=1`` costs: engine throughput, mode off against on, in one process, the rounds
interleaved (off, on, off, on, ...) so that a busy machine slows both alike; the best round of each is reported.

    python bench/batch_invariant.py [--device cpu] [--batches 1 16] [--prompt-len 128] [--tokens 32] [--rounds 3]
    python bench/batch_invariant.py --device cuda --model deepinfer/assets/shapes/v4-flash --load-format dummy \
        --hf-overrides '{"num_hidden_layers": 4}' --batches 1 8 32 128 --prompt-len 4096 --tokens 64

Per batch size B: B greedy requests of --prompt-len random tokens each generating --tokens tokens
(ignore_eos), all submitted at once; prefill tokens/s (the steps until every request has its first token)
and decode tokens/s (the rest). Default model: the bundled demo model. Writes
``bench/results/batch_invariant_engine_<device>.{json,md}`` (or under --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir


def _engine(invariant: bool, batch: int, args: argparse.Namespace) -> LLMEngine:
    old = os.environ.get("DEEPINFER_BATCH_INVARIANT")
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1" if invariant else "0"
    try:
        return LLMEngine.from_engine_args(
            model=args.model, tokenizer=str(demo_model_dir()) if args.model else None, device=args.device,
            load_format=args.load_format, hf_overrides=json.loads(args.hf_overrides) if args.hf_overrides else None,
            load_progress=False, block_size=args.block_size, max_num_seqs=batch,
            max_num_batched_tokens=max(8192, args.prompt_len), max_model_len=args.prompt_len + args.tokens + 128,
            enable_prefix_caching=False, **({"cache_memory_gb": args.cache_gb} if args.cache_gb else {}))
    finally:
        if old is None:
            del os.environ["DEEPINFER_BATCH_INVARIANT"]
        else:
            os.environ["DEEPINFER_BATCH_INVARIANT"] = old


def _round(engine: LLMEngine, batch: int, prompt_len: int, tokens: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{seed}-{i}", {"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(prompt_len)]},
                           params)
    t0 = time.perf_counter()
    started = 0
    while started < batch:  # prefill: until every request has its first token (one step unless chunked)
        started += sum(len(out.outputs[0].token_ids) == 1 for out in engine.step())
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    t2 = time.perf_counter()
    return batch * prompt_len / (t1 - t0), batch * (tokens - 1) / (t2 - t1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, help="checkpoint or shapes directory (default: the demo model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--hf-overrides", default=None, help="JSON, e.g. '{\"num_hidden_layers\": 4}'")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--cache-gb", type=float, default=None)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    rows = []
    for b in args.batches:
        engines = {mode: _engine(mode, b, args) for mode in (False, True)}
        best = {mode: [0.0, 0.0] for mode in engines}
        for r in range(args.rounds):
            for mode, engine in engines.items():
                pre, dec = _round(engine, b, args.prompt_len, args.tokens, seed=r)
                best[mode] = [max(best[mode][0], pre), max(best[mode][1], dec)]
        del engines, engine  # both engines' weights and caches go before the next batch size's are built
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        off, on = best[False], best[True]
        rows.append({"batch": b, "prefill_tok_s_off": off[0], "prefill_tok_s_on": on[0],
                     "decode_tok_s_off": off[1], "decode_tok_s_on": on[1],
                     "prefill_ratio": on[0] / off[0], "decode_ratio": on[1] / off[1]})
        print(rows[-1], flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "device": device, "model": args.model or "demo", "hf_overrides": args.hf_overrides,
            "processor": platform.processor(), "prompt_len": args.prompt_len, "tokens": args.tokens,
            "rounds": args.rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"batch_invariant_engine_{args.device}"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# DEEPINFER_BATCH_INVARIANT on {device}: engine throughput ({meta['model']}), mode off vs on", "",
             f"`python bench/batch_invariant.py {shlex.join(argv if argv is not None else sys.argv[1:])}` "
             f"(torch {meta['torch']}, {meta['threads']} "
             f"threads; prompts of {args.prompt_len} tokens, {args.tokens} generated, greedy; best of {args.rounds} "
             "interleaved rounds).",
             "", "| batch | prefill tok/s off | on | on/off | decode tok/s off | on | on/off |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prefill_tok_s_off']:.0f} | {r['prefill_tok_s_on']:.0f} | "
                     f"{r['prefill_ratio']:.2f} | {r['decode_tok_s_off']:.1f} | {r['decode_tok_s_on']:.1f} | "
                     f"{r['decode_ratio']:.2f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
