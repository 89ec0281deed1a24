"""Every DeepSeek-V4.1 Triton kernel compiles for sm_90 (no GPU needed), at V4.1-Flash's shapes: the launch-time
types (loop-carried scalars, fp8 conversions and bitcasts, joins and splits) are checked by the compiler, which
the CPU interpreter does not run. Skipped where Triton is not installed or runs interpreted."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels (the interpreter replaces triton.jit)", allow_module_level=True)

from deepinfer.ops.triton import (cache_rows_v41, compress_pool_v41, engram_v41, fp8_linear_b32,  # noqa: E402
                                  index_select_v41, mhc_v41, rope_v41, swiglu)
from deepinfer.testing.sass import compile_sm90  # noqa: E402


def _sig(spec: str) -> dict[str, str]:
    """'name:type name:type ...' -> a signature; a name in CAPITALS (or type 'c') is a constexpr."""
    out = {}
    for item in spec.split():
        name, _, kind = item.partition(":")
        out[name] = "constexpr" if kind == "c" else kind
    return out


KERNELS = [
    ("rope", rope_v41._rope_kernel, "x_ptr:*bf16 ang_ptr:*fp32 out_ptr:*bf16 H:i32 W:i32 ROPE_OFF:i32 stride_xt:i32 "
     "stride_xh:i32 stride_ot:i32 stride_oh:i32 stride_a:i32 INVERSE:c BLOCK_H:c BLOCK_W:c INTERPRET:c",
     dict(INVERSE=True, BLOCK_H=8, BLOCK_W=512, INTERPRET=False), 4),
    ("fp8 rows store", cache_rows_v41._store_fp8_kernel, "v_ptr:*bf16 where_ptr:*i64 t_ptr:*u8 C:i32 stride_v:i32 "
     "stride_t:i32 G:c BLOCK_G:c", dict(G=16, BLOCK_G=16), 4),
    ("fp8 rows load", cache_rows_v41._load_fp8_kernel, "t_ptr:*u8 where_ptr:*i64 out_ptr:*bf16 C:i32 stride_t:i32 "
     "stride_o:i32 G:c BLOCK_G:c INTERPRET:c", dict(G=16, BLOCK_G=16, INTERPRET=False), 4),
    *[(f"e2m1 {fmt} {'rows store' if pack else 'qdq'}", cache_rows_v41._e2m1_kernel,
       f"v_ptr:*bf16 where_ptr:*i64 out_ptr:{'*u8' if pack else '*bf16'} C:i32 stride_v:i32 stride_o:i32 G:c "
       "BLOCK_G:c GROUP_C:c NV:c PACK:c INTERPRET:c",
       dict(G=g, BLOCK_G=g, GROUP_C=group, NV=fmt == "nvfp4", PACK=pack, INTERPRET=False), 4)
      for fmt, group, g in (("mxfp4", 32, 4), ("nvfp4", 16, 32)) for pack in (True, False)],
    *[(f"e2m1 {fmt} rows load", cache_rows_v41._load_e2m1_kernel, "t_ptr:*u8 where_ptr:*i64 out_ptr:*bf16 C:i32 "
       "stride_t:i32 stride_o:i32 G:c BLOCK_G:c GROUP_C:c NV:c INTERPRET:c",
       dict(G=g, BLOCK_G=g, GROUP_C=group, NV=fmt == "nvfp4", INTERPRET=False), 4)
      for fmt, group, g in (("mxfp4", 32, 4), ("nvfp4", 16, 32))],
    ("mhc collapse", mhc_v41._collapse_kernel, "x_ptr:*bf16 pre_ptr:*fp32 y_ptr:*bf16 H:i32 stride_xt:i32 "
     "stride_xn:i32 N:c BLOCK_H:c INTERPRET:c", dict(N=4, BLOCK_H=1024, INTERPRET=False), 4),
    ("mhc expand", mhc_v41._expand_kernel, "x_ptr:*bf16 o_ptr:*bf16 post_ptr:*fp32 comb_ptr:*fp32 y_ptr:*bf16 H:i32 "
     "stride_xt:i32 stride_xn:i32 N:c NP:c BLOCK_H:c INTERPRET:c", dict(N=4, NP=4, BLOCK_H=1024, INTERPRET=False), 4),
    ("mhc mix partial", mhc_v41._mix_partial_kernel, "x_ptr:*bf16 fn_ptr:*fp32 part_ptr:*fp32 H:i32 K:i32 CHUNK:i32 "
     "stride_xt:i32 stride_xn:i32 n_chunks:i32 M:c BLOCK_M:c BLOCK_K:c", dict(M=24, BLOCK_M=32, BLOCK_K=64), 4),
    ("mhc mix logits", mhc_v41._mix_logits_kernel, "part_ptr:*fp32 base_ptr:*fp32 scale_ptr:*fp32 out_ptr:*fp32 "
     "n_chunks:i32 inv_k:fp32 eps:fp32 N:c M:c BLOCK_M:c", dict(N=4, M=24, BLOCK_M=32), 1),
    ("swiglu v41", swiglu._swiglu_v41_kernel, "g_ptr:*bf16 u_ptr:*bf16 out_ptr:*bf16 inter:i32 limit:fp32 "
     "stride_g:i32 stride_u:i32 stride_o:i32 BLOCK:c INTERPRET:c", dict(BLOCK=1024, INTERPRET=False), 4),
    *[(f"compress pool r{r}", compress_pool_v41._pool_kernel, "state_ptr:*fp32 rows_ptr:*i64 out_ptr:*bf16 D:i32 "
       "stride_s:i32 stride_r:i32 stride_o:i32 R:c BLOCK:c INTERPRET:c", dict(R=r, BLOCK=512, INTERPRET=False), 4)
      for r in (1, 2, 4)],
    ("engram hash", engram_v41._hash_kernel, "lb_ptr:*i64 map_ptr:*i64 mult_ptr:*i64 prime_ptr:*i64 off_ptr:*i64 "
     "out_ptr:*i64 Q:i32 L:i32 pad_id:i32 stride_lb:i32 N:c HEADS:c BLOCK_Q:c BLOCK_C:c",
     dict(N=4, HEADS=8, BLOCK_Q=16, BLOCK_C=32), 4),
    *[(f"engram gather {dt}", engram_v41._gather_kernel, f"code_ptr:*u8 scale_ptr:*u8 rows_ptr:*i64 out_ptr:*{dt} "
       "K:i32 C:i32 stride_code:i32 stride_scale:i32 stride_rows:i32 stride_out:i32 BLOCK_K:c BLOCK_C:c GROUP:c "
       "INTERPRET:c",
       dict(BLOCK_K=8, BLOCK_C=256, GROUP=32, INTERPRET=False), 4) for dt in ("bf16", "fp32")],
    ("fp8 b32 grouped", fp8_linear_b32._fp8_b32_kernel, "x_ptr:*bf16 w_ptr:*fp8e4nv s_ptr:*fp32 y_ptr:*bf16 M:i32 "
     "N:i32 K:i32 stride_xm:i32 stride_wn:i32 stride_sn:i32 stride_ym:i32 group_n:i32 stride_xg:i32 BLOCK_M:c "
     "BLOCK_N:c BLOCK_K:c DOT_FP32:c", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, DOT_FP32=False), 4),
    *[(f"index scores{' in candidates' if cand else ''}", index_select_v41._score_kernel,
       "q_ptr:*bf16 w_ptr:*bf16 k_ptr:*bf16 base_ptr:*i64 vis_ptr:*i64 cand_ptr:*u8 key_ptr:*i64 E:i32 H:i32 D:i32 "
       "stride_ql:i32 stride_qh:i32 stride_wl:i32 stride_k:i32 stride_cl:i32 stride_ol:i32 BLOCK_H:c BLOCK_E:c "
       "BLOCK_D:c HAS_CAND:c IEEE:c INTERPRET:c",
       dict(BLOCK_H=32, BLOCK_E=64, BLOCK_D=128, HAS_CAND=cand, IEEE=False, INTERPRET=False), 4)
      for cand in (False, True)],
    ("index rows", index_select_v41._rows_kernel, "best_ptr:*i64 base_ptr:*i64 out_ptr:*i64 e:i32 k:i32 stride_b:i32 "
     "stride_o:i32 BLOCK:c", dict(BLOCK=512), 4),
]


@pytest.mark.parametrize("label,fn,spec,consts,warps", KERNELS, ids=[k[0] for k in KERNELS])
def test_v41_kernel_compiles_for_sm90(label, fn, spec, consts, warps) -> None:
    kernel = compile_sm90(fn, _sig(spec), consts, (), warps, 1)
    assert kernel.asm.get("cubin"), f"{label}: no cubin"
