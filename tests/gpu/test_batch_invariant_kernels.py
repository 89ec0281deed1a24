"""The CUDA batch-invariant table (``triton_ops(KernelTuning.invariant())``): GEMM rows have the same bits for
every M.

Oracle rule (determinism.md §6), as for the CPU table (tests/unit/test_batch_invariant_ops.py): a row computed
alone equals, bit for bit, the same row placed at the start, middle and end of calls with other rows, at
sizes that cross every tile bucket and both ways of running the K segments (split-K programs while the
tiles do not fill the GPU, in-program segments once they do). Against the fp32 reference the results agree
within bf16 rounding. And the default table is shown to change a row's bits with M, so that these
comparisons can fail. Attention: a query alone equals the same query inside steps whose index lists are
wider, with its splits run as programs of their own (decode) or inside one program (prefill). (The other
entries of the table, indexer, mHC, routing, experts, compressor, have their own batch-invariance tests
beside their kernels' tests in this folder.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.model.quant import quant_fp8_block, ue8m0_to_float
from deepinfer.ops import fp8_layout
from deepinfer.ops.ref.fp8_linear import fp8_linear as ref_fp8_linear
from deepinfer.ops.ref.fp8_linear import fp8_linear_grouped as ref_fp8_grouped
from deepinfer.ops.tuning import H200
from tests.gpu.conftest import INTERPRET, rel_err
from tests.unit.test_batch_invariant_ops import _rows_invariant

# The interpreter runs the launch logic (segments, splits, tickets) at a small SM count and attention fill
# threshold, so that both launch modes of each op occur at small shapes; the GPU runs the device's own.
SIZES = (2, 7, 16, 17, 40) if INTERPRET else (2, 7, 16, 63, 64, 65, 130, 256, 257, 600, 2048)


# The batch-invariant table's FP8 kernels for power-of-two scales: "swap_ab" (the swap-AB kernel for every M on
# weights in its K order, the default), "swap_ab_checkpoint" (the same on weights in checkpoint order, x permuted in
# registers) and "mma" (the MMA kernel for every M, what other scales take; x permuted to the weights' order).
FP8_KERNELS = ["mma", "swap_ab", "swap_ab_checkpoint"]


def _tables(device: str, fp8: str | None = None):
    """(default table, batch-invariant table); ``fp8``: one of FP8_KERNELS for the invariant table (None: its
    default)."""
    from deepinfer.ops.table import triton_ops

    tuning = dataclasses.replace(H200, num_sms=4, attention_fill_programs=4) if INTERPRET else None
    default = triton_ops(tuning)
    invariant = (tuning or default.tuning).invariant()
    if fp8 is not None:
        invariant = dataclasses.replace(invariant, invariant_fp8_swap_ab=fp8.startswith("swap_ab"),
                                        invariant_fp8_kernel_order=fp8 != "swap_ab_checkpoint")
    return default, triton_ops(invariant)


def _fp8_weight(n: int, k: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    q, s = quant_fp8_block(torch.randn(n, k, generator=g) * 0.05, (128, 128))
    return q.to(device), ue8m0_to_float(s).float().to(device)


def _rows(k: int, device: str, dtype=torch.bfloat16):
    return lambda m, g: (torch.randn(m, k, generator=g).to(device, dtype),)


FP8_SHAPES = [(200, 256)] if INTERPRET else [(4096, 4096), (1536, 4096), (4096, 1024), (24576, 1536), (512, 4096),
                                           (64, 256), (128, 256), (256, 128)]  # the last three: demo-model shapes


@pytest.mark.interpret_ok
@pytest.mark.parametrize("fp8", FP8_KERNELS)
@pytest.mark.parametrize("n, k", FP8_SHAPES)
def test_fp8_linear_rows_are_invariant(n, k, fp8, device) -> None:
    _, table = _tables(device, fp8)
    assert table.batch_invariant and table.name == "triton-batch-invariant"
    w, s = _fp8_weight(n, k, n + k, device)
    assert table.fp8_k_order == ("checkpoint" if fp8 == "swap_ab_checkpoint" else "kernel")
    laid = fp8_layout.arrange(w, table.fp8_k_order)  # as the model stores it for this table
    fn = lambda x: table.fp8_linear(x, laid, s, pow2_scales=True)  # noqa: E731 (UE8M0: every fast path eligible)
    _rows_invariant(fn, _rows(k, device), SIZES)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    assert rel_err(fn(x), ref_fp8_linear(x.float(), w, s)) <= 1e-2


@pytest.mark.interpret_ok
@pytest.mark.parametrize("fp8", FP8_KERNELS)
def test_fp8_linear_grouped_rows_are_invariant(fp8, device) -> None:
    _, table = _tables(device, fp8)
    groups, r, k = (2, 128, 256) if INTERPRET else (8, 1024, 4096)  # V4-Flash wo_a: 8 groups of 1024 rows
    w, s = _fp8_weight(groups * r, k, 5, device)
    laid = fp8_layout.arrange(w, table.fp8_k_order)
    fn = lambda x: table.fp8_linear_grouped(x, laid, s, groups, pow2_scales=True)  # noqa: E731
    _rows_invariant(fn, _rows(groups * k, device), SIZES)
    x = torch.randn(70, groups * k, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    assert rel_err(fn(x), ref_fp8_grouped(x.float(), w, s, groups)) <= 1e-2


@pytest.mark.interpret_ok
def test_kernel_order_is_the_swap_ab_kernels_register_order(device) -> None:
    """``ops/fp8_layout.kernel_order`` is the order in which the swap-AB kernel's register operand takes a block's
    memory columns: the kernel's own map (``_logical_cols``, which it applies to x when the weight is in checkpoint
    order) sends memory column m to logical column kernel_order[m]."""
    global _logical_cols  # the kernel below resolves it among this module's globals when it compiles
    import triton
    import triton.language as tl

    from deepinfer.ops.triton.fp8_linear import _logical_cols

    @triton.jit
    def cols(src, dst):
        r = tl.arange(0, 16)[:, None]
        c = tl.arange(0, 64)[None, :]
        t = tl.join(tl.load(src + r * 128 + c), tl.load(src + r * 128 + 64 + c))
        tl.store(dst + r * 128 + tl.arange(0, 128)[None, :], _logical_cols(t, 16))

    src = torch.arange(128, dtype=torch.int32, device=device).repeat(16, 1)
    dst = torch.empty_like(src)
    cols[(1,)](src, dst)
    order = torch.tensor(fp8_layout.kernel_order(), dtype=torch.int32, device=device)
    want = torch.empty_like(order)
    want[order.long()] = torch.arange(128, dtype=torch.int32, device=device)  # logical column j holds memory m
    assert torch.equal(dst, want.repeat(16, 1))


BF16_SHAPES = [(256, 4096), (2624, 4096), (1024, 4096), (129280, 4096), (4096, 256)]


# Not in the interpreter: its tl.dot is numpy's matmul, whose bits for a row depend on the tile's token count
# (another BLAS path per shape), while the GPU's wgmma sums each output alone whatever the tile's N side.
@pytest.mark.parametrize("n, k", BF16_SHAPES)
def test_bf16_linear_and_dense_rows_are_invariant(n, k, device) -> None:
    """Router, side projections, LM head: ``linear`` and ``dense`` are the same kernel for every M."""
    _, table = _tables(device)
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, torch.bfloat16)
    sizes = SIZES if n < 100_000 else (2, 7, 64, 65, 257)
    dtype = torch.bfloat16
    _rows_invariant(lambda x: table.linear(x, w.to(dtype)), _rows(k, device, dtype), sizes)
    x3 = torch.randn(3, 5, k, generator=g).to(device, dtype)  # leading dims flatten into rows
    assert torch.equal(table.dense(x3, w.to(dtype)), table.linear(x3.reshape(15, k), w.to(dtype)).view(3, 5, n))
    assert rel_err(table.dense(x3, w.to(dtype)).float(), x3.float() @ w.float().T) <= 1e-2


def test_grouped_dense_rows_are_invariant(device) -> None:  # not in the interpreter: see above
    _, table = _tables(device)
    dtype = torch.bfloat16
    w = (torch.randn(2 * 96, 128, generator=torch.Generator().manual_seed(3)) * 0.1).to(device, dtype)
    _rows_invariant(lambda x: table.dense_grouped(x.transpose(0, 1), w).transpose(0, 1),
                    lambda m, g: (torch.randn(m, 2, 128, generator=g).to(device, dtype),), SIZES)


def test_default_table_changes_rows_with_the_batch(device) -> None:
    """The comparison has teeth: the default FP8 and bf16 GEMMs (decode path, split-K by M, weight-as-A at
    large M, cuBLAS) give some row other bits at some M."""
    default, _ = _tables(device)
    w, s = _fp8_weight(4096, 4096, 7, device)
    with pytest.raises(AssertionError, match="differs"):
        _rows_invariant(lambda x: default.fp8_linear(x, w, s, pow2_scales=True), _rows(4096, device), SIZES)
    wb = (torch.randn(1024, 4096, generator=torch.Generator().manual_seed(8)) * 0.02).to(device, torch.bfloat16)
    with pytest.raises(AssertionError, match="differs"):
        _rows_invariant(lambda x: default.dense(x, wb), _rows(4096, device), SIZES)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("c", [256, 512, 1536, 4096])
def test_rms_norm_rows_are_invariant(c, device) -> None:
    """The norm packs several short rows into one program; the packing must not follow the row count (the
    demo model's C = 256 rows changed by a bf16 ulp with the batch before it was fixed)."""
    _, table = _tables(device)
    w = (torch.rand(c, generator=torch.Generator().manual_seed(c)) + 0.5).to(device)
    _rows_invariant(lambda x: table.rms_norm(x, w, 1e-6), _rows(c, device), SIZES)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("c", [128, 1536])
def test_latent_norms_rows_are_invariant(c, device) -> None:
    """The attention block's q-latent norm (in one launch with the kv row's norm and RoPE into the window) packs
    the rows as ``rms_norm`` does; the packing must not follow the row count (the demo model's q latent, C = 128,
    changed by a bf16 ulp with the batch before it was fixed). The angles are a function of the row's values, so
    a row placed anywhere carries its own."""
    _, table = _tables(device)
    kv, rope = 64, 16
    g = torch.Generator().manual_seed(c)
    wq, wkv = ((torch.rand(n, generator=g) + 0.5).to(device) for n in (c, kv))

    def run(x):
        ang = x[:, : rope // 2].float() * 3
        window = torch.zeros(len(x), kv, dtype=x.dtype, device=device)
        rows = torch.arange(len(x), device=device)
        q = table.latent_norms(x, c, wq, 1e-6, wkv, 1e-6, ang.cos(), ang.sin(), window=window, rows=rows)
        return q, window

    _rows_invariant(run, _rows(c + kv, device), SIZES)


ATT = (4, 64, 64) if INTERPRET else (64, 512, 512)  # heads, head dim, window columns (V4: 64 x 512, 128-key window)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("extra", [0, 200, 2176])  # one source; two (CSA-like, HCA at 280K context)
def test_attention_rows_are_invariant(extra, device) -> None:
    """A query alone (its own index width) equals the same query inside steps of other queries whose lists
    are wider (padding columns), at step sizes that run the splits as programs of their own (decode) and
    inside each program (prefill); within bf16 rounding of the reference."""
    from deepinfer.ops.ref.sparse_attention import sparse_attention_indexed as ref_attention

    _, table = _tables(device)
    h, d, window = ATT
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    g = torch.Generator().manual_seed(extra + 1)
    rows = 4096
    kv, kv2 = (torch.randn(rows, d, generator=g).to(device, dtype) for _ in range(2))
    sinks = torch.randn(h, generator=g).to(device)

    def lists(m: int, width: int, n: int) -> torch.Tensor:
        idx = torch.stack([torch.randperm(rows, generator=g)[:width] for _ in range(m)]).to(torch.int32)
        idx[:, n:] = -1  # this query's own columns end at n; the rest is the step's padding
        return idx.to(device)

    def make(m: int, gen: torch.Generator):
        q = torch.randn(m, h, d, generator=gen).to(device, dtype)
        pad = 64 if m > 1 else 0  # other queries see more keys: every list of the step is wider
        idx = lists(m, window + pad, window)
        idx2 = lists(m, extra + pad, extra) if extra else None
        return (q, idx) if not extra else (q, idx, idx2)

    def attend(q, idx, idx2=None):
        return table.sparse_attention_indexed(q, kv, idx, sinks, d**-0.5, kv2 if extra else None, idx2)

    def widen(t: torch.Tensor, width: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((len(t), width - t.shape[1]), -1)], dim=1)

    base = make(1, torch.Generator().manual_seed(1))
    alone = attend(*base)
    for m in (2, 5) if INTERPRET else (2, 3, 4, 5, 16, 64, 300):
        batch = list(make(m, torch.Generator().manual_seed(100 + m)))
        for at in (0, m // 2, m - 1):
            rows_ = [b.clone() for b in batch]
            rows_[0][at] = base[0][0]
            for i in range(1, len(rows_)):  # the base query's lists, padded to the step's width
                rows_[i][at] = widen(base[i], rows_[i].shape[1])[0]
            assert torch.equal(attend(*rows_)[at], alone[0]), f"row at {at} of {m} differs"
    q, idx, *idx2 = make(5, torch.Generator().manual_seed(7))
    got = attend(q, idx, *idx2)
    want = ref_attention(q.float(), kv.float(), idx, sinks, d**-0.5, kv2.float() if extra else None,
                         idx2[0] if extra else None)
    assert rel_err(got.float(), want) <= (1e-4 if INTERPRET else 1e-2)
