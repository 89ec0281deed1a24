"""Host -> device copies of checkpoint tensors through two reusable pinned staging buffers.

A pageable ``tensor.to("cuda")`` first waits for the stream's earlier work, then holds the host while the
driver copies the bytes through its own bounce buffer, so reading the next tensor waits for every copy. Here the host copies each tensor into one
of two pinned buffers and the device takes it from there with a non-blocking copy on the current stream:
the transfer of one tensor overlaps the reading, checking and copying of the next. A buffer is refilled
only once its previous transfer has finished (an event per buffer says when). The device tensor is new,
filled in stream order, so every later use on that stream sees its bytes.

Tensors larger than a buffer (V4's embedding and head, about 1 GB each) are left on the host and copied
by their loader as before: staging them would put a second copy of each on the device, for two tensors
out of tens of thousands. On the CPU there is nothing to stage (``for_device`` gives None).
"""

from __future__ import annotations

import torch

# Bytes of each of the two pinned buffers: above every tensor of V4-Flash but the embedding and the head (the
# largest, attention projections, are 32 MB), small beside the host's shard pages.
STAGING_BYTES = 64 << 20


class HostStaging:
    def __init__(self, device: torch.device, capacity: int = STAGING_BYTES) -> None:
        self.device = device
        self.capacity = capacity
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    @classmethod
    def for_device(cls, device: torch.device | str) -> HostStaging | None:
        """Staging for a model on ``device``: CUDA devices only."""
        device = torch.device(device)
        return cls(device) if device.type == "cuda" else None

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device, filled asynchronously on the current stream; ``t`` itself when it is not on
        the host, is empty or does not fit a buffer."""
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes == 0 or nbytes > self.capacity:
            return t
        if not self._buffers:
            self._buffers = [torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        i, self._turn = self._turn, 1 - self._turn
        previous = self._events[i]
        if previous is not None:
            previous.synchronize()  # the buffer's last transfer has left it
        staged = self._buffers[i][:nbytes]
        staged.copy_(t.contiguous().reshape(-1).view(torch.uint8))
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        out.reshape(-1).view(torch.uint8).copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._events[i] = event
        return out

    def close(self) -> None:
        """Wait for the transfers in flight and give the pinned buffers back."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._buffers, self._events = [], [None, None]
