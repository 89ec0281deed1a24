"""Triton routed-FP4-experts kernel vs its reference (``ops/ref/moe_experts.py``), plus batch invariance.

Tolerances (rel_err = ||out - ref|| / ||ref||, NaN fails):
* bf16 x: 1e-2. The kernel rounds h = silu(gate) * up to bf16 between the two GEMMs (unit roundoff 2^-9)
  and the output is bf16 (another 2^-9); both add up to ~3e-3 on these data, the rest is margin. The weights
  themselves are exact in bf16 (e2m1 times a power of two), so they contribute nothing.
* fp32 x: 1e-4. fp32 activations go through the MMAs as three exact bf16 parts and h stays fp32, so only
  the fp32 summation order (and the GPU's exp in the sigmoid) differ from the reference: ~1e-6 expected.
Every run writes into NaN-filled outputs and NaN-filled scratch buffers, so an unwritten element fails.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepinfer.model.quant import dequant_fp4, quant_fp4, ue8m0_to_float  # noqa: E402
from deepinfer.ops.ref.moe_experts import moe_experts_fp4 as ref_moe  # noqa: E402
from deepinfer.ops.triton import moe_experts as tri  # noqa: E402
from deepinfer.ops.triton import fp4_codes  # noqa: E402
from tests.gpu.conftest import poison_scratch_exact_fp32, rel_err  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
LIMIT = 7.0  # the gate (rms ~3 here) hits it now and then, so both clamps are exercised


@pytest.fixture(autouse=True)
def _poison_and_no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    poison_scratch_exact_fp32(monkeypatch, tri)


def make_weights(n_exp: int, hidden: int, inter: int, device: str, seed: int, scale_fmt: str):
    """Random FP4 experts -> (w13, s13, w2, s2). Small shapes quantize Gaussian weights with ``quant_fp4``;
    large ones draw random bytes (every code pair) and exponents directly on the device (fast)."""
    if hidden * inter * n_exp <= 256 * 128 * 256:
        g = torch.Generator().manual_seed(seed)
        packed13, exp13, packed2, exp2 = [], [], [], []
        for _ in range(n_exp):
            q, s = quant_fp4(torch.randn(2 * inter, hidden, generator=g) * (3.0 / math.sqrt(hidden)))
            packed13.append(q)
            exp13.append(s)
            q, s = quant_fp4(torch.randn(hidden, inter, generator=g) * (0.3 / math.sqrt(inter)))
            packed2.append(q)
            exp2.append(s)
        w13, e13 = torch.stack(packed13).to(device), torch.stack(exp13).view(torch.uint8).to(device)
        w2, e2 = torch.stack(packed2).to(device), torch.stack(exp2).view(torch.uint8).to(device)
    else:
        g = torch.Generator(device=device).manual_seed(seed)

        def rand(shape: tuple[int, ...], lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.randint(lo, hi, shape, generator=g, device=device, dtype=dtype)

        # e2m1 rms over uniform codes is ~2.9: scales 2^-(log2 sqrt(K)) +- 1 keep gate/up around rms 3
        b13 = 127 - round(math.log2(math.sqrt(hidden))) - 1
        b2 = 127 - round(math.log2(math.sqrt(inter))) - 4
        w13 = rand((n_exp, 2 * inter, hidden // 2), -128, 128, torch.int8)
        w2 = rand((n_exp, hidden, inter // 2), -128, 128, torch.int8)
        e13 = rand((n_exp, 2 * inter, hidden // 32), b13 - 1, b13 + 2, torch.uint8)
        e2 = rand((n_exp, hidden, inter // 32), b2 - 1, b2 + 2, torch.uint8)
    if scale_fmt == "fp32":
        return w13, ue8m0_to_float(e13), w2, ue8m0_to_float(e2)
    return w13, e13.view(torch.float8_e8m0fnu), w2, e2.view(torch.float8_e8m0fnu)


def make_tokens(n_tok: int, hidden: int, k: int, n_exp: int, device: str, seed: int, dtype: torch.dtype):
    """-> (x, topk_ids, topk_weights). Distinct ids per row when k <= E (top-k), else repeats (hash-like)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, hidden, generator=g).to(dtype)
    if k <= n_exp:
        ids = torch.rand(n_tok, n_exp, generator=g).argsort(dim=1)[:, :k]
    else:
        ids = torch.randint(0, n_exp, (n_tok, k), generator=g)
    w = torch.rand(n_tok, k, generator=g) + 0.1
    w = w / w.sum(dim=1, keepdim=True) * 1.5
    return x.to(device), ids.to(device), w.to(device)


def run_both(x, ids, w, weights, cfg: tri.TileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(x, float("nan"))
    if cfg is None:
        got = tri.moe_experts_fp4(x, ids, w, *weights, LIMIT, out=out)
    else:
        got = tri.moe_experts_fp4_with_config(x, ids, w, *weights, LIMIT, cfg, out=out)
    assert got.data_ptr() == out.data_ptr()
    return got, ref_moe(x, ids, w, *weights, LIMIT)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) or NaN outputs"
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"rel_err {err:.3e} > {TOL[dtype]:.0e}"


@triton.jit
def _dequant_probe(w_ptr, s_ptr, o_ptr, BN: tl.constexpr, BK: tl.constexpr, SCALE_U8: tl.constexpr,
                   INTERPRET: tl.constexpr, PLACED: tl.constexpr):
    n = tl.arange(0, BN)
    packed = tl.load(w_ptr + n[:, None] * (BK // 8) + tl.arange(0, BK // 8)[None, :])  # int32 words
    scale = tl.load(s_ptr + n[:, None] * (BK // 32) + tl.arange(0, BK // 32)[None, :])
    w = fp4_codes.dequant_fp4(packed, scale, BN, BK, SCALE_U8, INTERPRET, PLACED)
    tl.store(o_ptr + n[:, None] * BK + tl.arange(0, BK)[None, :], w)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("placed", [False, True], ids=["checkpoint", "placed"])
@pytest.mark.parametrize("scale_fmt", ["fp32", "e8m0"])
def test_dequant_every_byte_and_scale_is_exact(device, scale_fmt, placed) -> None:
    """All 256 bytes (both nibbles, -0 and the subnormal 0.5 included) at scales 2^-27 .. 2^1, bitwise; from
    the checkpoint's words and from placed ones (``fp4_codes.place_codes``)."""
    bn, bk = 64, 128
    # byte j of word w holds (w + 64 j) % 256: every byte value at every byte (and nibble) position of a word
    byte = torch.arange(bn * bk // 8)[:, None] + 64 * torch.arange(4)
    packed = (byte % 256).to(torch.uint8).view(torch.int8).view(bn, bk // 2)
    exps = torch.tensor([100, 117, 120, 124, 126, 127, 128, 110], dtype=torch.uint8)
    e8 = exps.repeat_interleave(bn * (bk // 32) // len(exps)).view(bn, bk // 32)
    want = dequant_fp4(packed, e8.view(torch.float8_e8m0fnu))
    scale = ue8m0_to_float(e8) if scale_fmt == "fp32" else e8
    got = torch.full((bn, bk), float("nan"), dtype=torch.bfloat16, device=device)
    words = fp4_codes.place_codes(packed[None])[0] if placed else packed.view(torch.int32)
    _dequant_probe[(1,)](words.to(device), scale.to(device), got, BN=bn, BK=bk,
                         SCALE_U8=scale_fmt == "e8m0", INTERPRET=tri._INTERPRET, PLACED=placed)
    # The kernels' tiles hold the inputs in their own column order (the activations get the same order).
    assert torch.equal(got.float().cpu(), want[:, fp4_codes.k_order(bk)]), "FP4 dequantization is not exact"


def _cases() -> list:
    small = pytest.mark.interpret_ok
    cases = []
    for n_tok in (1, 3, 17, 64, 300):
        for k in (2, 6):
            for n_exp in (4, 16):
                marks = [small] if n_tok <= 64 else []
                cases.append(pytest.param(n_tok, k, n_exp, 64, 32, marks=marks, id=f"T{n_tok}-k{k}-E{n_exp}-H64"))
            for n_exp in (4, 16, 256):
                cases.append(pytest.param(n_tok, k, n_exp, 256, 128, id=f"T{n_tok}-k{k}-E{n_exp}-H256"))
        cases.append(pytest.param(n_tok, 6, 256, 4096, 2048, id=f"T{n_tok}-k6-E256-V4Flash"))
    cases.append(pytest.param(300, 2, 16, 4096, 2048, id="T300-k2-E16-V4Flash"))
    return cases


@pytest.mark.parametrize("scale_fmt", ["fp32", "e8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n_tok,k,n_exp,hidden,inter", _cases())
def test_matches_reference(device, n_tok, k, n_exp, hidden, inter, dtype, scale_fmt) -> None:
    seed = n_tok * 1000 + k * 100 + n_exp + hidden
    weights = make_weights(n_exp, hidden, inter, device, seed, scale_fmt)
    x, ids, w = make_tokens(n_tok, hidden, k, n_exp, device, seed + 1, dtype)
    check(*run_both(x, ids, w, weights), dtype)


def _edge_ids(name: str, n_tok: int, k: int, n_exp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if name == "two_experts_only":  # every other expert gets zero pairs
        return torch.tensor([0, 5])[torch.randint(0, 2, (n_tok, k), generator=g)]
    if name == "one_expert_all":  # every pair (duplicates in each row too) on one expert
        return torch.full((n_tok, k), 3)
    if name == "duplicates_in_row":  # hash routing can repeat an expert within a row
        base = torch.randint(0, n_exp, (n_tok, 1), generator=g)
        ids = torch.randint(0, n_exp, (n_tok, k), generator=g)
        ids[:, 1] = base[:, 0]
        ids[:, 0] = base[:, 0]
        return ids
    if name == "last_expert":
        return torch.full((n_tok, k), n_exp - 1)
    raise ValueError(name)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("name", ["two_experts_only", "one_expert_all", "duplicates_in_row", "last_expert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_routing_edge_cases(device, name, dtype) -> None:
    n_tok, k, n_exp, hidden, inter = 19, 3, 16, 64, 32
    weights = make_weights(n_exp, hidden, inter, device, 11, "e8m0")
    x, _, w = make_tokens(n_tok, hidden, k, n_exp, device, 12, dtype)
    ids = _edge_ids(name, n_tok, k, n_exp).to(device)
    check(*run_both(x, ids, w, weights), dtype)


@pytest.mark.interpret_ok
def test_duplicate_slots_are_independent(device) -> None:
    """Same expert twice in a row = that expert's output weighted by w0 + w1."""
    weights = make_weights(4, 64, 32, device, 21, "fp32")
    x, _, w = make_tokens(5, 64, 2, 4, device, 22, torch.float32)
    ids = torch.full((5, 2), 2, device=device)
    got, _ = run_both(x, ids, w, weights)
    single, _ = run_both(x, ids[:, :1], w.sum(dim=1, keepdim=True), weights)
    assert rel_err(got, single) <= 1e-5


@pytest.mark.interpret_ok
def test_router_dtype_weights_are_upcast_exactly(device) -> None:
    """bf16 routing weights (the router's logits dtype) give the bits of the same weights passed as fp32."""
    weights = make_weights(4, 64, 32, device, 23, "e8m0")
    x, ids, w = make_tokens(7, 64, 2, 4, device, 24, torch.bfloat16)
    w16 = w.to(torch.bfloat16)
    got, want = run_both(x, ids, w16, weights)
    assert torch.equal(got, run_both(x, ids, w16.float(), weights)[0])
    assert torch.equal(want, ref_moe(x, ids, w16.float(), *weights, LIMIT))


@pytest.mark.interpret_ok
def test_reference_matches_model_expert(device) -> None:
    """The spec agrees with ``model.moe.Expert`` on the dequantized weights (CPU, fp32)."""
    from deepinfer.model.moe import Expert

    n_exp, hidden, inter, k = 4, 64, 32, 3
    w13, s13, w2, s2 = make_weights(n_exp, hidden, inter, "cpu", 61, "e8m0")
    x, ids, w = make_tokens(7, hidden, k, n_exp, "cpu", 62, torch.float32)
    experts = []
    for e in range(n_exp):
        mod = Expert(hidden, inter, LIMIT, torch.float32)
        w13_e = dequant_fp4(w13[e], s13[e])
        mod.w1.weight.data, mod.w3.weight.data = w13_e[:inter], w13_e[inter:]
        mod.w2.weight.data = dequant_fp4(w2[e], s2[e])
        experts.append(mod)
    with torch.no_grad():
        want = torch.stack([sum(w[t, j] * experts[ids[t, j]](x[t]) for j in range(k)) for t in range(7)])
    assert rel_err(ref_moe(x, ids, w, w13, s13, w2, s2, LIMIT), want) <= 1e-5


@pytest.mark.interpret_ok
def test_empty_batch(device) -> None:
    weights = make_weights(4, 64, 32, device, 31, "fp32")
    x, ids, w = make_tokens(0, 64, 2, 4, device, 32, torch.bfloat16)
    assert tri.moe_experts_fp4(x, ids, w, *weights, LIMIT).shape == (0, 64)


def _invariance_setup(device: str, n_exp: int, hidden: int, inter: int, k: int, dtype: torch.dtype):
    weights = make_weights(n_exp, hidden, inter, device, 41, "e8m0")
    x, ids, w = make_tokens(64, hidden, k, n_exp, device, 42, dtype)
    # Skew the batch towards row 37's experts so its pairs share tiles with many other rows.
    g = torch.Generator().manual_seed(43)
    take = torch.rand(64, k, generator=g).to(device) < 0.5
    ids = torch.where(take, ids[37:38].expand(64, k), ids)
    for row in range(64):  # keep rows duplicate-free where E allows (top-k style)
        if len(set(ids[row].tolist())) < k <= n_exp:
            ids[row] = ids[37]
    return x, ids, w, weights


INVARIANCE_SHAPES = [
    pytest.param(16, 64, 32, 6, marks=pytest.mark.interpret_ok, id="E16-H64"),
    pytest.param(16, 256, 128, 6, id="E16-H256"),
    pytest.param(256, 4096, 2048, 6, id="E256-V4Flash"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n_exp,hidden,inter,k", INVARIANCE_SHAPES)
def test_batch_invariance_alone_vs_batch_of_64(device, n_exp, hidden, inter, k, dtype) -> None:
    """Row 37's output is bitwise the same alone (T=1) as inside a skewed batch of 64 tokens."""
    x, ids, w, weights = _invariance_setup(device, n_exp, hidden, inter, k, dtype)
    full, _ = run_both(x, ids, w, weights)
    alone, ref = run_both(x[37:38], ids[37:38], w[37:38], weights)
    check(alone, ref, dtype)
    assert torch.equal(full[37], alone[0])
    again, _ = run_both(x, ids, w, weights)  # run-to-run
    assert torch.equal(full, again)


@pytest.mark.parametrize("n_exp,hidden,inter,k", INVARIANCE_SHAPES)
def test_every_table_config_gives_the_same_bits(device, n_exp, hidden, inter, k) -> None:
    """The shape-bucket table may change tiles, never a row's bits: all configs agree bitwise."""
    x, ids, w, weights = _invariance_setup(device, n_exp, hidden, inter, k, torch.bfloat16)
    cfgs = [cfg for _, cfg in tri.CONFIG_TABLE]
    cfgs += [dataclasses.replace(cfg, one_launch=not cfg.one_launch) for cfg in cfgs]  # both forms of each row
    outs = [run_both(x, ids, w, weights, cfg)[0] for cfg in cfgs]
    for cfg_out, cfg in zip(outs[1:], cfgs[1:]):
        assert torch.equal(outs[0], cfg_out), f"{cfg} differs from {cfgs[0]}"


@pytest.mark.interpret_ok
@pytest.mark.parametrize("layout", ["checkpoint", "model"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_launch_gives_the_same_bits_and_resets(device, dtype, layout) -> None:
    """The one-launch tile queue (``moe_one_launch.py``) gives exactly the two launches' bits, call after call
    (its counters are zero again after each call), with the weights as the checkpoint stores them or as the
    model does (tile-major, placed), including m-blocks that no pair uses."""
    from deepinfer.ops.triton import moe_one_launch

    n_exp, hidden, inter, k = 8, 256, 128, 3
    ckpt = make_weights(n_exp, hidden, inter, device, seed=41, scale_fmt="e8m0")
    weights = ckpt
    if layout == "model":
        weights = (*fp4_codes.expert_layout(*ckpt[:2]), *fp4_codes.expert_layout(*ckpt[2:]))
    base = tri.FP32_CONFIG if dtype == torch.float32 else tri.CONFIG_TABLE[1][1]
    for n_tok, seed in ((1, 42), (11, 43), (2, 44)):
        x, ids, w = make_tokens(n_tok, hidden, k, n_exp, device, seed=seed, dtype=dtype)
        two = tri.moe_experts_fp4_with_config(x, ids, w, *weights, LIMIT, dataclasses.replace(base, one_launch=False))
        check(two, ref_moe(x, ids, w, *ckpt, LIMIT), dtype)
        for _ in range(2):
            one = tri.moe_experts_fp4_with_config(x, ids, w, *weights, LIMIT, dataclasses.replace(base, one_launch=True))
            assert torch.equal(one, two), "one launch changes the result"
            assert not moe_one_launch._counters(x.device).any(), "counters not reset after the call"
    with pytest.raises(ValueError, match="one_launch"):
        tri.moe_experts_fp4_with_config(x, ids, w, *weights, LIMIT, dataclasses.replace(base, one_launch=True,
                                                                                        splits2=2))


def test_one_launch_replays_in_a_cuda_graph(device) -> None:
    """Captured once, replayed with new inputs: the counters reset inside the graph, every replay exact."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    n_exp, hidden, inter, k = 256, 4096, 2048, 6
    weights = make_weights(n_exp, hidden, inter, device, seed=45, scale_fmt="e8m0")
    weights = (*fp4_codes.expert_layout(*weights[:2]), *fp4_codes.expert_layout(*weights[2:]))
    cfg = dataclasses.replace(tri.CONFIG_TABLE[2][1], one_launch=True)
    x, ids, w = make_tokens(32, hidden, k, n_exp, device, seed=46, dtype=torch.bfloat16)
    static = [t.clone() for t in (x, ids, w)]
    tri.moe_experts_fp4_with_config(*static, *weights, LIMIT, cfg)  # warm-up (compiles) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.moe_experts_fp4_with_config(*static, *weights, LIMIT, cfg)
    for seed in (47, 48, 49):
        x, ids, w = make_tokens(32, hidden, k, n_exp, device, seed=seed, dtype=torch.bfloat16)
        for dst, src in zip(static, (x, ids, w)):
            dst.copy_(src)
        graph.replay()
        want = tri.moe_experts_fp4_with_config(x, ids, w, *weights, LIMIT, dataclasses.replace(cfg, one_launch=False))
        assert torch.equal(out, want)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scale_fmt", ["e8m0", "fp32"])
def test_split_gate_up_gives_the_same_bits(device, dtype, scale_fmt) -> None:
    """Gate and up rows in separate programs (``TileConfig.split_gate_up``) joined by the SwiGLU kernel give
    exactly the fused kernel's bits and match the reference."""
    n_exp, hidden, inter, k = 4, 128, 192, 3
    weights = make_weights(n_exp, hidden, inter, device, seed=9, scale_fmt=scale_fmt)
    x, ids, w = make_tokens(9, hidden, k, n_exp, device, seed=10, dtype=dtype)
    base = tri.FP32_CONFIG if dtype == torch.float32 else tri.CONFIG_TABLE[0][1]
    fused, ref = run_both(x, ids, w, weights, base)
    check(fused, ref, dtype)
    split, _ = run_both(x, ids, w, weights, dataclasses.replace(base, split_gate_up=True))
    assert torch.equal(split, fused), "split gate/up changes the result"


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_k_splits_match_the_reference_and_repeat(device, dtype) -> None:
    """K chunks (``splits1`` / ``splits2``) add their fp32 partials in chunk order: within tolerance of the
    reference, the same bits run to run; chunks that do not tile K are refused."""
    n_exp, hidden, inter, k = 4, 256, 192, 3  # gate|up: 2 steps of 128; down: 3 steps of 64
    weights = make_weights(n_exp, hidden, inter, device, seed=11, scale_fmt="e8m0")
    x, ids, w = make_tokens(5, hidden, k, n_exp, device, seed=12, dtype=dtype)
    base = tri.FP32_CONFIG if dtype == torch.float32 else tri.CONFIG_TABLE[0][1]
    cfg = dataclasses.replace(base, split_gate_up=True, splits1=2, splits2=3)
    got, ref = run_both(x, ids, w, weights, cfg)
    check(got, ref, dtype)
    assert torch.equal(run_both(x, ids, w, weights, cfg)[0], got)
    with pytest.raises(ValueError, match="chunks"):
        run_both(x, ids, w, weights, dataclasses.replace(cfg, splits2=2))
    with pytest.raises(ValueError, match="split_gate_up"):
        run_both(x, ids, w, weights, dataclasses.replace(base, splits1=2))


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scale_fmt", ["e8m0", "fp32"])
def test_tiled_weights_give_the_same_bits(device, dtype, scale_fmt) -> None:
    """Tile-major packed codes and scales (``tile_weights``, ``expert_layout``), tiled codes with
    checkpoint-layout scales, and placed codes (``place_codes``) tiled or not, give exactly the checkpoint
    layout's bits: fused, split gate/up with K chunks, and a wide-token tile; a tile width that is not the
    kernels' K step is refused."""
    n_exp, hidden, inter, k = 4, 256, 64, 3  # gate|up: 2 steps of 128 over 128 rows; down: 1 step of 64
    weights = make_weights(n_exp, hidden, inter, device, seed=13, scale_fmt=scale_fmt)
    w13, s13, w2, s2 = weights
    (t13, ts13), (t2, ts2) = (fp4_codes.expert_layout(w13, s13, placed=False),
                              fp4_codes.expert_layout(w2, s2, placed=False))
    assert t13.shape == (n_exp, 2 * inter // 64, hidden // 128, 64, 64)
    assert ts13.shape == (n_exp, 2 * inter // 64, hidden // 128, 64, 4) and ts2.shape == (n_exp, hidden // 64, 1, 64, 2)
    (p13, ps13), (p2, ps2) = fp4_codes.expert_layout(w13, s13), fp4_codes.expert_layout(w2, s2)  # the model's
    assert p13.dtype == torch.int32 and p13.shape == (n_exp, 2 * inter // 64, hidden // 128, 64, 16)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((ps13, ts13), (ps2, ts2)))
    layouts = [(t13, ts13, t2, ts2), (t13, s13, t2, s2), (p13, ps13, p2, ps2),
               (fp4_codes.place_codes(w13), s13, w2, s2), (t13, ts13, fp4_codes.place_codes(w2), s2)]
    x, ids, w = make_tokens(7, hidden, k, n_exp, device, seed=14, dtype=dtype)
    base = tri.FP32_CONFIG if dtype == torch.float32 else tri.CONFIG_TABLE[0][1]
    for cfg in (base, dataclasses.replace(base, split_gate_up=True, splits1=2), tri.CONFIG_TABLE[-1][1]):
        if dtype == torch.float32 and cfg is tri.CONFIG_TABLE[-1][1]:
            continue
        plain, ref = run_both(x, ids, w, weights, cfg)
        for tiled in layouts:
            got = tri.moe_experts_fp4_with_config(x, ids, w, *tiled, LIMIT, cfg)
            check(got, ref, dtype)
            assert torch.equal(got, plain), f"{cfg}: tiled or placed weights change the result"
    bad = w2.view(n_exp, hidden // 64, 64, 2, 16).transpose(2, 3).contiguous()  # 32-wide steps, not 64
    with pytest.raises(ValueError, match="tiled as"):
        tri.moe_experts_fp4(x, ids, w, t13, ts13, bad, ts2, LIMIT)
    with pytest.raises(ValueError, match="tiled as"):
        tri.moe_experts_fp4(x, ids, w, t13, ts13, fp4_codes.place_codes(bad), ts2, LIMIT)


@pytest.mark.interpret_ok
def test_placed_codes_are_a_bit_permutation_of_each_word() -> None:
    """``place_codes`` permutes the 32 bits of every word the same way, undone by ``unplace_codes``, and
    commutes with the tile-major layout (host side only)."""
    codes = torch.randint(-128, 128, (3, 128, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    placed = fp4_codes.place_codes(codes)
    assert placed.dtype == torch.int32 and placed.shape == (3, 128, 16)
    assert torch.equal(fp4_codes.unplace_codes(placed), codes)
    assert torch.equal(fp4_codes.place_codes(fp4_codes.tile_weights(codes)), fp4_codes.tile_weights(placed, 8))
    ones = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)
    moved = fp4_codes.place_codes(ones.view(torch.int8).view(1, 1, 128)).view(32)
    assert sorted(int(m).bit_length() - 1 if m > 0 else 31 for m in moved) == list(range(32))


@pytest.mark.interpret_ok
def test_align_pairs_groups_and_pads(device) -> None:
    ids = torch.tensor([[3, 0], [2, 3], [1, 3], [0, 1], [0, 0]], device=device)
    pair_of_row, expert_of_block = tri.align_pairs(ids, 4, 16)
    assert pair_of_row.numel() == expert_of_block.numel() * 16
    for b, e in enumerate(expert_of_block.tolist()):
        rows = [p for p in pair_of_row[b * 16:(b + 1) * 16].tolist() if p >= 0]
        if e < 0:
            assert rows == []
        else:  # ascending pair ids of exactly this expert
            assert rows == sorted(rows) and all(ids.reshape(-1)[p].item() == e for p in rows)
    placed = sorted(p for p in pair_of_row.tolist() if p >= 0)
    assert placed == list(range(ids.numel()))


@pytest.mark.interpret_ok
def test_preconditions_fail_loudly(device) -> None:
    weights = make_weights(4, 64, 32, device, 51, "fp32")
    x, ids, w = make_tokens(4, 64, 2, 4, device, 52, torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        tri.moe_experts_fp4(x.t().contiguous().t(), ids, w, *weights, LIMIT)
    with pytest.raises(ValueError, match="int64"):
        tri.moe_experts_fp4(x, ids.int(), w, *weights, LIMIT)
    with pytest.raises(ValueError, match="x: expected"):
        tri.moe_experts_fp4(x.half(), ids, w, *weights, LIMIT)
    w13, s13, w2, s2 = weights
    with pytest.raises(ValueError, match="s2"):
        tri.moe_experts_fp4(x, ids, w, w13, s13, w2, s2[:, :, :0], LIMIT)


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_combine_adds_the_shared_expert(device, dtype) -> None:
    """``add`` lands after the routed sum's rounding, as ``routed + shared`` does: with add, the result is the
    no-add result plus add, rounded once more (bit for bit), and matches the reference's add."""
    n_tok, k, n_exp, hidden, inter = 7, 3, 8, 64, 32
    weights = make_weights(n_exp, hidden, inter, device, 31, "e8m0")
    x, ids, w = make_tokens(n_tok, hidden, k, n_exp, device, 32, dtype)
    add = torch.randn(n_tok, hidden, generator=torch.Generator().manual_seed(33)).to(device, dtype)
    plain = tri.moe_experts_fp4(x, ids, w, *weights, LIMIT)
    got = tri.moe_experts_fp4(x, ids, w, *weights, LIMIT, add=add)
    assert torch.equal(got, plain + add)
    check(got, ref_moe(x, ids, w, *weights, LIMIT, add=add), dtype)
