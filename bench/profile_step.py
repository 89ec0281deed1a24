"""Where a step's GPU time goes: per-kernel device time of one eager batched step (torch.profiler).

    python bench/profile_step.py [--layers 4] [--batch 1] [--context 1024] [--prefill 0] [--verify 0]
                                 [--mode default|batch-invariant|batch-invariant-mma]

Eager, not graph replay: the kernels are the ones a captured graph replays, and the profiler attributes
each one. Prints the top kernels by total device time per layer, grouped by name, and the sum.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.layer_sweep import FLASH, MODES, build, decode_tokens, from_layer, mode_table, random_cache  # noqa: E402
from deepinfer.model.device import use_op_table  # noqa: E402


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--layers", type=int, default=4)
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--context", type=int, default=1024)
    a.add_argument("--prefill", type=int, default=0, help="profile a prefill chunk of this many tokens instead")
    a.add_argument("--verify", type=int, default=0, help="profile a verify step of this many drafts instead: "
                   "each sequence runs 1 + VERIFY new tokens, logits at every one (speculative decoding)")
    a.add_argument("--mode", choices=list(MODES), default="default",
                   help="the op table whose kernels run (as in layer_sweep.py --modes)")
    a.add_argument("--top", type=int, default=30)
    a.add_argument("--trace", type=int, default=0, help="also list the step's first N kernels in launch order "
                   "(which op each kernel belongs to)")
    a.add_argument("--cpu", action="store_true", help="also list host-side ops by self CPU time (where the wall "
                   "time goes when it exceeds the device time)")
    args = a.parse_args()
    model = build(from_layer(FLASH, 2), args.layers, "cuda")  # layers 2.. as in layer_sweep.py
    if args.mode != "default":
        use_op_table(model, mode_table("cuda", args.mode))
    if args.prefill:
        cache, sids = random_cache(model, 1, 0, "cuda", capacity=args.prefill)
        new = {sids[0]: [3 + i % 1000 for i in range(args.prefill)]}
    else:
        cache, sids = random_cache(model, args.batch, args.context, "cuda")
        new = {sid: [tok] + [(tok + 1 + i) % model.cfg.vocab_size for i in range(args.verify)]
               for sid, tok in zip(sids, decode_tokens(len(sids), model.cfg.vocab_size))}

    logit_rows = 1 if args.prefill else args.batch * (1 + args.verify)  # a verify step's logits: every token

    def step():
        for sid in sids:
            cache.truncate(sid, 0 if args.prefill else args.context)
        ids, fb = cache.plan(new)
        model.logits(model(ids.cuda(), fb, cache.storage)[-logit_rows:])

    step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"wall: host returns after {(t1 - t0) * 1e3:.1f} ms, device done after {(t2 - t0) * 1e3:.1f} ms")
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.cpu else [])
    with profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    if args.cpu:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if args.trace:
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        print(f"== first {args.trace} kernels in launch order (µs, name)")
        for e in kernels[: args.trace]:
            print(f"{e.device_time:8.1f}  {e.name[:100]}")
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name[:90]
            t, n = rows.get(name, (0.0, 0))
            rows[name] = (t + e.device_time, n + 1)
    total = sum(t for t, _ in rows.values())
    what = f"prefill {args.prefill}" if args.prefill else \
        f"{'verify ' + str(args.verify) + ' drafts,' if args.verify else 'decode'} batch {args.batch} ctx {args.context}"
    print(f"== {what} ({args.mode}): {total / args.layers:.1f} us device time per layer, {sum(n for _, n in rows.values()) / args.layers:.0f} kernels per layer")
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{t / args.layers:9.1f} us  {n / args.layers:5.1f}x  {name}")


if __name__ == "__main__":
    main()
