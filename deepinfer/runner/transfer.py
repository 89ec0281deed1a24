"""Host-to-device copies that do not stall the device queue.

A copy from pageable host memory makes CUDA finish every queued kernel first (the driver stages the bytes
synchronously), so a single ``torch.tensor(list, device="cuda")`` in a step's preparation would wait for
the previous step and undo async scheduling. Staged through pinned memory the copy is queued like a
kernel; PyTorch's caching host allocator keeps the pinned block alive until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device``, queued without a device sync (a plain tensor on the CPU)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype) if not isinstance(values, np.ndarray) else \
            torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    host = torch.empty(len(values), dtype=dtype, pin_memory=True)
    host.numpy()[:] = values
    return host.to(device, non_blocking=True)
