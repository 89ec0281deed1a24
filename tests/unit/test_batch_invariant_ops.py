"""The batch-invariant op table (``REF_BATCH_INVARIANT``, ops/ref/batch_invariant.py), op by op.

Oracle rule (determinism.md §6): a row computed alone and the same row inside batches of other rows, at
several sizes and offsets, must be equal bit for bit (``torch.equal``); against the plain reference ops
the table agrees within fp32 rounding only (it sums in other orders). Key lists and entry lists are also
widened with absent (-1) columns, which is what a longer sequence elsewhere in the step does to them.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.ops.ref import batch_invariant as bi
from deepinfer.ops.ref.row_tiles import LANE_BLOCK, PIECE, ROW_TILE, whole_lanes
from deepinfer.ops.table import REF, REF_BATCH_INVARIANT, select

SIZES = (2, 3, 7, 16, 17, 33, 64)


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows_invariant(fn, make, sizes=SIZES) -> None:
    """``make(m, g)`` -> inputs with m rows along dim 0 (tuple); ``fn(*inputs)`` -> output(s) with rows along
    dim 0. Row 0 of a 1-row call must equal that row wherever it is placed in an m-row call."""
    base = make(1, _g(1))
    alone = fn(*base)
    for m in sizes:
        others = make(m, _g(100 + m))
        for at in (0, m // 2, m - 1):
            batch = tuple(o.clone() for o in others)
            for b, x in zip(batch, base):
                b[at] = x[0]
            got = fn(*batch)
            for a, g in zip(_tuple(alone), _tuple(got)):
                assert torch.equal(a[0], g[at]), f"row at {at} of {m} differs"


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def test_select_picks_the_table_once() -> None:
    assert select("cpu") is REF and select("cpu", batch_invariant=True) is REF_BATCH_INVARIANT
    assert REF_BATCH_INVARIANT.batch_invariant and not REF.batch_invariant


def test_invariant_tuning_fixes_every_batch_dependent_choice() -> None:
    """The CUDA table's tuning (``KernelTuning.invariant``): no small-batch attention split, no FP8 decode path,
    and K segments that depend on the weight's shape only (the same for every M by construction: M is not an
    argument), whole 128-wide blocks, covering K."""
    from deepinfer.ops.tuning import H200, KernelTuning

    t = H200.invariant()
    assert t.batch_invariant and t.attention_small_split == 0 and t.fp8_decode_max_m == 0
    assert not H200.batch_invariant
    for n, k in [(4096, 4096), (129280, 4096), (4096, 256), (1536, 4096), (24576, 1536), (64, 200)]:
        seg = t.k_segment(n, k)
        assert seg % 128 == 0 and 0 < seg <= -(-k // 128) * 128
        assert -(-k // seg) <= t.fp8_max_split
    assert t.k_segment(4096, 4096) == 512  # 64 tiles at M = 1 -> 8 segments fill 2 x 132 SMs
    for tiles in (1, 131, 132, 5000):  # the launch mode follows the tile count (M); the segments do not
        seg, split, per_program = t.segment_launch(4096, 4096, tiles)
        assert seg == 512 and split * per_program == 8 and (split > 1) == (tiles < t.num_sms)
    assert KernelTuning(num_sms=16).invariant().k_segment(4096, 4096) == 4096  # 64 tiles already fill 32
    with pytest.raises(ValueError, match="one wgmma family"):
        KernelTuning(invariant_fp8_tiles=((64, (16, 64, 4, 4)), (None, (128, 128, 8, 3))))
    # the bf16 linear's tiles: wgmma m64 over the weight rows in every bucket (at most one warpgroup per 64 rows)
    assert t.invariant_linear_tile(1)[0] == 64 and t.invariant_linear_tile(10**6)[0] % 64 == 0
    for bad in (((None, (32, 128, 4, 3)),), ((None, (64, 128, 8, 3)),), ((16, (64, 16, 4, 4)),)):
        with pytest.raises(ValueError, match="invariant_linear_tiles"):
            KernelTuning(invariant_linear_tiles=bad)
    with pytest.raises(ValueError, match="attention_invariant_split"):
        KernelTuning(attention_invariant_split=0)


def test_engine_config_carries_the_mode_and_refuses_what_it_cannot_keep(monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    cfg = EngineConfig.create(EngineArgs(device="cpu"))
    assert cfg.batch_invariant and cfg.mode_labels()["batch_invariant"] == "1"
    assert EngineConfig.create(EngineArgs(device="cuda")).batch_invariant  # the Triton table's invariant tuning
    assert EngineConfig.create(EngineArgs(device="cpu", data_parallel_size=2)).batch_invariant  # ranks: ordered sums
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT=1: not supported with context_parallel_size"):
        EngineConfig.create(EngineArgs(device="cpu", data_parallel_size=2, context_parallel_size=2))
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT='maybe' is not a boolean"):
        EngineConfig.create(EngineArgs(device="cpu"))
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT")
    assert EngineConfig.create(EngineArgs(device="cpu")).mode_labels()["batch_invariant"] == "0"


def test_dense_linear_rows_are_invariant_and_match_the_reference() -> None:
    w = torch.randn(96, 80, generator=_g(2))
    _rows_invariant(lambda x: bi.dense(x, w), lambda m, g: (torch.randn(m, 80, generator=g),))
    x = torch.randn(37, 80, generator=_g(3))
    torch.testing.assert_close(bi.dense(x, w), REF.dense(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(5, 4, 80, generator=_g(4))  # leading dims flatten into rows (the MTP h_proj input)
    assert torch.equal(bi.dense(x3, w), bi.dense(x3.reshape(20, 80), w).view(5, 4, 96))


def test_grouped_linear_rows_are_invariant() -> None:
    w = torch.randn(2 * 24, 40, generator=_g(5))
    _rows_invariant(lambda x: bi.dense_grouped(x.transpose(0, 1), w).transpose(0, 1),
                    lambda m, g: (torch.randn(m, 2, 40, generator=g),))
    x = torch.randn(2, 21, 40, generator=_g(6))
    torch.testing.assert_close(bi.dense_grouped(x, w), REF.dense_grouped(x, w), rtol=1e-5, atol=1e-5)


def test_tiles_and_lane_blocks_are_asserted() -> None:
    assert ROW_TILE == 16 and LANE_BLOCK % 64 == 0 and PIECE % LANE_BLOCK == 0
    x = torch.randn(2 * PIECE + 5, generator=_g(7))  # several pieces and a padded last block
    assert torch.equal(whole_lanes(torch.sigmoid, x)[: PIECE + 3], whole_lanes(torch.sigmoid, x[: PIECE + 3]))
    with pytest.raises(AssertionError, match="row reduction is split across threads"):
        bi.rms_norm(torch.randn(1, bi.MAX_ROW_REDUCTION + 1), torch.ones(bi.MAX_ROW_REDUCTION + 1), 1e-6)


def test_pointwise_elements_do_not_depend_on_where_the_batch_ends() -> None:
    # Narrow rows put an element in a kernel's scalar tail or vector body depending on the row count.
    _rows_invariant(lambda x: bi.pointwise(torch.sigmoid, x), lambda m, g: (torch.randn(m, 24, generator=g),))
    _rows_invariant(lambda x: bi.swiglu(x, 7.0), lambda m, g: (torch.randn(m, 2 * 12, generator=g),))


def test_mhc_and_norms_rows_are_invariant() -> None:
    n, h = 4, 48
    fn = torch.randn((2 + n) * n, n * h, generator=_g(8)) * 0.1
    base, scale = torch.randn((2 + n) * n, generator=_g(9)), torch.randn(3, generator=_g(10))
    streams = lambda m, g: (torch.randn(m, n, h, generator=g),)  # noqa: E731
    _rows_invariant(lambda s: bi.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6), streams)
    _rows_invariant(lambda s: bi.hc_head(s, fn[:n], base[:n], scale[:1], 1e-6, 1e-6), streams)
    _rows_invariant(lambda s, o, p, c: bi.hc_post(s, o, p, c),
                    lambda m, g: (torch.randn(m, n, h, generator=g), torch.randn(m, h, generator=g),
                                  torch.rand(m, n, generator=g), torch.rand(m, n, n, generator=g)))
    _rows_invariant(lambda x: bi.rms_norm(x, torch.rand(h, generator=_g(11)), 1e-6),
                    lambda m, g: (torch.randn(m, h, generator=g),))
    s = torch.randn(9, n, h, generator=_g(12))
    for a, b in zip(bi.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6), REF.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    o, p = torch.randn(9, h, generator=_g(13)), torch.rand(9, n, generator=_g(14))
    c = torch.rand(9, n, n, generator=_g(15))
    torch.testing.assert_close(bi.hc_post(s, o, p, c), REF.hc_post(s, o, p, c), rtol=1e-5, atol=1e-6)


def test_routing_and_experts_rows_are_invariant() -> None:
    e, k = 8, 2
    gate = torch.randn(e, 32, generator=_g(16))
    bias = torch.randn(e, generator=_g(17)) * 0.1

    def route(x):
        return bi.moe_route(bi.linear(x, gate), "sqrtsoftplus", k, True, 1.5, bias=bias)

    _rows_invariant(route, lambda m, g: (torch.randn(m, 32, generator=g),))
    x = torch.randn(11, 32, generator=_g(18))
    (wa, ia), (wb, ib) = route(x), REF.moe_route(REF.linear(x, gate), "sqrtsoftplus", k, True, 1.5, bias=bias)
    assert torch.equal(ia, ib)
    torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-6)
    # FP4 experts: whatever other tokens the experts receive, a token's output is the same.
    w13 = torch.randint(-128, 127, (e, 2 * 32, 16), generator=_g(19), dtype=torch.int8)
    w2 = torch.randint(-128, 127, (e, 32, 16), generator=_g(20), dtype=torch.int8)
    s13 = torch.full((e, 64, 1), 2.0 ** -4)
    s2 = torch.full((e, 32, 1), 2.0 ** -4)

    def experts(x, ids, wts):
        return bi.moe_experts_fp4(x, ids, wts, w13, s13, w2, s2, 7.0)

    def make(m, g):
        return (torch.randn(m, 32, generator=g), torch.rand(m, e, generator=g).argsort(dim=1)[:, :k],
                torch.rand(m, k, generator=g))

    _rows_invariant(experts, make)
    args = make(13, _g(21))
    torch.testing.assert_close(experts(*args), REF.moe_experts_fp4(*args, w13, s13, w2, s2, 7.0), rtol=1e-5,
                               atol=1e-5)


def _attention_inputs(m, g, n_keys=40, width=20, rows=64):
    return (torch.randn(m, 4, 16, generator=g),
            torch.randint(-1, rows, (m, width), generator=g, dtype=torch.int64).to(torch.int32))


def test_attention_is_invariant_to_the_batch_and_to_wider_key_lists() -> None:
    kv = torch.randn(64, 16, generator=_g(22))
    extra = torch.randn(50, 16, generator=_g(23))
    sinks = torch.randn(4, generator=_g(24))
    ex_idx = lambda m, g, w=70: torch.randint(-1, 50, (m, w), generator=g).to(torch.int32)  # noqa: E731

    def attn(q, idx, idx2):
        return bi.sparse_attention_indexed(q, kv, idx, sinks, 0.25, extra, idx2)

    _rows_invariant(attn, lambda m, g: (*_attention_inputs(m, g), ex_idx(m, g)))
    q, idx = _attention_inputs(5, _g(25))
    idx2 = ex_idx(5, _g(26))
    alone = attn(q, idx, idx2)
    for more in (1, 58, 130):  # absent columns appended: a longer sequence elsewhere in the step
        wider = torch.cat([idx2, torch.full((5, more), -1, dtype=torch.int32)], dim=1)
        assert torch.equal(attn(q, idx, wider), alone)
    torch.testing.assert_close(alone, REF.sparse_attention_indexed(q, kv, idx, sinks, 0.25, extra, idx2),
                               rtol=1e-5, atol=1e-6)
    none = torch.full((1, 20), -1, dtype=torch.int32)  # no visible key: all mass on the sink
    assert torch.equal(bi.sparse_attention_indexed(q[:1], kv, none, sinks, 0.25), torch.zeros(1, 4, 16))


def test_indexer_topk_is_invariant_to_the_batch_and_to_wider_entry_lists() -> None:
    keys = torch.randn(90, 16, generator=_g(27))

    def make(m, g, e=75):
        rows = torch.randint(0, 90, (m, e), generator=g)
        return (torch.randn(m, 8, 16, generator=g), torch.randn(m, 8, generator=g), rows,
                torch.randint(1, e + 1, (m,), generator=g))

    def topk(q, w, rows, limits):
        return bi.indexer_topk(q, w, keys, rows, limits, 12, 0.25, as_rows=True, weight_scale=0.3)

    _rows_invariant(topk, make)
    q, w, rows, limits = make(6, _g(28))
    alone = topk(q, w, rows, limits)
    wider = torch.cat([rows, torch.full((6, 100), -1)], dim=1)
    assert torch.equal(topk(q, w, wider, limits), alone)
    assert torch.equal(alone, REF.indexer_topk(q, w, keys, rows, limits, 12, 0.25, as_rows=True, weight_scale=0.3))
    # Ties (all-zero scores: relu of negative products) go to the lower entry number, as in REF.
    zero = bi.indexer_topk(-q.abs(), w.abs(), keys.abs(), rows, limits, 12, 0.25)
    assert torch.equal(zero, REF.indexer_topk(-q.abs(), w.abs(), keys.abs(), rows, limits, 12, 0.25))


def test_compressor_pooling_is_invariant_to_the_other_emitting_windows() -> None:
    from deepinfer.ops.ref.compressor import pool_windows

    nw = torch.rand(16, generator=_g(29))

    def make(m, g):
        gate = torch.randn(m, 8, 16, generator=g)
        gate[:, :2] = float("-inf")  # empty slots
        return torch.randn(m, 8, 16, generator=g), gate

    _rows_invariant(lambda kv, gate: bi.pool_windows(kv, gate, nw, 1e-6, torch.float32), make)
    kv, gate = make(7, _g(30))
    torch.testing.assert_close(bi.pool_windows(kv, gate, nw, 1e-6, torch.float32),
                               pool_windows(kv, gate, nw, 1e-6, torch.float32), rtol=1e-5, atol=1e-6)


def test_log_softmax_for_logprobs_is_row_local() -> None:
    # Not a table entry: the sampler's log-softmax runs one row per program on the CPU; this guards it.
    _rows_invariant(lambda x: torch.log_softmax(x, dim=-1), lambda m, g: (torch.randn(m, 512, generator=g),))


def test_mode_is_stated_in_the_start_up_line_and_the_metrics(monkeypatch) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from deepinfer.engine.llm_engine import mode_line
    from deepinfer.server.metrics import ServerMetrics

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    cfg = EngineConfig.create(EngineArgs(device="cpu"))
    line = mode_line(cfg, select("cpu", cfg.batch_invariant))
    assert "ops=ref-batch-invariant batch_invariant=1" in line and "do not depend on the batch" in line
    metrics = ServerMetrics("demo")
    metrics.publish_engine_info(cfg.mode_labels())
    text = generate_latest(metrics.registry).decode()
    assert ('deepinfer:engine_info{batch_invariant="1",device="cpu",dtype="float32",model_name="demo"} 1.0'
            in text)
