"""RMSNorm and RoPE of the attention block in one Triton kernel; twins of ``ops/ref/rope_norm.py``.

Why: in PyTorch the q path (per-head RMSNorm, then RoPE) is ~15 launches per layer (upcasts, square, mean,
rsqrt, casts, the rotated pairs, a ``cat`` of nope and rope parts of the whole [T, 64, 512] q), and the kv
path, the indexer q and the output de-rotation add as many again; in decode the launches set the time, in
prefill the copies do. Here each of those is one launch, reading and writing each element once.

Same signatures as the reference, plus keyword-only ``out=`` for ``rms_norm`` and ``norm_rope``.
``norm_rope_heads`` and ``rope`` write into their input and return it (``rope`` touches only the last R
channels of each row: the nope part is neither read nor written, so nothing is concatenated).

One kernel, ``_norm_rope_kernel``, with the step choices as constexprs. The input is seen as rows [T, H, W]
(token, head, channel; ``rms_norm`` of [N, C] is one "token" of N rows, ``norm_rope`` is H = 1); a program
owns one token's block of BLOCK_H rows x the whole row (BLOCK_W = next_pow2(W) channels), so the norm and
the RoPE pairs need no cross-program step. Tiles hold about TILE_ELEMS values and are a function of (H, W)
only, never of T: a row's reduction order is the same whatever the batch. No atomics, no host syncs, the
grid comes from tensor shapes: safe to capture in a CUDA graph.

Numerics follow the reference's steps one for one:
  weighted    x in fp32, var = sum(x*x) * (1/W) in fp32, x * rsqrt(var + eps), times the fp32 weight,
              one rounding to the activation dtype;
  unweighted  the fp32 rsqrt factor rounded to the activation dtype, the product rounded (the product of
              two bf16/fp16 values is exact in fp32, so this is the model-dtype multiply);
  RoPE        the (rounded) activation in fp32 times the model-dtype cos/sin: even' = e*c - o*s,
              odd' = o*c + e*s (inverse: s -> -s), each product and the sum rounded in fp32, one rounding.
The launch sets ``enable_fp_fusion=False``: otherwise the compiler contracts x*x + acc and e*c - o*s into
FMAs, which skip the roundings PyTorch's separate kernels do. Differences left, at fp32 rounding level:
the sum of squares runs in another order than torch's reduction; 1/W is a multiply (exact for power-of-two
W, as in every model shape; torch's CUDA mean multiplies by 1/W too); rsqrt is the hardware approximation
(a few fp32 ulps; torch's CUDA rsqrt is an approximate rsqrtf too, its CPU one 1/sqrt). In bf16 an fp32-ulp
difference in the variance can move the rounded factor or output by one bf16 ulp now and then (the RoPE
alone is bit-exact); in fp32 results agree to ~1e-7 relative.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton.rounding import round_to

# Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest even: see ``ops/triton/rounding.py``.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Values per [BLOCK_H, BLOCK_W] fp32 tile: 32 per thread at 4 warps (q: 8 heads x 512, indexer: 64 x 64).
TILE_ELEMS = 4096
NORM_NONE, NORM_UNWEIGHTED, NORM_WEIGHTED = 0, 1, 2




@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, orow_ptr,
    H, W, COL0, ROPE_OFF, inv_w, eps,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, stride_sin,
    NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, INTERPRET: tl.constexpr, OUT_ROWS: tl.constexpr = False,
):
    _norm_rope_program(tl.program_id(0), x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, orow_ptr, H, W, COL0, ROPE_OFF,
                       inv_w, eps, stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, stride_sin, NORM, ROPE,
                       INVERSE, BLOCK_H, BLOCK_W, INTERPRET, OUT_ROWS)


@triton.jit(do_not_specialize=["FIRST"])
def _norm_rope_pair_kernel(
    FIRST,  # programs of job A; job B's program i is program FIRST + i
    xa, wa, ca, sa, oa, ra, Ha, Wa, C0a, ROa, iwa, epsa, sxta, sxha, sota, soha, scosa, ssina,
    xb, wb, cb, sb, ob, rb, Hb, Wb, C0b, ROb, iwb, epsb, sxtb, sxhb, sotb, sohb, scosb, ssinb,
    NORM_A: tl.constexpr, ROPE_A: tl.constexpr, INVERSE_A: tl.constexpr, BLOCK_H_A: tl.constexpr,
    BLOCK_W_A: tl.constexpr, OUT_ROWS_A: tl.constexpr,
    NORM_B: tl.constexpr, ROPE_B: tl.constexpr, INVERSE_B: tl.constexpr, BLOCK_H_B: tl.constexpr,
    BLOCK_W_B: tl.constexpr, OUT_ROWS_B: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Two launches of ``_norm_rope_kernel`` as one: each program runs exactly what it would run in its own
    job's launch (same code, same tile), so the results are the same bits and one launch is saved."""
    pid = tl.program_id(0)
    if pid < FIRST:
        _norm_rope_program(pid, xa, wa, ca, sa, oa, ra, Ha, Wa, C0a, ROa, iwa, epsa, sxta, sxha, sota, soha, scosa,
                           ssina, NORM_A, ROPE_A, INVERSE_A, BLOCK_H_A, BLOCK_W_A, INTERPRET, OUT_ROWS_A)
    else:
        _norm_rope_program(pid - FIRST, xb, wb, cb, sb, ob, rb, Hb, Wb, C0b, ROb, iwb, epsb, sxtb, sxhb, sotb, sohb,
                           scosb, ssinb, NORM_B, ROPE_B, INVERSE_B, BLOCK_H_B, BLOCK_W_B, INTERPRET, OUT_ROWS_B)


@triton.jit
def _norm_rope_program(
    pid, x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, orow_ptr,
    H, W, COL0, ROPE_OFF, inv_w, eps,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, stride_sin,
    NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, INTERPRET: tl.constexpr, OUT_ROWS: tl.constexpr,
):
    # Program pid = token * head blocks + head block (axis 0 has no 65535 limit; prefill has many tokens).
    n_hb = tl.cdiv(H, BLOCK_H)
    t = (pid // n_hb).to(tl.int64)
    offs_h = ((pid % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    w_mask = offs_w < W
    mask = (offs_h < H)[:, None] & w_mask[None, :]
    DT: tl.constexpr = out_ptr.dtype.element_ty
    # COL0 skips the nope channels when only RoPE runs (they stay untouched in memory).
    x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + COL0 + offs_w[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if NORM == 0:
        y = x
    else:
        # Padded channels load 0 and add nothing; W real channels set the mean.
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_w + eps)
        if NORM == 1:
            y = round_to(x * round_to(r, DT, INTERPRET)[:, None], DT, INTERPRET)
        else:
            wt = tl.load(w_ptr + offs_w, mask=w_mask, other=0.0).to(tl.float32)
            y = round_to(wt[None, :] * (x * r[:, None]), DT, INTERPRET)
    if ROPE:
        # Pair p = channels (2p, 2p+1) of the tile; pairs from ROPE_OFF on rotate by angle p - ROPE_OFF.
        ev, od = tl.split(tl.reshape(y, [BLOCK_H, BLOCK_W // 2, 2]))
        offs_p = tl.arange(0, BLOCK_W // 2)
        j = offs_p - ROPE_OFF
        r_mask = (j >= 0) & (offs_p < W // 2)
        c = tl.load(cos_ptr + t * stride_cos + j, mask=r_mask, other=1.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_sin + j, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        if INVERSE:
            s = -s
        # tl.where, not cos 1 / sin 0: nope pairs keep their exact values even if a partner is inf.
        e2 = tl.where(r_mask[None, :], ev * c - od * s, ev)
        o2 = tl.where(r_mask[None, :], od * c + ev * s, od)
        y = round_to(tl.reshape(tl.join(e2, o2), [BLOCK_H, BLOCK_W]), DT, INTERPRET)
    # y is exactly representable in DT here: the store's cast only narrows the container. With OUT_ROWS, token
    # t's rows go to output row orow[t] (a cache write without a separate scatter launch).
    t_out = tl.load(orow_ptr + t).to(tl.int64) if OUT_ROWS else t
    tl.store(out_ptr + t_out * stride_ot + offs_h[:, None] * stride_oh + COL0 + offs_w[None, :], y.to(DT), mask=mask)


def tiles(h: int, w: int, fixed_rows: bool = False) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_W, num_warps) from the row count per token and row width only (never from T); with
    ``fixed_rows`` (h is a batch, not a model shape) from the row width alone."""
    block_w = max(2, triton.next_power_of_2(w))
    block_h = max(1, TILE_ELEMS // block_w if fixed_rows else min(triton.next_power_of_2(h), TILE_ELEMS // block_w))
    return block_h, block_w, min(16, max(4, block_h * block_w // 1024))


_CONSTS = ("NORM", "ROPE", "INVERSE", "BLOCK_H", "BLOCK_W", "OUT_ROWS")


def _job(x: torch.Tensor, out: torch.Tensor, weight, cos, sin, eps: float, norm: int, rope_dim: int,
         inverse: bool, col0: int, width: int, out_rows: torch.Tensor | None = None, fixed_rows: bool = False):
    """One launch's (programs, runtime args, constexprs, num_warps), or None when there is nothing to do.
    x, out [T, H, D] with unit channel stride; rows' channels [col0, col0 + width) are processed. With
    ``out_rows`` [T], token t is written to out[out_rows[t]] (out then has any number of rows)."""
    t, h, d = x.shape
    assert out.shape[1:] == x.shape[1:] and out.dtype == x.dtype and x.stride(2) == 1 and out.stride(2) == 1
    assert out_rows is not None or out.shape[0] == t
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    if t * h == 0:
        return None
    if rope_dim:
        assert d % 2 == 0 and 0 < rope_dim <= d and cos.shape == sin.shape == (t, rope_dim // 2), (
            f"x {tuple(x.shape)} cos {tuple(cos.shape)} sin {tuple(sin.shape)}")
        # No-ops for the model's contiguous tables; nothing here syncs with the device.
        cos, sin = cos.contiguous(), sin.contiguous()
    else:
        cos = sin = x  # unused placeholders
    if norm == NORM_WEIGHTED:
        assert weight.shape == (d,), f"weight {tuple(weight.shape)}, want ({d},)"
        weight = weight.contiguous()
    else:
        weight = x  # unused placeholder
    block_h, block_w, num_warps = tiles(h, width, fixed_rows)
    args = (x, weight, cos, sin, out, out if out_rows is None else out_rows,
            h, width, col0, (width - rope_dim) // 2, 1.0 / width, float(eps),
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0))
    consts = (norm, rope_dim > 0, inverse, block_h, block_w, out_rows is not None)
    return t * triton.cdiv(h, block_h), args, consts, num_warps


def _launch(*job_args, **job_kwargs) -> None:
    job = _job(*job_args, **job_kwargs)
    if job is not None:
        _run(job)


def _run(job) -> None:
    programs, args, consts, num_warps = job
    _norm_rope_kernel[(programs,)](*args, **dict(zip(_CONSTS, consts)), INTERPRET=_INTERPRET, num_warps=num_warps,
                                   enable_fp_fusion=False)


def _launch_pair(a, b) -> None:
    """Two jobs (``_job``) in one launch where both have work and tiles of the same warp count (a program's
    code, and so its bits, depend on it); else each in its own launch."""
    if a is None or b is None or a[3] != b[3]:
        for job in (a, b):
            if job is not None:
                _run(job)
        return
    consts = {**{f"{k}_A": v for k, v in zip(_CONSTS, a[2])}, **{f"{k}_B": v for k, v in zip(_CONSTS, b[2])}}
    _norm_rope_pair_kernel[(a[0] + b[0],)](a[0], *a[1], *b[1], **consts, INTERPRET=_INTERPRET, num_warps=a[3],
                                           enable_fp_fusion=False)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] -> a [T, H, D] view with unit channel stride (copying only if no such view exists)."""
    if x.dim() != 3 or x.stride(2) != 1:
        x = x.contiguous().view(len(x), -1, x.shape[-1])
    return x


def _new_out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous(), "bad out tensor"
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None):
    """Weighted RMSNorm of x [..., C] over C -> [..., C] in x.dtype (written into ``out`` when given)."""
    out = _new_out(x, out)
    job = _batch_rows_job(x, out, weight, eps)
    if job is not None:
        _run(job)
    return out


def _batch_rows_job(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float):
    """The job of a weighted RMSNorm of the rows of x [..., C] into ``out``: all rows as one "token" of N rows,
    row blocks of BLOCK_H rows sharing a program when C is small. The block is the same for every N
    (``fixed_rows``): with BLOCK_H from N, the tile's thread layout, hence a row's reduction order, changed with
    the batch (a bf16 ulp of the hidden state now and then at C = 256; of the q latent in ``latent_norms``)."""
    c = x.shape[-1]
    x2 = x.reshape(1, -1, c)
    job = _job(x2 if x2.stride(2) == 1 else x2.contiguous(), out.view(1, -1, c), weight, None, None, eps,
               NORM_WEIGHTED, 0, False, 0, c, fixed_rows=True)
    # The rule, checked: a block of rows set by the row width alone, whatever the number of rows.
    assert job is None or job[2][3] == tiles(1, c, fixed_rows=True)[0], "batch rows: BLOCK_H must not follow N"
    return job


def norm_rope_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """q [T, H, D]: per-head unweighted RMSNorm, then RoPE on the last R channels; in place, returns q."""
    q = _rows(q)
    _launch(q, q, None, cos, sin, eps, NORM_UNWEIGHTED, 2 * cos.shape[-1], False, 0, q.shape[2])
    return q


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
              out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D]: weighted RMSNorm, then RoPE on the last R channels -> [T, D] (into ``out`` when given); with
    ``rows`` [T], row t goes to out[rows[t]] of a table out [R, D] (the window cache write), out returned."""
    assert x.dim() == 2, f"x {tuple(x.shape)}: want [T, D]"
    if rows is None:
        out = _new_out(x, out)
    else:
        assert out is not None and out.dim() == 2 and out.shape[1] == x.shape[1] and out.stride(1) == 1, "bad out"
        assert rows.shape == (len(x),) and rows.dtype in (torch.int32, torch.int64), "bad rows"
    xr = x[:, None, :] if x.stride(1) == 1 else x.contiguous()[:, None, :]
    _launch(xr, out[:, None, :], weight, cos, sin, eps, NORM_WEIGHTED, 2 * cos.shape[-1], False, 0, x.shape[1],
            out_rows=rows)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE on the last R = 2 * cos.shape[-1] channels of x [T, ..., D]; in place, returns x."""
    rows = _rows(x)
    d, r = rows.shape[2], 2 * cos.shape[-1]
    _launch(rows, rows, None, cos, sin, 0.0, NORM_NONE, r, inverse, d - r, r)
    return rows.view(x.shape)


def latent_norms(xq: torch.Tensor, kv_col: int, q_weight: torch.Tensor, q_eps: float, kv_weight: torch.Tensor,
                 kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, *, window: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
    """``rms_norm(xq[:, :kv_col], q_weight, q_eps)`` (returned) and ``norm_rope(xq[:, kv_col:], kv_weight, kv_eps,
    cos, sin, out=window, rows=rows)`` in one launch: the attention block's two norms of its first GEMM."""
    q_lat, kv = xq[:, :kv_col], xq[:, kv_col:]
    assert kv.dim() == 2 and kv.stride(1) == 1 and q_lat.stride(1) == 1, "xq: want [T, C] with unit column stride"
    assert window.dim() == 2 and window.shape[1] == kv.shape[1] and window.stride(1) == 1, "bad window"
    assert rows.shape == (len(xq),) and rows.dtype in (torch.int32, torch.int64), "bad rows"
    q_res = torch.empty(q_lat.shape, dtype=xq.dtype, device=xq.device)
    # As ``rms_norm``: the T rows as one "token" (``_batch_rows_job``: row blocks fixed whatever T); as
    # ``norm_rope``: T tokens of one row.
    a = _batch_rows_job(q_lat, q_res, q_weight, q_eps)
    b = _job(kv[:, None, :], window[:, None, :], kv_weight, cos, sin, kv_eps, NORM_WEIGHTED, 2 * cos.shape[-1], False,
             0, kv.shape[1], out_rows=rows)
    _launch_pair(a, b)
    return q_res


def heads_norm_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, q_ix: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_rope_heads(q, cos, sin, eps)`` and ``rope(q_ix, cos, sin)`` in one launch (both in place, both
    returned): the attention heads' and the indexer heads' queries, which share their RoPE angles."""
    q, rows = _rows(q), _rows(q_ix)
    d, r = rows.shape[2], 2 * cos.shape[-1]
    _launch_pair(_job(q, q, None, cos, sin, eps, NORM_UNWEIGHTED, r, False, 0, q.shape[2]),
                 _job(rows, rows, None, cos, sin, 0.0, NORM_NONE, r, False, d - r, r))
    return q, rows.view(q_ix.shape)
