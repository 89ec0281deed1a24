"""GPU kernel tests: run on CUDA; skipped without it.

With ``TRITON_INTERPRET=1`` (and Triton installed) they also run on the CPU through Triton's interpreter,
at the small shapes marked ``interpret_ok``, which is how kernels are developed without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    if INTERPRET:
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
        return "cpu"
    return None


@pytest.fixture(scope="session")
def device() -> str:
    dev = _device()
    if dev is None:
        pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with Triton installed)")
    return dev


def pytest_collection_modifyitems(config, items):
    dev = _device()
    for item in items:
        if "tests/gpu" not in str(item.fspath):
            continue
        if dev is None:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (or TRITON_INTERPRET=1)"))
        elif dev == "cpu" and item.get_closest_marker("interpret_ok") is None:
            item.add_marker(pytest.mark.skip(reason="too large for the Triton interpreter"))


def poison_scratch_exact_fp32(monkeypatch: pytest.MonkeyPatch, kernels) -> None:
    """Scratch buffers of ``kernels`` (a module with ``POISON_SCRATCH``) start as NaN, so an element no program
    wrote cannot pass; and fp32 references run without tf32 (which would put 1e-3 error in them)."""
    monkeypatch.setattr(kernels, "POISON_SCRATCH", True)
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere fails."""
    out64, ref64 = out.double(), ref.double()
    if torch.isnan(out64).any():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
