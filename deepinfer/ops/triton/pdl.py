"""Programmatic dependent launch (PDL, sm_90) for the step's chain of Triton kernels.

A decode step is a chain of small kernels. Without PDL each one is launched only once its predecessor has
ended, and then spends its first microsecond on the first DRAM round trip for its weights. With PDL, a
kernel launched with the attribute may start while its predecessor still runs, as soon as every program of
the predecessor has signalled (``griddepcontrol.launch_dependents``); its ``griddepcontrol.wait`` then
blocks until the predecessor has completed and its writes are visible. The protocol here:

* every Triton kernel of the path begins with ``enter``: wait, then signal. Waiting first means at most
  one kernel runs ahead of the one that computes (no chain of early-launched programs holding SM slots);
  signalling right after lets the next kernel's launch overlap this kernel's whole run;
* weight-streaming kernels (``fp8_linear``, ``linear``) first ask L2 for the head of their weight slice
  (``prefetch_rows``): weights never depend on the predecessor, so those bytes move while it still runs.

Kernels launched without the attribute (torch's own, or everything with PDL off) start after their
predecessor as usual; the wait and the signal are then no-ops. Inside a captured CUDA graph the attribute
becomes a programmatic edge between the two kernel nodes. Off by default under the CPU interpreter (no
inline PTX there) and before sm_90; ``DEEPINFER_PDL=0`` turns it off (benchmarks compare both).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DEEPINFER_PDL", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


ENABLED = _supported()
# Bytes of each weight row asked of L2 ahead of the wait: enough to cover a kernel's first K steps (the
# ramp a predecessor's run can hide), small enough that a wave of programs stays well inside L2.
PREFETCH_ROW_BYTES = tl.constexpr(1024)


def kwargs() -> dict:
    """Launch keywords of a kernel that calls ``enter`` (its ``PDL`` constexpr and the launch attribute);
    read at every launch, so flipping ``ENABLED`` takes effect on the next call."""
    return {"PDL": True, "launch_pdl": True} if ENABLED else {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr):
    """First thing a kernel does (after any ``prefetch_rows``): wait for the predecessor, then let the next
    kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(row_ptrs, nbytes, PDL: tl.constexpr):
    """Ask L2 for the first ``nbytes`` (at most ``PREFETCH_ROW_BYTES``, at least 1) from each of ``row_ptrs``:
    one ``prefetch.global.L2`` per 128-byte line, a few per thread, no registers or shared memory held and
    nothing waited on. (The bulk prefetch is a uniform-datapath instruction: per-thread addresses compile
    to a 32-step loop per warp.)"""
    if PDL:
        LINES: tl.constexpr = PREFETCH_ROW_BYTES // 128
        rows = row_ptrs.to(tl.pointer_type(tl.int8))
        offs = tl.minimum(tl.arange(0, LINES) * 128, nbytes - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [rows[:, None] + offs[None, :]], dtype=tl.int32, is_pure=False, pack=1)


def row_bytes(span: int) -> int:
    """Bytes to prefetch per row of a ``span``-byte slice."""
    return max(1, min(span, PREFETCH_ROW_BYTES.value))
