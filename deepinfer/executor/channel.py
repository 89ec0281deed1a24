"""Messages over torch.distributed: rank 0 broadcasts orders, every rank's reply is gathered on rank 0.

A separate gloo group carries them (also on CUDA worlds, whose model collectives run on NCCL), so the
control plane works wherever the world's rendezvous works, across nodes included. Each message is its
codec bytes in a uint8 tensor, preceded by its length."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.executor.codec import decode, encode


class Channel:
    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")  # every rank calls this, in the same order
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def broadcast(self, message=None):
        """Rank 0 sends ``message``; every rank returns it."""
        size = torch.zeros(1, dtype=torch.int64)
        payload = None
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(encode(message)), dtype=torch.uint8)
            size[0] = len(payload)
        dist.broadcast(size, 0, group=self.group)
        if self.rank != 0:
            payload = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.group)
        return message if self.rank == 0 else decode(payload.numpy().tobytes())

    def gather(self, message) -> list | None:
        """Every rank sends ``message``; rank 0 returns them in rank order, the others None."""
        data = torch.frombuffer(bytearray(encode(message)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        width = max(int(s[0]) for s in sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: len(data)] = data
        parts = [torch.empty(width, dtype=torch.uint8) for _ in sizes] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0, group=self.group)
        if self.rank != 0:
            return None
        return [decode(p[: int(s[0])].numpy().tobytes()) for p, s in zip(parts, sizes)]
