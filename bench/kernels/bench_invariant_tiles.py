"""The batch-invariant table's GEMM tiles for large M: time and bits of candidate tiles on a real step's GEMMs.

    python bench/kernels/bench_invariant_tiles.py [--tokens 4096] [--layers 2]

One prefill chunk of --tokens tokens through V4-Flash-shaped layers (layers 2.., random native-format weights,
as in bench/layer_sweep.py) under ``DEEPINFER_BATCH_INVARIANT``'s table records every GEMM call (FP8, grouped
FP8, bf16 linear/dense: inputs and weights). Each candidate tile for the bucket that --tokens falls in
(``KernelTuning.invariant_decode_tiles``: the FP8 swap-AB kernel's (tokens, warps, stages);
``invariant_linear_tiles``: the bf16 kernel's (weight rows, tokens, warps, stages); fewer, longer K
segments, ``fp8_split_target``; the swap-AB kernel on checkpoint-order weights) then replays those calls:
device time per layer, and whether every output has the same bits as the table's tile (a candidate that
changes a bit cannot be the invariant table's; the kernel tests then check rows alone against rows in
batches). The default table's GEMMs (the weight-as-A FP8 kernel and cuBLAS) are the line to beat.
Writes $OUT/invariant_tiles.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.layer_sweep import FLASH, build, from_layer, random_cache  # noqa: E402
from deepinfer.model.device import use_op_table  # noqa: E402
from deepinfer.ops import fp8_layout  # noqa: E402
from deepinfer.ops.table import triton_ops  # noqa: E402
from deepinfer.ops.tuning import KernelTuning  # noqa: E402

FP8_TILES = [(128, 4, 3), (128, 4, 4), (256, 4, 3), (256, 8, 3), (256, 8, 4), (128, 8, 3)]
LINEAR_TILES = [(64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3)]
# Fewer, longer K segments (``fp8_split_target``, which the invariant table's ``k_segment`` reads): other bits by
# design (another fixed order), timed to see what the segments cost at this M.
SPLIT_TARGETS = [132, 66, 33]
GEMMS = ("fp8_linear", "fp8_linear_grouped", "linear", "dense")


def record(model, table, tokens: int) -> list[tuple[str, tuple, dict]]:
    """Every GEMM call of one prefill chunk: (op name, args, kwargs), args cloned."""
    calls = []

    def recorder(name, fn):
        def call(*args, **kw):
            calls.append((name, tuple(a.clone() if torch.is_tensor(a) else a for a in args), dict(kw)))
            return fn(*args, **kw)
        return call

    rec = dataclasses.replace(table, **{n: recorder(n, getattr(table, n)) for n in GEMMS})
    use_op_table(model, rec)
    cache, sids = random_cache(model, 1, 0, "cuda", capacity=tokens)
    ids, fb = cache.plan({sids[0]: [3 + i % 1000 for i in range(tokens)]})
    with torch.no_grad():
        model(ids.cuda(), fb, cache.storage)
    torch.cuda.synchronize()
    use_op_table(model, table)
    return calls


def replay(table, calls, kinds: tuple[str, ...], recorded_order: str) -> tuple[float, list[torch.Tensor]]:
    """(ms for the calls of these kinds, their outputs). FP8 weights (recorded in ``recorded_order``) are handed to
    ``table`` in its own K order (``ops/fp8_layout.py``)."""
    def own(name, args):
        if not name.startswith("fp8_") or table.fp8_k_order == recorded_order:
            return args
        w = fp8_layout.arrange(fp8_layout.checkpoint(args[1], recorded_order), table.fp8_k_order)
        return (args[0], w, *args[2:])

    mine = [(getattr(table, n), own(n, a), kw) for n, a, kw in calls if n in kinds]
    outs = [fn(*a, **kw) for fn, a, kw in mine]
    ms = do_bench(lambda: [fn(*a, **kw) for fn, a, kw in mine], warmup=5, rep=40)
    return ms, outs


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--tokens", type=int, default=4096)
    a.add_argument("--layers", type=int, default=2)
    args = a.parse_args()
    base = KernelTuning.for_device()
    inv = base.invariant()
    model = build(from_layer(FLASH, 2), args.layers, "cuda")
    calls = record(model, triton_ops(inv), args.tokens)
    print(f"{len(calls)} GEMM calls: " + ", ".join(f"{n} x{sum(c[0] == n for c in calls)}" for n in GEMMS))
    rows = []
    for kinds, field, tiles in ((("fp8_linear", "fp8_linear_grouped"), "invariant_decode_tiles", FP8_TILES),
                                (("linear", "dense"), "invariant_linear_tiles", LINEAR_TILES)):
        default_ms, _ = replay(triton_ops(base), calls, kinds, inv.fp8_k_order)
        ref_ms, ref = replay(triton_ops(inv), calls, kinds, inv.fp8_k_order)
        current = getattr(inv, field)
        bucket = next(b for b, _ in current if b is None or args.tokens <= b)
        print(f"== {field} (bucket {bucket}): default table {default_ms / args.layers * 1e3:.0f} us/layer, "
              f"invariant table {ref_ms / args.layers * 1e3:.0f} us/layer")
        rows.append(dict(field=field, tile="default table", us_per_layer=default_ms / args.layers * 1e3))
        candidates = [(tile, {field: tuple((b, tile if b == bucket else t) for b, t in current)}) for tile in tiles]
        candidates += [(("split_target", t), dict(fp8_split_target=t)) for t in SPLIT_TARGETS]
        if field == "invariant_decode_tiles":  # the swap-AB kernel on checkpoint-order weights (x permuted)
            candidates.append((("checkpoint_order",), dict(invariant_fp8_kernel_order=False)))
        for tile, fields in candidates:
            tuned = dataclasses.replace(inv, **fields)
            try:
                ms, outs = replay(triton_ops(tuned), calls, kinds, inv.fp8_k_order)
            except Exception as e:  # a tile that does not compile or fit: reported, not fatal
                print(f"  {tile}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            same = all(torch.equal(o, r) for o, r in zip(outs, ref))
            print(f"  {tile}: {ms / args.layers * 1e3:7.0f} us/layer  {ms / default_ms:5.2f}x default  "
                  f"bits {'same' if same else 'DIFFER'}")
            rows.append(dict(field=field, tile=list(tile), us_per_layer=ms / args.layers * 1e3,
                             vs_default=ms / default_ms, same_bits=same))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "invariant_tiles.json").write_text(json.dumps(
            dict(tokens=args.tokens, layers=args.layers, gpu=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
