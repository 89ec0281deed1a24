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

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float64: np.float64, torch.float32: np.float32,
          torch.bool: np.bool_}


def to_device(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A tensor of ``values`` on ``device`` (1-D, or an array's shape), queued without a device sync (a plain
    tensor on the CPU)."""
    if device.type == "cpu":
        # A list through numpy: its conversion of Python numbers is ~3x faster than torch.tensor's (the same
        # values; the CPU runner makes a few of these a step).
        if isinstance(values, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        as_numpy = _NUMPY.get(dtype)
        if as_numpy is None:
            return torch.tensor(values, dtype=dtype)
        return torch.from_numpy(np.array(values, dtype=as_numpy))
    shape = values.shape if isinstance(values, np.ndarray) else (len(values),)
    host = torch.empty(shape, dtype=dtype, pin_memory=True)
    host.numpy()[:] = values
    return host.to(device, non_blocking=True)
