"""Host -> device copies through the loader's pinned staging buffers (``model/host_staging.py``) give the bytes a
plain ``.to("cuda")`` gives, for every dtype a checkpoint holds, with the two buffers reused many times over while
earlier copies may still be in flight; tensors above a buffer are left on the host."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.host_staging import HostStaging


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def test_staged_uploads_hold_the_host_bytes(device) -> None:
    if device != "cuda":
        pytest.skip("needs CUDA (pinned memory)")
    g = torch.Generator().manual_seed(0)
    capacity = 1 << 16
    staging = HostStaging(torch.device("cuda"), capacity)
    tensors = [torch.randn(64, 96, generator=g).to(torch.bfloat16),
               torch.randn(128, 128, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn),
               torch.randint(0, 255, (32, 4), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
               torch.randint(-128, 128, (256, 64), generator=g, dtype=torch.int8),
               torch.randint(0, 16, (7, 6), generator=g),  # int64 (hash tables)
               torch.tensor(3.5),  # 0-d
               torch.randn(48, 80, generator=g).t(),  # not contiguous
               torch.rand(300, generator=g) > 0.5,
               torch.empty(0, 4),
               torch.randn(capacity, generator=g)]  # 4x a buffer: stays on the host
    # Many uploads in a row: each buffer is refilled only after its previous transfer finished.
    rounds = [[staging.upload(t) for t in tensors] for _ in range(8)]
    staging.close()
    for outs in rounds:
        for t, out in zip(tensors, outs):
            if t.numel() * t.element_size() > capacity:
                assert out is t
                continue
            if t.numel():
                assert out.device.type == "cuda"
            assert (out.dtype, out.shape) == (t.dtype, t.shape)
            assert torch.equal(_bytes(out), _bytes(t))
    assert HostStaging.for_device("cpu") is None
