"""runner/transfer.py: the CPU path builds lists through numpy; the tensors equal torch.tensor's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.runner.transfer import to_device

CPU = torch.device("cpu")


@pytest.mark.parametrize("values, dtype", [
    ([3, -1, 2**40], torch.int64), ([], torch.int64), ((4, 5), torch.int64), ([True, False, 2], torch.int64),
    ([0.1, 1e300, -2.5, 7], torch.float64), ([0.1, 3.3e38, 1], torch.float32), ([1, 0, 2], torch.bool),
    ([1, 2], torch.int16),
])
def test_lists_match_torch_tensor(values, dtype):
    got, want = to_device(values, dtype, CPU), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_arrays_keep_their_values():
    a = np.arange(6, dtype=np.int32)[::2]  # not contiguous
    got = to_device(a, torch.int64, CPU)
    assert got.dtype == torch.int64 and got.tolist() == [0, 2, 4]
