"""FP8 dense weights stored in the swap-AB kernel's K order (``ops/fp8_layout.py``; the batch-invariant Triton
table's layout): a per-block column permutation and its inverse; a table that stores weights so gets them so from
both loading paths and from ``use_op_table`` (stacked projections re-arranged once), and computes the same logits.

The kernel side (the map is the one the kernel's register operand takes) is checked through Triton's interpreter in
``tests/gpu/test_batch_invariant_kernels.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.model.device import FP8Linear, prepare_for_device, use_op_table
from deepinfer.model.loader import load_model
from deepinfer.ops import fp8_layout
from deepinfer.ops.ref import fp8_linear as ref_fp8
from deepinfer.ops.table import REF
from tests.unit.test_quantized_first import assert_same_model, load_then_transform, logits


def _codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_kernel_order_is_the_documented_permutation() -> None:
    order = fp8_layout.kernel_order()
    assert sorted(order) == list(range(128)) and order != tuple(range(128))
    # memory 64h + 16a + 8b3 + 4b2 + 2b1 + b0 -> 64h + 32b3 + 16b2 + 8b1 + 2a + b0, spot checks
    assert order[1] == 1 and order[2] == 8 and order[16] == 2 and order[8] == 32 and order[119] == 95


def test_round_trip_and_blocks() -> None:
    w = _codes(64, 384)
    laid = fp8_layout.to_kernel_order(w)
    assert laid.dtype == torch.float8_e4m3fn and laid.shape == w.shape
    assert not torch.equal(laid.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(fp8_layout.to_checkpoint_order(laid).view(torch.uint8), w.view(torch.uint8))
    # per 128-column block: a 128-aligned column slice (a tensor-parallel shard) of the layout is the layout of
    # the slice; row slices trivially so
    assert torch.equal(laid[:, 128:256].view(torch.uint8), fp8_layout.to_kernel_order(w[:, 128:256]).view(torch.uint8))
    # column 128b + m of the layout is checkpoint column 128b + order[m]
    order = fp8_layout.kernel_order()
    assert torch.equal(laid[:, 128 + 5].view(torch.uint8), w[:, 128 + order[5]].view(torch.uint8))


def test_sums_in_both_orders_are_the_same_dot() -> None:
    x = torch.randn(3, 256, dtype=torch.float64)
    w = torch.randn(5, 256, dtype=torch.float64)
    want = x @ w.t()
    got = fp8_layout.to_kernel_order(x) @ fp8_layout.to_kernel_order(w).t()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_orders_and_bad_input() -> None:
    assert fp8_layout.laid_out(256, "kernel") and not fp8_layout.laid_out(256, "checkpoint")
    assert not fp8_layout.laid_out(200, "kernel")  # partial blocks keep the checkpoint's order
    w = _codes(4, 200)
    assert fp8_layout.arrange(w, "kernel") is w
    with pytest.raises(ValueError, match="fp8_k_order"):
        fp8_layout.laid_out(256, "natural")
    with pytest.raises(ValueError, match="128-column blocks"):
        fp8_layout.to_kernel_order(w)


def _kernel_order_ref():
    """REF reading FP8 weights in kernel order: what the batch-invariant Triton table's FP8 entries read, spelled
    with the reference GEMM (the weight put back in checkpoint order first)."""
    def linear(x, weight, scale, **kw):
        return ref_fp8.fp8_linear(x, fp8_layout.checkpoint(weight, "kernel"), scale, **kw)

    def grouped(x, weight, scale, groups, **kw):
        return ref_fp8.fp8_linear_grouped(x, fp8_layout.checkpoint(weight, "kernel"), scale, groups, **kw)

    return dataclasses.replace(REF, name="ref-kernel-order", fp8_linear=linear, fp8_linear_grouped=grouped,
                               fp8_k_order="kernel")


def _fp8_codes(model) -> dict[str, torch.Tensor]:
    return {n: m.weight_fp8.view(torch.uint8).clone() for n, m in model.named_modules() if isinstance(m, FP8Linear)}


def test_model_in_kernel_order_loads_switches_and_computes_the_same() -> None:
    ids = torch.randint(3, 4096, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    table = _kernel_order_ref()
    plain = load_then_transform(demo_model_dir())
    want_codes, want = _fp8_codes(plain), logits(plain, ids)
    # quantized-first and load-then-transform with the kernel-order table: the same tensors, the same logits
    got = load_model(demo_model_dir(), dtype=torch.float32, progress=False, ops=table)
    transformed = prepare_for_device(load_model(demo_model_dir(), dtype=torch.float32, progress=False,
                                                keep_quantized=True), table)
    assert_same_model(got, transformed)
    codes = _fp8_codes(got)
    moved = 0
    for name, c in codes.items():
        k = c.shape[1]
        expect = fp8_layout.arrange(want_codes[name].view(torch.float8_e4m3fn), "kernel").view(torch.uint8)
        assert torch.equal(c, expect), name
        moved += fp8_layout.laid_out(k, "kernel")
    assert moved > 0  # the demo model has weights of whole 128-column blocks: the layout did move bytes
    assert torch.equal(logits(got, ids), want)
    # switching tables re-arranges every byte once (stacked projections' parts are views of their stack)
    use_op_table(plain, table)
    switched = _fp8_codes(plain)
    assert switched.keys() == codes.keys() and all(torch.equal(switched[n], c) for n, c in codes.items())
    assert torch.equal(logits(plain, ids), want)
    use_op_table(plain, REF)
    assert all(torch.equal(_fp8_codes(plain)[n], c) for n, c in want_codes.items())
