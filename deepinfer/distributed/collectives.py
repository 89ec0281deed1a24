"""The collectives the sharded modules use, with the row bookkeeping they need (variable row counts per
rank, zero rows included: a rank without tokens still joins every call, so nothing waits forever).

gloo has no bfloat16/float16 reductions in every build: there, 16-bit tensors are summed in fp32 and
rounded once (closer to the exact sum than a 16-bit ring); moved tensors travel as their raw bits.

Ranks that share one CUDA device (``LaunchConfig.ranks_share_device``) run their model collectives over gloo,
which takes CUDA tensors for few operations and not on every build (no all-to-all, no all-gather): there,
every collective copies its CUDA inputs to host memory, runs the CPU gloo path, and copies the result back
to the device (``_stages``). A host copy waits for the device, so such a collective can never be captured in
a CUDA graph (the ranks capture none: ``executor/rank.py``); ``_host`` refuses to run inside a capture.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_HALF = (torch.bfloat16, torch.float16)
_CPU = torch.device("cpu")


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _stages(group, device: torch.device) -> bool:
    """Whether a collective over ``group`` moves tensors of ``device`` through host memory: gloo groups with
    tensors that are not on the CPU (a world whose ranks share one CUDA device)."""
    return device.type != "cpu" and _is_gloo(group)


def _host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x`` (always a copy: the collectives below may write into it)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a collective staged through host memory (ranks_share_device) cannot run inside a CUDA "
                           "graph capture; the ranks of such a world run their steps eagerly")
    return x.to(_CPU, copy=True)


def all_reduce(x: torch.Tensor, group, ordered: bool = False) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (``None``: a group of one, ``x`` itself).

    ``ordered`` (the batch-invariant mode): every rank's tensor is gathered and the sum runs in rank order,
    ((x_0 + x_1) + x_2) + ..., 16-bit tensors in fp32 and rounded once, as the gloo path below. A library
    all-reduce sums each element in an order that depends on where it falls in the tensor's chunks, i.e. on
    the tensor's size, i.e. on the batch (from three ranks on; two summands commute exactly)."""
    if group is None:
        return x
    if _stages(group, x.device):
        return _all_reduce(_host(x), group, ordered).to(x.device)
    return _all_reduce(x, group, ordered)


def _all_reduce(x: torch.Tensor, group, ordered: bool) -> torch.Tensor:
    if ordered:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        x = x.contiguous()
        if _is_gloo(group):
            dist.all_gather([_bits(p) for p in parts], _bits(x), group=group)
        else:
            dist.all_gather(parts, x, group=group)
        total = parts[0].float() if x.dtype in _HALF else parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.to(x.dtype)
    if x.dtype in _HALF and _is_gloo(group):
        wide = x.float()
        dist.all_reduce(wide, group=group)
        return wide.to(x.dtype)
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _bits(x: torch.Tensor) -> torch.Tensor:
    """16-bit floats as their bytes (gloo moves uint8 but not every 16-bit type), rows kept on dim 0."""
    return x.unsqueeze(-1).view(torch.uint8) if x.dtype in _HALF else x


def exchange_counts(send: list[int], group, device: torch.device) -> list[int]:
    """Each rank sends ``send[r]`` rows to rank r; returns how many rows each rank sends to this one (a host
    sync: the row counts size the exchange that follows)."""
    if _stages(group, device):  # the counts come from and go to the host anyway
        device = _CPU
    out = torch.empty(len(send), dtype=torch.int64, device=device)
    dist.all_to_all_single(out, torch.tensor(send, dtype=torch.int64, device=device), group=group)
    return out.tolist()


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(send[:r]) : sum(send[:r+1])]`` go to rank r; returns the received rows by source rank."""
    if _stages(group, x.device):
        return _all_to_all_rows(_host(x), send, recv, group).to(x.device)
    return _all_to_all_rows(x, send, recv, group)


def _all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    if _is_gloo(group):
        dist.all_to_all_single(_bits(out), _bits(x.contiguous()), recv, send, group=group)
    else:
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's rows (rank r holds ``sizes[r]`` rows, known to all) in rank order."""
    if group is None:
        return x
    if _stages(group, x.device):
        return _all_gather_rows(_host(x), sizes, group).to(x.device)
    return _all_gather_rows(x, sizes, group)


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    width = max(sizes)
    padded = x.new_zeros(width, *x.shape[1:])
    padded[: len(x)] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    if _is_gloo(group):
        dist.all_gather([_bits(p) for p in parts], _bits(padded), group=group)
    else:
        dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def broadcast_rows(x: torch.Tensor, src: int, group) -> torch.Tensor:
    """``x`` of global rank ``src`` on every rank of ``group`` (the others pass a tensor of the same shape and
    dtype to receive into); returns it."""
    if group is None:
        return x
    x = x.contiguous()
    if _stages(group, x.device):
        x.copy_(_broadcast(_host(x), src, group))  # received in place, as on the direct path
        return x
    return _broadcast(x, src, group)


def _broadcast(x: torch.Tensor, src: int, group) -> torch.Tensor:
    dist.broadcast(_bits(x) if _is_gloo(group) else x, src, group=group)
    return x
