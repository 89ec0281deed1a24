"""The FP8 dense weights' device layout for the batch-invariant table, host side: plain torch, importable without
Triton (``ops/triton/fp8_linear.py``'s swap-AB kernel reads it).

That kernel takes the weight as the MMA's register operand, loading each thread's share of a 128-wide K block as
16-byte runs and converting it in place. The runs land in the operand in a fixed permuted column order
(``kernel_order``): memory column 64h + 16a + 8b3 + 4b2 + 2b1 + b0 of a block is the operand's (logical) column
64h + 32b3 + 16b2 + 8b1 + 2a + b0 (a: the run, one per lane of a quad; b0: the bf16 pair). With checkpoint
columns the kernel must read the activations in that order too, a register permutation costing 64 shared-memory
stores per K step at 128 tokens and spills at 256 (``testing/sass.py`` loop mixes). Stored with each block's
columns already in the kernel's order (``to_kernel_order``), the weight's logical column j is its checkpoint
column j: the activations are copied as they are, and the sum runs over K in its natural order, so every M
(decode and prefill) can take that one kernel at prefill speed.

Same values; the sum's order is the natural one. The layout is per 128-column block, so row slices, stacks and
128-aligned column slices (tensor-parallel shards) of a laid-out weight are laid-out slices of the checkpoint's.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 128


@functools.cache
def kernel_order() -> tuple[int, ...]:
    """Memory column m of a 128-wide block -> the kernel's logical column (the map above)."""
    out = []
    for m in range(BLOCK):
        h, a, b3, b2, b1, b0 = m >> 6, (m >> 4) & 3, (m >> 3) & 1, (m >> 2) & 1, (m >> 1) & 1, m & 1
        out.append(64 * h + 32 * b3 + 16 * b2 + 8 * b1 + 2 * a + b0)
    assert sorted(out) == list(range(BLOCK))
    return tuple(out)


ORDERS = ("checkpoint", "kernel")  # an op table's ``fp8_k_order``


@functools.lru_cache(maxsize=64)
def _columns(k: int, device: torch.device, inverse: bool) -> torch.Tensor:
    """Made once per (K, device): a kernel that permutes its activations (``ops/triton/fp8_linear.py``) reuses it
    inside CUDA graphs, which cannot copy a new index tensor to the device (the warm-up before capture made it)."""
    order = torch.tensor(kernel_order(), dtype=torch.int64, device=device)
    if inverse:
        order = torch.argsort(order)
    return (torch.arange(0, k, BLOCK, device=device)[:, None] + order[None, :]).reshape(-1)


def _select(t: torch.Tensor, inverse: bool) -> torch.Tensor:
    k = t.shape[-1]
    if k % BLOCK:
        raise ValueError(f"fp8 K order: the last dim must be whole {BLOCK}-column blocks, got {k}")
    if t.dtype == torch.float8_e4m3fn:  # index_select has no fp8 kernels: move the bytes
        return _select(t.view(torch.uint8), inverse).view(torch.float8_e4m3fn)
    return t.index_select(-1, _columns(k, t.device, inverse))


def to_kernel_order(t: torch.Tensor) -> torch.Tensor:
    """[..., K] (K % 128 == 0) in checkpoint column order -> a new tensor whose column 128b + m holds checkpoint
    column 128b + ``kernel_order()[m]``: the weight layout in which the kernel sums K in natural order (and the
    activations' order that matches a weight in it)."""
    return _select(t, inverse=False)


def to_checkpoint_order(t: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_kernel_order``."""
    return _select(t, inverse=True)


def laid_out(k: int, order: str) -> bool:
    """Whether a weight of K input columns is stored in the kernel's order under an op table's ``order``: whole
    128-column blocks only (other weights keep the checkpoint's)."""
    if order not in ORDERS:
        raise ValueError(f"fp8_k_order: one of {ORDERS}, got {order!r}")
    return order == "kernel" and k % BLOCK == 0


def arrange(codes: torch.Tensor, order: str) -> torch.Tensor:
    """e4m3 codes [N, K] in checkpoint order -> as an op table of ``fp8_k_order`` ``order`` stores them."""
    return to_kernel_order(codes) if laid_out(codes.shape[-1], order) else codes


def checkpoint(codes: torch.Tensor, order: str) -> torch.Tensor:
    """The inverse of ``arrange``."""
    return to_checkpoint_order(codes) if laid_out(codes.shape[-1], order) else codes
