"""Independent chains of one layer run side by side on two CUDA streams (the GPU path's overlap).

A decode step is a chain of small kernels, most of which fill a fraction of the GPU; where two chains of a
layer do not read each other's results, the second one runs on a side stream and the SMs are shared:
  * attention (CSA/HCA layers): the compressors' chain (bf16 side projections of x, state rows, pooled
    entries and index keys) beside the query/window chain (wq_a|wkv, q norm, wq_b, RoPE, window write);
  * MoE: the shared expert (w1|w3, SwiGLU, w2) beside the router and the routed experts; the routed
    experts' combine, which adds the shared output, waits for it (``moe_experts_fp4``'s ``before_add``).
Each fork first makes the side stream wait for everything the main stream has queued, and each branch is
joined back before its results are read, so the kernels and their inputs are exactly those of the serial
order and the results are the same bits. That ordering also keeps the caching allocator safe without
``record_stream``: a block the side stream frees is only reused by a later side branch, which starts after
the main stream's reads of it were queued. A captured decode graph gets the fork and join as graph edges.

Off CUDA, or when disabled, ``side()`` runs its body inline on the current stream (the same order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer.ops import lanes


class Branches:
    def __init__(self, device: torch.device | None = None) -> None:
        """Two streams on ``device`` (a CUDA device); ``None``: inline, no side stream."""
        self._side = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self._open = False  # a side branch has been forked and not joined yet

    @property
    def enabled(self) -> bool:
        return self._side is not None

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the body on the side stream, after all work queued so far; ``join()`` before reading its
        results on the main stream."""
        if self._side is None:
            yield
            return
        if self._open:
            raise RuntimeError("a side branch is still open: join() it before forking another")
        self._side.wait_stream(torch.cuda.current_stream(self._side.device))
        self._open = True
        with torch.cuda.stream(self._side), lanes.lane(1):
            yield

    def join(self) -> None:
        """The main (current) stream waits for the open side branch; a no-op when none is open."""
        if self._side is not None and self._open:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._open = False


INLINE = Branches()  # the default of every module: no side stream
