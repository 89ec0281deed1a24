"""Per-device kernel choices, frozen and carried by the op table (``ops/table.py``).

Tile sizes, split-K targets and the small-batch paths are performance choices, measured on the H200
(``bench/kernels/``, ``bench/results/README.md``). They live here, as one immutable value chosen when the op
table is built, instead of as module globals: two tables in one process (the default and a batch-invariant
one) can then carry different choices, the SM count comes from the device the table runs on, and a sweep
passes a modified copy (``dataclasses.replace``) instead of patching a module.

Which choices change bits: the FP8 split-K (``fp8_split_target``, ``fp8_tiles``, ``fp8_decode_max_m``)
changes the order of the K reduction, and the attention small-batch split (``attention_small_split``)
changes where the softmax merge happens; both depend on the batch size, so a batch-invariant table must
fix them: ``invariant()`` is that table's tuning (``batch_invariant=True``). With it the dense GEMMs sum K
in segments that are a function of (N, K) and the SM count only (``k_segment``), one kernel per weight for
every M (FP8: the swap-AB kernel on ``invariant_decode_tiles`` for power-of-two scales, else the MMA kernel on
``invariant_fp8_tiles``; no weight-as-A prefill path, no cuBLAS), tiles of one MMA instruction family, and
attention splits every ``attention_invariant_split`` index columns at fixed columns, folded in order (as
programs of their own in decode, in-program in prefill: the same bits). The remaining
fields never change a result's bits (tests/gpu check the fast division and the e4m3 bit placement against
their plain forms).

Importable without Triton (the CPU path reads none of it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FP8Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
DecodeTile = tuple[int, int, int]  # (BLOCK_M, num_warps, num_stages)
LinearTile = tuple[int, int, int, int]  # (weight rows BLOCK_N, tokens BLOCK_M, num_warps, num_stages)


@dataclass(frozen=True, slots=True)
class KernelTuning:
    # Streaming multiprocessors of the device: split-K fills multiples of them.
    num_sms: int = 132
    # FP8 linear, split-K MMA path: a tile per M bucket (M <= 16, <= 64, <= 256, larger = None).
    # 16/64/None swept on the H200; the 256 bucket keeps SMs busy at M = 128 (N/128 programs otherwise).
    fp8_tiles: tuple[tuple[int | None, FP8Tile], ...] = (
        (16, (16, 64, 4, 4)), (64, (32, 64, 4, 4)), (256, (64, 64, 4, 3)), (None, (128, 128, 8, 3)))
    # Split K (M <= 256) until this many programs run; 0 -> twice the SM count.
    fp8_split_target: int = 0
    fp8_max_split: int = 16
    # Swap-AB decode path (power-of-two scales, K % 128 == 0) for M <= fp8_decode_max_m (0 = off).
    fp8_decode_max_m: int = 64
    fp8_decode_tiles: tuple[tuple[int, DecodeTile], ...] = ((16, (16, 4, 3)), (32, (32, 4, 3)), (64, (64, 4, 3)))
    # Weight-as-A path for prefill-sized M (256 tokens x 128 weight rows beat 128x128 by 1.5x on the H200).
    fp8_wa_min_m: int = 257
    fp8_wa_tile: tuple[tuple[str, int], ...] = (
        ("BLOCK_M", 256), ("BLOCK_N", 128), ("GROUP_M", 8), ("num_warps", 8), ("num_stages", 3))
    # e4m3 -> bf16 by integer bit placement instead of the conversion unit (same values, 11% faster at M=1).
    fp8_e4m3_by_bits: bool = True
    # Sparse attention: below attention_fill_programs programs (decode), split every
    # attention_small_split index columns, window apart (0 = the fixed, batch-invariant split only).
    attention_small_split: int = 128
    attention_fill_programs: int = 64
    # Batch-invariant attention (``batch_invariant``): splits of this many index columns at fixed absolute
    # columns, folded in order, as programs of their own below ``attention_fill_programs`` programs (decode)
    # or one after another inside each program (prefill); the same bits either way.
    attention_invariant_split: int = 128
    # mHC Sinkhorn divisions by the branch-free fast path (the bits of div_rn).
    mhc_fast_div: bool = True
    # Batch-invariant kernels (DEEPINFER_BATCH_INVARIANT=1): every launcher computes a row the same way for
    # every M. Set by ``invariant()``, which also fixes the choices above that depend on the batch.
    batch_invariant: bool = False
    # FP8 tiles of the batch-invariant table, per M bucket like ``fp8_tiles``: BLOCK_M >= 64 and warps a
    # multiple of 4, so every bucket runs the same wgmma m64 instruction (launchers assert it); the K
    # reduction is fixed by ``k_segment`` whatever the tile.
    invariant_fp8_tiles: tuple[tuple[int | None, FP8Tile], ...] = ((256, (64, 64, 4, 4)), (None, (128, 128, 8, 3)))
    # The batch-invariant table's FP8 kernel for power-of-two scales: the swap-AB kernel for every M (decode at
    # the default's speed where the MMA kernel cost up to 1.5x; bench/results/batch_invariant_cuda.md). False: the
    # MMA kernel for every M (what other scales always take).
    invariant_fp8_swap_ab: bool = True
    # The batch-invariant table stores FP8 weights of whole 128-column blocks with each block's columns in the
    # swap-AB kernel's register order (``ops/fp8_layout.py``), so that kernel reads activations as they are and sums
    # K in natural order (x no longer goes through registers to be permuted: a 4K prefill layer 1.14x -> 1.05x the
    # default table's time). Every path of that table reads the weights in this layout (the MMA kernel permutes x).
    invariant_fp8_kernel_order: bool = True
    # Its token tiles: each warpgroup runs the wgmma m64 instruction over the tile's 64 weight rows (a second
    # warpgroup takes half the tokens); the token count is the instruction's N side, which does not change bits.
    invariant_decode_tiles: tuple[tuple[int | None, DecodeTile], ...] = (
        (16, (16, 4, 3)), (32, (32, 4, 3)), (64, (64, 4, 3)), (None, (128, 4, 3)))
    # The batch-invariant table's bf16 linear (swap-AB, ``ops/triton/linear.linear_invariant``) per M bucket:
    # weight rows a multiple of 64 with at most one warpgroup per 64 of them, so every tile runs wgmma m64 over
    # the weight rows (tokens are its N side); larger tiles reuse each operand over more of the other.
    invariant_linear_tiles: tuple[tuple[int | None, LinearTile], ...] = (
        (16, (64, 16, 4, 4)), (32, (64, 32, 4, 4)), (64, (64, 64, 4, 3)), (None, (64, 128, 4, 3)))

    def __post_init__(self) -> None:
        if self.num_sms <= 0:
            raise ValueError(f"num_sms: must be positive, got {self.num_sms}")
        if self.attention_invariant_split <= 0:
            raise ValueError(f"attention_invariant_split: must be positive, got {self.attention_invariant_split}")
        if self.fp8_split_target < 0 or self.fp8_decode_max_m < 0 or self.attention_small_split < 0:
            raise ValueError("fp8_split_target, fp8_decode_max_m and attention_small_split must be >= 0")
        if self.fp8_decode_max_m > max(b for b, _ in self.fp8_decode_tiles):
            raise ValueError(f"fp8_decode_max_m: {self.fp8_decode_max_m} exceeds the largest decode tile bucket")
        if self.fp8_tiles[-1][0] is not None or self.invariant_fp8_tiles[-1][0] is not None:
            raise ValueError("fp8_tiles, invariant_fp8_tiles: the last bucket must be None (every larger M)")
        if any(bm < 64 or warps % 4 for _, (bm, _, warps, _) in self.invariant_fp8_tiles):
            raise ValueError("invariant_fp8_tiles: BLOCK_M >= 64 and warps a multiple of 4 (one wgmma family)")
        if self.invariant_decode_tiles[-1][0] is not None or any(w % 4 for _, (_, w, _) in
                                                                 self.invariant_decode_tiles):
            raise ValueError("invariant_decode_tiles: warps a multiple of 4 (whole warpgroups), the last bucket None")
        if self.invariant_linear_tiles[-1][0] is not None or any(
                bn % 64 or warps % 4 or warps > 4 * (bn // 64) for _, (bn, _, warps, _) in self.invariant_linear_tiles):
            raise ValueError("invariant_linear_tiles: weight rows a multiple of 64, warps a multiple of 4 and at "
                             "most 4 per 64 rows (wgmma m64 over the weight rows), the last bucket None")

    @property
    def fp8_k_order(self) -> str:
        """How the table built with this tuning stores FP8 weights' K columns (``ops/fp8_layout.ORDERS``)."""
        return "kernel" if self.batch_invariant and self.invariant_fp8_kernel_order else "checkpoint"

    @property
    def split_target(self) -> int:
        return self.fp8_split_target or 2 * self.num_sms

    def invariant(self) -> "KernelTuning":
        """The batch-invariant table's choices: no small-batch attention split, no M-bucketed FP8 paths (the
        launchers take one kernel per weight for every M), ``batch_invariant`` for the launchers."""
        return dataclasses.replace(self, attention_small_split=0, fp8_decode_max_m=0, batch_invariant=True)

    def split_for(self, programs: int, k: int) -> int:
        """K splits (a power of two, at most one per 128-wide K block) until ``programs * split`` fills the GPU."""
        split = 1
        while programs * split < self.split_target and split * 2 <= -(-k // 128) and split < self.fp8_max_split:
            split *= 2
        return split

    def k_segment(self, n: int, k: int, block_n: int = 64) -> int:
        """K per segment (whole 128-wide blocks) of a batch-invariant GEMM of [N, K]: it sums K in consecutive
        segments, each from zero, and adds the segments in order. The segments are the K split that fills the
        GPU at M = 1 with ``block_n``-wide tiles: a function of (N, K) and the SM count only, never of M.
        Launchers run them as split-K programs or one after another inside a program, with the same bits."""
        return -(-(-(-k // 128)) // self.split_for(-(-n // block_n), k)) * 128

    def segment_launch(self, n: int, k: int, tiles: int, block_n: int = 64) -> tuple[int, int, int]:
        """(K per segment, K-split programs per tile, segments per program) of a batch-invariant GEMM of [N, K]
        with ``tiles`` output tiles: the segments run as split-K programs while the tiles do not fill the GPU,
        else one after another inside each program. Either way each segment is summed from zero and the
        segments are added in order, so the choice (which follows M) never changes a bit."""
        seg = self.k_segment(n, k, block_n)
        segs = -(-k // seg)
        split = segs if tiles < self.num_sms else 1
        return seg, split, segs // split

    def invariant_fp8_tile(self, m: int) -> FP8Tile:
        return next(t for b, t in self.invariant_fp8_tiles if b is None or m <= b)

    def invariant_decode_tile(self, m: int) -> DecodeTile:
        return next(t for b, t in self.invariant_decode_tiles if b is None or m <= b)

    def invariant_linear_tile(self, m: int) -> LinearTile:
        return next(t for b, t in self.invariant_linear_tiles if b is None or m <= b)

    def fp8_tile(self, m: int) -> tuple[int | None, FP8Tile]:
        """(bucket, tile) of the first bucket holding M."""
        return next((b, t) for b, t in self.fp8_tiles if b is None or m <= b)

    def fp8_decode_tile(self, m: int) -> DecodeTile:
        return next(t for b, t in self.fp8_decode_tiles if m <= b)

    def with_fp8_tile(self, bucket: int | None, tile: FP8Tile) -> "KernelTuning":
        return dataclasses.replace(self, fp8_tiles=tuple((b, tile if b == bucket else t) for b, t in self.fp8_tiles))

    def with_fp8_decode_tile(self, bucket: int, tile: DecodeTile) -> "KernelTuning":
        return dataclasses.replace(
            self, fp8_decode_tiles=tuple((b, tile if b == bucket else t) for b, t in self.fp8_decode_tiles))

    @classmethod
    def for_device(cls, device: object = None) -> "KernelTuning":
        """The defaults with the SM count of ``device`` (a CUDA device; the current one when None)."""
        import torch

        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        return cls(num_sms=props.multi_processor_count)


H200 = KernelTuning()  # the measured defaults (132 SMs); what direct kernel calls use
