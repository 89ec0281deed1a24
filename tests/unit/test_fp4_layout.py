"""The FP4 experts' host-side layout (``ops/fp4_layout.py``: what the Triton kernels read, plain torch) made for a
stack of experts at once is, expert for expert, the per-expert layout the loader used to make one expert at a
time: the same bits. The reference here is that per-expert path as it was (one 256-entry table gather per byte of
each word, one expert per call). The loader's experts, copied in as stored and laid out in batches as they arrive
(``FusedFP4Experts.load``), in any order and batch size, hold the same bits as the whole stack laid out at once.
And the loader's one-pass finite checks agree with ``isfinite``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.model import device as device_mod
from deepinfer.model.ckpt_plan import _finite, all_finite
from deepinfer.model.device import FusedFP4Experts
from deepinfer.ops import fp4_layout
from deepinfer.ops.table import REF

TILED = dataclasses.replace(REF, name="ref-tiled", fp4_expert_layout=fp4_layout.expert_layout)


def _lut_place_one(words: torch.Tensor) -> torch.Tensor:
    """One expert's placed words, as ``place_codes`` made them before: a 256-entry table per byte."""
    src = fp4_layout.placed_from()
    dst = [0] * 32
    for s, b in enumerate(src):
        dst[b] = s
    lut = torch.tensor([[sum(1 << dst[8 * j + i] for i in range(8) if v >> i & 1) for v in range(256)]
                        for j in range(4)], dtype=torch.int64)
    lut = torch.where(lut >= 2**31, lut - 2**32, lut).to(torch.int32)
    b = words.contiguous().view(torch.uint8).view(*words.shape, 4).long()
    return lut[0][b[..., 0]] | lut[1][b[..., 1]] | lut[2][b[..., 2]] | lut[3][b[..., 3]]


def _per_expert_layout(codes: torch.Tensor, scales: torch.Tensor, placed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of each expert alone (tiles of one expert, then the table placement), stacked."""
    out_c, out_s = [], []
    for c, s in zip(codes, scales):
        c, s = c[None], s[None]
        if c.shape[1] % fp4_layout.TILE_ROWS == 0:
            c, s = fp4_layout.tile_weights(c), fp4_layout.tile_weights(s, per_element=32)
        if placed:
            c = _lut_place_one(c[0].contiguous().view(torch.int32))[None]
        out_c.append(c[0])
        out_s.append(s[0])
    return torch.stack(out_c), torch.stack(out_s)


def _experts(n: int, rows: int, cols: int, raw: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, rows, cols // 2), generator=g, dtype=torch.int8)
    scales = torch.randint(100, 130, (n, rows, cols // 32), generator=g, dtype=torch.uint8)
    return codes, (scales if raw else torch.exp2(scales.float() - 127))


@pytest.mark.parametrize("pass_words", [None, 1000], ids=["one-pass", "passes-split-experts"])
@pytest.mark.parametrize("placed", [True, False])
@pytest.mark.parametrize("shape", [(5, 128, 256), (3, 96, 64)], ids=["tiled", "rows-not-tiled"])
@pytest.mark.parametrize("raw", [True, False], ids=["ue8m0-bytes", "fp32-scales"])
def test_batched_layout_equals_per_expert_layout(monkeypatch, shape, placed, raw, pass_words) -> None:
    if pass_words is not None:
        monkeypatch.setattr(fp4_layout, "_PASS_WORDS", pass_words)
    codes, scales = _experts(*shape, raw=raw, seed=sum(shape))
    got = fp4_layout.expert_layout(codes, scales, placed=placed)
    want = _per_expert_layout(codes, scales, placed)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)
    if placed:
        assert got[0].dtype == fp4_layout.PLACED_DTYPE
        assert torch.equal(fp4_layout.unplace_codes(fp4_layout.place_codes(codes)), codes)


def _load_all(module: FusedFP4Experts, codes13, scales13, codes2, scales2, order) -> None:
    inter = codes13.shape[1] // 2
    for e, which in order:
        if which == "w2":
            module.load(e, "w2", codes2[e], scales2[e])
        else:
            rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
            module.load(e, which, codes13[e, rows], scales13[e, rows])


@pytest.mark.parametrize("layout_bytes", [1, 20000, None], ids=["each-expert", "a-few-experts", "all-at-the-end"])
@pytest.mark.parametrize("ops", [TILED, REF], ids=["triton-layout", "ref-layout"])
def test_experts_laid_out_in_batches_as_they_arrive(monkeypatch, layout_bytes, ops) -> None:
    """Experts 2..7 of 10 (an expert-parallel rank's), their w1 / w3 / w2 in a shuffled order, laid out in
    batches of any size: the buffers equal the whole stack laid out at once."""
    if layout_bytes is not None:
        monkeypatch.setattr(device_mod, "_LAYOUT_BYTES", layout_bytes)
    hidden, inter, owned = 128, 64, range(2, 8)
    codes13, scales13 = _experts(10, 2 * inter, hidden, raw=True, seed=1)
    codes2, scales2 = _experts(10, hidden, inter, raw=True, seed=2)
    e8m0 = torch.float8_e8m0fnu
    module = FusedFP4Experts.empty(10, hidden, inter, True, 7.0, ops, "cpu", owned=owned)
    order = [(e, w) for e in owned for w in ("w1", "w3", "w2")]
    perm = torch.randperm(len(order), generator=torch.Generator().manual_seed(3)).tolist()
    _load_all(module, codes13, scales13.view(e8m0), codes2, scales2.view(e8m0), [order[i] for i in perm])
    assert module.pending() == []
    module.lay_out_arrived()
    want13 = ops.fp4_expert_layout(codes13[2:8], scales13[2:8])
    want2 = ops.fp4_expert_layout(codes2[2:8], scales2[2:8])
    for name, want in zip(("w13", "s13", "w2", "s2"), (*want13, *want2)):
        got = getattr(module, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name


def test_half_an_expert_is_pending_and_never_laid_out(monkeypatch) -> None:
    monkeypatch.setattr(device_mod, "_LAYOUT_BYTES", 1)
    codes13, scales13 = _experts(4, 128, 128, raw=True, seed=4)
    module = FusedFP4Experts.empty(4, 128, 64, True, 7.0, TILED, "cpu")
    module.load(1, "w3", codes13[1, 64:], scales13[1, 64:])
    assert module.pending() == [1]
    with pytest.raises(ValueError, match="expert 5 is not among"):
        module.load(5, "w1", codes13[1, :64], scales13[1, :64])
    with pytest.raises(ValueError, match=r"expert 2 w1: codes \(64, 32\) .* do not fit \(64, 64\)"):
        module.load(2, "w1", codes13[2, :64, :32], scales13[2, :64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_isfinite(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    assert all_finite(torch.empty(0, dtype=dtype))
    for n in (1, 7, 33, 1000, 4099):
        x = torch.randn(n, generator=g).to(dtype)
        assert all_finite(x)
        for bad in (float("nan"), float("inf"), -float("inf")):
            for at in {0, n // 2, n - 1}:
                y = x.clone()
                y[at] = bad
                assert not all_finite(y), (n, bad, at)
                assert not all_finite(y.view(1, n))


def test_fp4_codes_read_only_when_the_largest_scale_could_overflow() -> None:
    """6 (the largest e2m1 magnitude) times the largest scale finite: finite whatever the codes. Else the codes
    decide: code 7 (6.0) with a 1e38 scale overflows, code 1 (0.5) does not."""
    small, large = torch.full((2, 8), 0x11, dtype=torch.uint8), torch.full((2, 8), 0x71, dtype=torch.uint8)
    one, huge = torch.ones(2, 1), torch.full((2, 1), 1e38)
    assert _finite("fp4", large, one, (1, 32))
    assert _finite("fp4", small, huge, (1, 32))
    assert not _finite("fp4", large, huge, (1, 32))
