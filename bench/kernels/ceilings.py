"""The card's two ceilings, measured in the same run as the kernels they judge."""

from __future__ import annotations

import torch
import triton.testing


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = int(gib * (1 << 30)) // 2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * a.element_size() / (ms * 1e-3)


def bf16_gemm_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def measure() -> dict:
    return {"copy_bytes_per_s": copy_bandwidth(), "bf16_flops_per_s": bf16_gemm_rate(),
            "gpu": torch.cuda.get_device_name()}
