"""Compile Triton kernels for sm_90 on any machine (no GPU) and read their main loop's SASS.

Device time is scarce; the compiled code is not. :func:`compile_sm90` compiles a kernel with the argument
specialisation a real launch gets (pointers and the 16-divisible sizes and strides marked so), and
:func:`loop_mix` finds the main loop (the longest backward branch in the SASS, disassembled with Triton's bundled
``nvdisasm``) and counts its instructions by class, with the registers and shared memory per program.
:func:`expert_kernels` and :func:`fp8_kernels` list the weight-streaming kernels at every tile config they are
used with. ``bench/kernels/loop_sass.py`` prints the table; ``tests/unit/test_kernel_codegen.py`` checks the FP4
expert loops stream weights the way their design says. Needs ``triton`` (imported here, not by
:mod:`deepinfer.testing`).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


# Per-thread integer instructions of the INT (ALU) pipe; IMAD* go to the FMA pipe. Uniform-datapath (U*)
# instructions are neither.
ALU_OPS = ("LOP3", "SHF", "PRMT", "SEL", "ISETP", "IADD3", "LEA", "IMNMX", "PLOP3", "FLO", "POPC", "BMSK", "SGXT")


def pipe_counts(classes: dict[str, int]) -> tuple[int, int]:
    """(ALU-pipe, IMAD) instruction counts of a loop's mix."""
    alu = sum(n for op, n in classes.items() if op.split(".")[0] in ALU_OPS)
    imad = sum(n for op, n in classes.items() if op.split(".")[0] == "IMAD")
    return alu, imad


@dataclass(frozen=True)
class LoopMix:
    instructions: int  # per loop iteration, per warp
    classes: dict[str, int]
    registers: int
    shared_bytes: int


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, divisible: tuple[str, ...],
                 num_warps: int, num_stages: int, maxnreg: int | None = None):
    """``fn`` compiled for sm_90, its pointers and the named integer arguments marked 16-divisible (what the
    launcher's specialisation gives real calls with such sizes)."""
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in names if signature[n].startswith("*") or n in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))


def loop_mix(kernel, workdir: Path) -> LoopMix:
    cubin = workdir / f"{kernel.name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([str(NVIDIA_BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(sass) if line.startswith(".L")}
    loop = (0, len(sass) - 1)
    best = -1
    for i, line in enumerate(sass):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > best:
            best, loop = i - labels[m.group(1)], (labels[m.group(1)], i)
    classes: collections.Counter = collections.Counter()
    for line in sass[loop[0]: loop[1] + 1]:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(\.[A-Z0-9_]+)*)", line)
        if m:
            classes[m.group(2)] += 1
    usage = subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                           capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    return LoopMix(sum(classes.values()), dict(classes), regs, kernel.metadata.shared)


def expert_kernels():
    """(label, kernel, signature, constexprs, divisible, warps, stages, weight bytes per program-iteration)."""
    from deepinfer.ops.triton import moe_experts as moe

    common = {"pair_ptr": "*i32", "expert_ptr": "*i32", "K": "i32", "N": "i32"}
    gate_up = {"x_ptr": "*bf16", "w13_ptr": "*i32", "s13_ptr": "*u8", "h_ptr": "*bf16", **common,
               "stride_x": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
               "stride_h": "i32", "limit": "fp32", "topk": "i32"}
    down = {"h_ptr": "*bf16", "w2_ptr": "*i32", "s2_ptr": "*u8", "y_ptr": "*fp32", **common, "stride_h": "i32",
            "stride_we": "i64", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_y": "i32",
            "row_div": "i32", "k_per_split": "i32", "stride_split": "i32"}
    div = ("K", "N", "stride_x", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_h", "stride_y",
           "k_per_split", "stride_split")
    cfgs = [(cfg, False) for _, cfg in moe.CONFIG_TABLE] + [(cfg, True) for _, cfg in moe.CONFIG_TABLE]
    cfgs.append((dataclasses.replace(cfgs[0][0], split_gate_up=True, splits1=4, splits2=2), False))  # K chunks
    # (config, tiled, placed): the checkpoint layout, tile-major codes and scales, and those with placed
    # codes (fp4_codes.place_codes), which is what the model stores.
    cfgs = [(cfg, tiled, placed) for cfg, tiled in cfgs for placed in ((False, True) if tiled else (False,))]
    for cfg, tiled, placed in cfgs:
        first = (("gate|up", moe._matmul_kernel, down, cfg.block_n1, 1, cfg.splits1) if cfg.split_gate_up
                 else ("gate_up", moe._gate_up_kernel, gate_up, cfg.block_n1, 2, None))
        for name, fn, sig, bn, tiles, k_splits in (first, ("down", moe._matmul_kernel, down, cfg.block_n2, 1,
                                                           cfg.splits2)):
            consts = {"SCALE_U8": True, "SPLIT": 1, "INTERPRET": False, "BM": cfg.block_m, "BN": bn, "BK": 128,
                      "W_TILED": tiled, "S_TILED": tiled, "W_PLACED": placed,
                      **({} if k_splits is None else {"K_SPLITS": k_splits})}
            scales = "s13_ptr" if name == "gate_up" else "s2_ptr"
            sig = {**sig, scales: "*u8", **{c: "constexpr" for c in consts}}
            chunks = f" k/{k_splits}" if k_splits and k_splits > 1 else ""
            chunks += " tiled" if tiled else ""
            chunks += " placed" if placed else ""
            yield (f"experts {name} m{cfg.block_m} n{bn} w{cfg.num_warps} s{cfg.num_stages}{chunks}", fn,
                   sig, consts, div, cfg.num_warps, cfg.num_stages, tiles * bn * 128 // 2)


def fp8_kernels():
    from deepinfer.ops.triton import fp8_linear as fp8
    from deepinfer.ops.tuning import H200

    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "ticket_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "group_rows": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32", "stride_pm": "i32",
           "stride_psplit": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "IEEE": "constexpr", "SPLIT": "constexpr", "BITS": "constexpr", "SEGS": "constexpr"}
    div = ("N", "K", "k_per_split", "group_rows", "stride_xm", "stride_wn", "stride_ym", "stride_pm", "stride_psplit")
    for bucket in (16, 64):
        bm, bn, warps, stages = dict(H200.fp8_tiles)[bucket]
        for bits in (True, False):
            cvt = "" if bits else " cvt"  # cvt: the hardware e4m3 -> f16 -> bf16 conversion
            yield (f"fp8 linear m{bm} n{bn} w{warps} s{stages}{cvt}", fp8._fp8_linear_kernel, sig,
                   {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "IEEE": False, "SPLIT": 4, "BITS": bits,
                    "SEGS": 1}, div, warps, stages, bn * 128)
    dec = {k: v for k, v in sig.items() if k not in ("BLOCK_N", "BLOCK_K", "IEEE", "BITS")}
    dec["w_ptr"] = "*i32"  # the codes as 32-bit words
    dec["NATURAL_K"] = "constexpr"
    for bm, bn, warps, stages in DECODE_VARIANTS:
        yield (f"fp8 decode m{bm} n{bn} w{warps} s{stages}", fp8._fp8_decode_kernel, dec,
               {"BLOCK_M": bm, "SPLIT": 4, "SEGS": 1, "NATURAL_K": False}, div, warps, stages, bn * 128)
    # The batch-invariant table's prefill tile, on checkpoint-order weights (x permuted in registers) and on
    # weights in the kernel's K order (``ops/fp8_layout.py``: x copied as it is).
    for natural in (False, True):
        yield (f"fp8 decode m128 n64 w4 s3 {'kernel' if natural else 'checkpoint'} order", fp8._fp8_decode_kernel,
               dec, {"BLOCK_M": 128, "SPLIT": 1, "SEGS": 1, "NATURAL_K": natural}, div, 4, 3, 64 * 128)


# (BLOCK_M, BLOCK_N, warps, stages) of the swap-AB decode kernel.
DECODE_VARIANTS = [(16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3)]
