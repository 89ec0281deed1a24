"""Programmatic dependent launch (PDL) for the chain of small kernels of a decode step.

A graphed decode step of one layer is ~50 dependent kernels of a few microseconds each; between two of them
the GPU idles while the second is launched and its blocks are scheduled. With PDL (SM90+) a kernel is
launched with the "programmatic stream serialization" attribute, so the GPU may start it before its
predecessor has finished; every kernel here then calls ``pdl_wait()`` (``griddepcontrol.wait``) before it
touches memory, which returns once the predecessor grid has completed and its writes are visible. So the
launch latency overlaps the predecessor's tail while no kernel reads or writes anything early: results are
the same bits with PDL on or off. Kernels launched by torch or cuBLAS carry no such attribute and keep the
stream's full ordering.

``DEEPINFER_PDL=0`` turns it off (launch attribute and wait both); it is off under Triton's interpreter and
on devices older than SM90.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _enabled() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DEEPINFER_PDL", "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


ENABLED = _enabled()
PDL_ON: tl.constexpr = tl.constexpr(ENABLED)
# Launch keyword arguments for every kernel that calls pdl_wait() first.
PDL: dict = {"launch_pdl": True} if ENABLED else {}


@triton.jit
def pdl_wait():
    """Wait for the predecessor grid (a no-op without PDL). Call before the kernel's first memory access."""
    if PDL_ON:
        tl.extra.cuda.gdc_wait()
