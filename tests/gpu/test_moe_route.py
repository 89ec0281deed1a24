"""Triton MoE routing (``ops/triton/moe_route.py``) against ``route`` of ``ops/ref/moe.py``.

Fixed-seed inputs per case: gate-like logits (randn x 2), a small fp32 bias, E in {8, 72, 256} (72: E not a
power of two, padded lanes must never win), k in {2, 6}, T in {1, 7, 300} (and 4096 on a GPU). Tie cases
draw logits (and the bias) from a handful of values, so most rows hold exact ties at the top-k boundary and
pin the rule: larger value first, equal values in expert order. Hash routing, rows of equal logits and
non-finite logits (NaN sorts first, as in torch's sort) are covered too.

Indices must be torch.equal to the reference's. Weights: fp32 rel_err <= 1e-6 (the softmax row sum and the
normalising sum run in another order: measured <= 1e-7 in the interpreter, an fp32 ulp or two; a weight from
the biased score, or a missing normalisation, is >= 1e-2 off). bf16: the kernel rounds where the reference
rounds, and a sum of six bf16 weights is exact in fp32, so weights agree bit for bit wherever the scores do
(measured: identical); the bound 4e-3 admits a one-ulp (2^-8 relative) move of every weight, which an fp32
ulp in a softmax sum can cause, and stays far below a skipped rounding step or a wrong weight.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.ref.moe import route
from tests.gpu.conftest import rel_err

TOL = {torch.bfloat16: 4e-3, torch.float32: 1e-6}
FUNCS = ["sqrtsoftplus", "sigmoid", "softmax"]
DTYPES = [torch.bfloat16, torch.float32]


def _tri():
    from deepinfer.ops.triton.moe_route import moe_route

    return moe_route


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _case(T: int, E: int, dtype, bias: bool, seed: int, device: str, ties: bool = False):
    g = _gen(seed)
    if ties:  # few distinct values, all exact in bf16: many equal scores (and selection values) per row
        logits = torch.randint(-3, 4, (T, E), generator=g).float() * 0.5
        b = torch.randint(0, 3, (E,), generator=g).float() * 0.25
    else:
        logits = torch.randn(T, E, generator=g) * 2
        b = torch.randn(E, generator=g) * 0.1
    return logits.to(dtype).to(device), (b.to(device) if bias else None)


def _check(logits, func, k, norm, bias=None, hash_indices=None, factor=1.5):
    want_w, want_i = route(logits, func, k, norm, factor, bias=bias, hash_indices=hash_indices)
    w, i = _tri()(logits, func, k, norm, factor, bias=bias, hash_indices=hash_indices)
    assert i.dtype == torch.int64 and i.shape == want_i.shape
    assert torch.equal(i, want_i), (i, want_i)
    assert w.dtype == want_w.dtype == logits.dtype and w.shape == want_w.shape
    assert torch.isfinite(w).all()
    assert rel_err(w, want_w) <= TOL[logits.dtype], rel_err(w, want_w)
    return w, i


@pytest.mark.interpret_ok
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("E, k", [(8, 2), (72, 6), (256, 6)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_small(T, E, k, norm, bias, func, dtype, device) -> None:
    logits, b = _case(T, E, dtype, bias, seed=T * 31 + E + k, device=device)
    _check(logits, func, k, norm, bias=b)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("E, k", [(8, 2), (256, 2), (256, 6)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_ties(E, k, bias, func, dtype, device) -> None:
    logits, b = _case(7, E, dtype, bias, seed=E + k, device=device, ties=True)
    sel = route(logits, func, E, False, 1.0, bias=b)[0] if b is None else None
    if sel is not None:  # the case really ties at the boundary: k-th and (k+1)-th values are equal
        assert (sel[:, k - 1] == sel[:, k]).any()
    _check(logits, func, k, True, bias=b)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_v4_flash_300(func, dtype, device) -> None:
    """V4-Flash router shape (256 experts, k = 6, bias, normalised, x1.5) at a prefill-sized T."""
    logits, b = _case(300, 256, dtype, True, seed=300, device=device)
    _check(logits, func, 6, True, bias=b)


@pytest.mark.parametrize("T", [300, 4096])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_large(T, bias, func, dtype, device) -> None:
    logits, b = _case(T, 256, dtype, bias, seed=T + 1, device=device)
    _check(logits, func, 6, True, bias=b)


HASH = [pytest.param(T, norm, marks=pytest.mark.interpret_ok) for T in (1, 7) for norm in (True, False)]


@pytest.mark.parametrize("T, norm", HASH + [pytest.param(300, True, marks=pytest.mark.interpret_ok), (300, False)])
@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_hash(T, norm, func, dtype, device) -> None:
    logits, _ = _case(T, 256, dtype, False, seed=T + 7, device=device)
    tid2eid = torch.stack([torch.randperm(256, generator=_gen(9 + v))[:6] for v in range(50)]).to(device)
    hash_indices = tid2eid[torch.randint(0, 50, (T,), generator=_gen(T)).to(device)]
    _, i = _check(logits, func, 6, norm, hash_indices=hash_indices)
    assert i.data_ptr() == hash_indices.data_ptr()  # int64 ids pass through, as in the reference
    w32, i32 = _tri()(logits, func, 6, norm, 1.5, hash_indices=hash_indices.int())
    assert i32.dtype == torch.int64 and torch.equal(i32, i)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("func", FUNCS)
def test_route_equal_row_picks_lowest_experts(func, device) -> None:
    logits = torch.zeros(3, 256, device=device)
    w, i = _check(logits, func, 6, True)
    assert torch.equal(i, torch.arange(6, device=device).expand(3, 6))
    assert torch.allclose(w, torch.full_like(w, 0.25))


@pytest.mark.interpret_ok
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's log1p at +inf
@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid"])
def test_route_non_finite(func, device) -> None:
    """NaN first (in expert order), then +inf; -inf ranks last but still above the padded lanes."""
    logits = torch.randn(4, 72, generator=_gen(3))
    logits[0, [5, 9]] = float("nan")
    logits[1, [3, 40]] = float("inf")
    logits[2, :] = float("-inf")
    logits[3, 60:] = float("-inf")
    logits = logits.to(device)
    want_w, want_i = route(logits, func, 6, False, 1.0)
    w, i = _tri()(logits, func, 6, False, 1.0)
    assert torch.equal(i, want_i)
    assert torch.equal(i[0, :2].cpu(), torch.tensor([5, 9]))
    assert torch.allclose(w, want_w, equal_nan=True)


@pytest.mark.interpret_ok
def test_route_batch_invariant_and_empty(device) -> None:
    logits, b = _case(9, 256, torch.bfloat16, True, seed=4, device=device)
    w, i = _tri()(logits, "sqrtsoftplus", 6, True, 1.5, bias=b)
    for t in (0, 4, 8):
        w1, i1 = _tri()(logits[t:t + 1], "sqrtsoftplus", 6, True, 1.5, bias=b)
        assert torch.equal(w1[0], w[t]) and torch.equal(i1[0], i[t])
    w0, i0 = _tri()(logits[:0], "sqrtsoftplus", 6, True, 1.5, bias=b)
    assert w0.shape == i0.shape == (0, 6)


@pytest.mark.interpret_ok
def test_op_table_entries(device) -> None:
    from deepinfer.model.moe import MoE
    from deepinfer.ops.table import REF, triton_ops

    assert REF.moe_route is route and MoE.ops is REF
    assert triton_ops().moe_route is _tri()
