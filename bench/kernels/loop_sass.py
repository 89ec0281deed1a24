"""Hot-loop instruction mix of the weight-streaming Triton kernels, compiled for the H200 on any machine.

    python bench/kernels/loop_sass.py            (no GPU needed: Triton's bundled ptxas and nvdisasm)
    python bench/kernels/loop_sass.py --only "m16 " --opcodes     (decode tiles, per-opcode side by side)

Device time is scarce; the compiled code is not. Per kernel and tile config this compiles for sm_90 with the
argument specialisation a real launch gets (pointers and the 16-divisible sizes and strides marked so),
finds the main loop (the longest backward branch in the SASS) and prints: instructions per loop iteration
and per streamed weight byte, the instruction classes that matter for these kernels (byte-wide shared
loads, 4-byte vs 16-byte async copies, barriers, MMAs), registers and shared memory per program.
Instructions per byte against 4 issue slots per SM per cycle bound the bandwidth a kernel can reach
(bench/results/README.md, runs 20-26: the FP4 expert loops run 0.22-0.26 instructions per byte, which at
full issue would allow ~4 TB/s; they reach ~2.4, stalled on scale loads and per-step barriers).
The ALU and IMAD columns count per-thread integer instructions by the pipe they go to (both half rate on
sm_90: a warp's instruction holds its pipe two cycles), so that an issue-count gain that only moves work
onto a saturated pipe shows. The compiling and SASS-reading helpers are ``deepinfer/testing/sass.py``, shared
with ``tests/unit/test_kernel_codegen.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing

from deepinfer.testing.sass import compile_sm90, expert_kernels, fp8_kernels, loop_mix, pipe_counts  # noqa: E402

# The instruction classes that matter for these kernels, one column each.
WATCH = ("LDG.E.U16", "LDS.U8", "LDS.128", "LDGSTS.E", "LDGSTS.E.BYPASS.128", "BAR.SYNC.DEFER_BLOCKING",
         "MEMBAR.ALL.CTA",
         "HGMMA.64", "HMMA.16816.F32.BF16", "WARPGROUP.DEPBAR.LE", "LDL", "STL")


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="+", default=[], help="kernels whose label contains any of these strings")
    ap.add_argument("--opcodes", action="store_true", help="also the full per-opcode mix, kernels side by side")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for label, fn, sig, consts, div, warps, stages, wbytes in [*expert_kernels(), *fp8_kernels()]:
            if args.only and not any(o in label for o in args.only):
                continue
            mix = loop_mix(compile_sm90(fn, sig, consts, div, warps, stages), Path(tmp))
            per_byte = mix.instructions * warps / wbytes
            rows.append((label, mix, per_byte))
            print(f"{label}: {mix.instructions} instr/iteration/warp, {per_byte:.3f} instr/weight byte, "
                  f"{mix.registers} regs, {mix.shared_bytes} B shared", flush=True)
    print("\n| kernel | instr/iter/warp | instr/byte | regs | shared KB | ALU | IMAD | " + " | ".join(WATCH) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(WATCH))
    for label, mix, per_byte in rows:
        cells = " | ".join(str(mix.classes.get(c, 0)) for c in WATCH)
        alu, imad = pipe_counts(mix.classes)
        print(f"| {label} | {mix.instructions} | {per_byte:.3f} | {mix.registers} | {mix.shared_bytes / 1024:.0f} | "
              f"{alu} | {imad} | {cells} |")
    if args.opcodes:
        ops = sorted({op for _, mix, _ in rows for op in mix.classes},
                     key=lambda op: -max(mix.classes.get(op, 0) for _, mix, _ in rows))
        print("\n| opcode | " + " | ".join(label for label, _, _ in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for op in ops:
            print(f"| {op} | " + " | ".join(str(mix.classes.get(op, 0)) for _, mix, _ in rows) + " |")


if __name__ == "__main__":
    main()
