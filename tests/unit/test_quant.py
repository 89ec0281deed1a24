"""FP8 / FP4 / UE8M0 reference formats: hand-written vectors pin the bit layouts, round trips bound the error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.model.quant import (
    QuantizedWeight,
    dequant_fp4,
    dequant_fp8_block,
    pack_fp4,
    quant_fp4,
    quant_fp8_block,
    round_to_e2m1,
    scale_to_float,
    storage_format,
    ue8m0_to_float,
    unpack_fp4,
)
from tests.oracle.hf import tiny_native_config

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}


def u8(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def e8m0(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ---- UE8M0 ---------------------------------------------------------------------------------------------------
def test_ue8m0_decodes_bits():
    got = ue8m0_to_float(u8(127, 130, 0, 126, 254, 1))
    want = torch.tensor([1.0, 8.0, 2.0**-127, 0.5, 2.0**127, 2.0**-126], dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert got[2].item() == 2.0**-127 and got[2].item() > 0  # subnormal in fp32, not flushed to zero


def test_ue8m0_accepts_e8m0_dtype_and_rejects_nan_and_other_dtypes():
    assert torch.equal(ue8m0_to_float(e8m0([[127, 130]])), torch.tensor([[1.0, 8.0]]))
    with pytest.raises(ValueError, match="255"):
        ue8m0_to_float(u8(127, 255))
    with pytest.raises(TypeError):
        ue8m0_to_float(torch.tensor([1.0]))
    assert torch.equal(scale_to_float(torch.tensor([0.25])), torch.tensor([0.25]))  # fp32 multipliers pass
    with pytest.raises(ValueError):
        scale_to_float(torch.tensor([-1.0]))


# ---- FP4 e2m1 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "byte, want",
    [
        (0x21, [0.5, 1.0]),  # low nibble 0001 = 0.5 is element 0; high nibble 0010 = 1.0 is element 1
        (0x9F, [-6.0, -0.5]),  # low 1111 = -(111) = -6; high 1001 = -(001) = -0.5
        (0x35, [3.0, 1.5]),  # low 0101 = 3; high 0011 = 1.5
        (0xE4, [2.0, -4.0]),  # low 0100 = 2; high 1110 = -4
        (0x7A, [-1.0, 6.0]),  # low 1010 = -1; high 0111 = 6
        (0xDB, [-1.5, -3.0]),  # low 1011 = -1.5; high 1101 = -3
        (0x00, [0.0, 0.0]),
    ],
)
def test_unpack_fp4_nibble_order_and_table(byte, want):
    packed = u8(byte).view(torch.int8).view(1, 1)  # int8 container, as on disk (0x9F is -97)
    assert torch.equal(unpack_fp4(packed), torch.tensor([want]))


def test_unpack_fp4_full_table_and_negative_zero():
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    got = unpack_fp4(torch.arange(16, dtype=torch.uint8).view(torch.int8).view(1, 16))
    assert torch.equal(got[0, 0::2], torch.tensor(table))  # low nibbles = the code
    assert torch.equal(got[0, 1::2], torch.zeros(16))  # high nibbles = 0
    assert torch.signbit(unpack_fp4(u8(0x08).view(1, 1)))[0, 0]  # code 8 is -0.0


def test_pack_fp4_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 9]], dtype=torch.uint8)
    assert pack_fp4(codes).view(torch.uint8).tolist() == [[0x21, 0x9F]]


def test_dequant_fp4_applies_per_32_scales():
    packed = u8(0x21, 0x9F).view(torch.int8).view(1, 2)  # [0.5, 1, -6, -0.5]
    assert torch.equal(dequant_fp4(packed, e8m0([[128]])), torch.tensor([[1.0, 2.0, -12.0, -1.0]]))
    # K = 64: two groups of 32 with their own scales; every element is code 2 (1.0).
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8).view(torch.int8)
    got = dequant_fp4(packed, e8m0([[127, 129], [125, 127]]))
    want = torch.tensor([[1.0] * 32 + [4.0] * 32, [0.25] * 32 + [1.0] * 32])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="scale"):
        dequant_fp4(packed, e8m0([[127], [127]]))


def test_round_to_e2m1_nearest_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, -0.74, 7.0, -0.1, -5.5, 2.9])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, -0.5, 6.0, 0.0, -6.0, 3.0])
    got = unpack_fp4(pack_fp4(round_to_e2m1(torch.cat([x, torch.zeros(1)])).view(1, -1)))[0, :-1]
    assert torch.equal(got, want)


def test_fp4_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-3, 1, 24)[:, None]
    w[3, :32] = 0.0  # an all-zero group
    packed, scale = quant_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (24, 48)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (24, 3)
    s = ue8m0_to_float(scale).repeat_interleave(32, 1)
    amax = w.abs().view(24, 3, 32).amax(-1).repeat_interleave(32, 1)
    nz = amax > 0
    assert bool(((amax <= 6 * s) & (amax > 3 * s))[nz].all())  # the tightest power of two
    err = (dequant_fp4(packed, scale) - w).abs()
    assert bool((err <= torch.maximum(0.25 * s, w.abs() / 4) + 1e-12).all())
    assert torch.equal(dequant_fp4(packed, scale)[3, :32], torch.zeros(32))
    exact = torch.tensor([[0.5, -1.0, 1.5, 6.0, -3.0, 4.0] * 5 + [2.0, 0.0]]) * 0.125
    assert torch.equal(dequant_fp4(*quant_fp4(exact)), exact)


def test_fp4_partial_group():
    w = torch.linspace(-1, 1, 2 * 16).view(2, 16)
    packed, scale = quant_fp4(w)
    assert packed.shape == (2, 8) and scale.shape == (2, 1)
    assert (dequant_fp4(packed, scale) - w).abs().max() <= 0.25


# ---- FP8 e4m3 block scales -----------------------------------------------------------------------------------
def test_dequant_fp8_block_partial_edges_by_hand():
    w = torch.ones(3, 4).to(torch.float8_e4m3fn)
    got = dequant_fp8_block(w, e8m0([[127, 128], [126, 130]]), (2, 2))
    want = torch.tensor([[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0], [0.5, 0.5, 8.0, 8.0]])
    assert torch.equal(got, want)


def test_dequant_fp8_block_matches_loop():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(5, 7, generator=g) * 20).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 135, (3, 3), generator=g, dtype=torch.uint8)
    got = dequant_fp8_block(w, scale.view(torch.float8_e8m0fnu), (2, 3))
    want = torch.empty(5, 7)
    for i in range(5):
        for j in range(7):
            want[i, j] = float(w[i, j].float()) * 2.0 ** (int(scale[i // 2, j // 3]) - 127)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="scale"):
        dequant_fp8_block(w, scale[:2].view(torch.float8_e8m0fnu), (2, 3))
    with pytest.raises(TypeError):
        dequant_fp8_block(w.float(), scale.view(torch.float8_e8m0fnu), (2, 3))


def test_fp8_round_trip_error_bound():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 200, generator=g) * 0.05
    w[:128, :128] *= 1000.0  # blocks of very different magnitude
    q, scale = quant_fp8_block(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 2)
    s = ue8m0_to_float(scale).repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    amax = torch.zeros(3, 2)
    for i in range(3):
        for j in range(2):
            amax[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
    s_grid = ue8m0_to_float(scale)
    assert bool(((amax <= 448 * s_grid) & (amax > 224 * s_grid)).all())  # the tightest power of two
    err = (dequant_fp8_block(q, scale, (128, 128)) - w).abs()
    # e4m3: 3 mantissa bits (relative step 2^-3, half-step 2^-4); subnormal step 2^-9.
    assert bool((err <= torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10) + 1e-30).all())
    exact = torch.tensor([[1.0, -1.5, 448.0, 0.0], [2.0**-6, 3.0, -7.0, 0.125]])
    q, scale = quant_fp8_block(exact, (128, 128))
    assert torch.equal(dequant_fp8_block(q, scale, (128, 128)), exact)
    q, scale = quant_fp8_block(torch.zeros(4, 4), (2, 2))
    assert scale.view(torch.uint8).tolist() == [[127, 127], [127, 127]]


def test_quantized_weight_is_frozen_and_dequantizes():
    q, scale = quant_fp8_block(torch.ones(2, 2), (128, 128))
    qw = QuantizedWeight("fp8", q, scale, (128, 128))
    assert torch.equal(qw.dequantize(), torch.ones(2, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        qw.format = "fp4"  # type: ignore[misc]
    packed, scale4 = quant_fp4(torch.ones(2, 32))
    assert torch.equal(QuantizedWeight("fp4", packed, scale4, (1, 32)).dequantize(), torch.ones(2, 32))


# ---- storage formats -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8", "bf16"])
def test_storage_format_quantized(expert_dtype):
    cfg = ModelConfig.from_dict(tiny_native_config(quantization_config=QUANT, expert_dtype=expert_dtype))
    table = {
        "embed.weight": "bf16", "head.weight": "bf16", "norm.weight": "bf16", "hc_head_fn": "fp32",
        "hc_head_base": "fp32", "hc_head_scale": "fp32", "layers.0.attn_norm.weight": "bf16",
        "layers.0.hc_attn_fn": "fp32", "layers.0.hc_ffn_scale": "fp32", "layers.0.attn.wq_a.weight": "fp8",
        "layers.0.attn.wq_b.weight": "fp8", "layers.0.attn.wkv.weight": "fp8", "layers.0.attn.wo_a.weight": "fp8",
        "layers.0.attn.wo_b.weight": "fp8", "layers.0.attn.q_norm.weight": "bf16",
        "layers.0.attn.kv_norm.weight": "bf16", "layers.0.attn.attn_sink": "fp32",
        "layers.1.attn.compressor.wkv.weight": "bf16", "layers.1.attn.compressor.wgate.weight": "bf16",
        "layers.1.attn.compressor.ape": "fp32", "layers.1.attn.compressor.norm.weight": "bf16",
        "layers.1.attn.indexer.wq_b.weight": "fp8", "layers.1.attn.indexer.weights_proj.weight": "bf16",
        "layers.1.attn.indexer.compressor.wkv.weight": "bf16", "layers.1.attn.indexer.compressor.ape": "fp32",
        "layers.0.ffn.gate.weight": "bf16", "layers.0.ffn.gate.tid2eid": "int64", "layers.1.ffn.gate.bias": "fp32",
        "layers.0.ffn.shared_experts.w1.weight": "fp8", "layers.0.ffn.shared_experts.w2.weight": "fp8",
        "layers.2.ffn.experts.7.w3.weight": expert_dtype, "mtp.0.e_proj.weight": "fp8",
        "mtp.0.h_proj.weight": "fp8", "mtp.0.enorm.weight": "bf16", "mtp.0.hc_head_fn": "fp32",
        "mtp.0.attn.wq_a.weight": "fp8", "mtp.0.ffn.experts.0.w1.weight": expert_dtype,
    }
    assert {n: storage_format(n, cfg) for n in table} == table


def test_storage_format_unquantized_uses_config_dtype():
    cfg = ModelConfig.from_dict(tiny_native_config(torch_dtype="bfloat16"))
    assert storage_format("layers.0.attn.wq_a.weight", cfg) == "bf16"
    assert storage_format("layers.0.hc_attn_fn", cfg) == "bf16"
    assert storage_format("layers.0.ffn.gate.tid2eid", cfg) == "int64"
    cfg = ModelConfig.from_dict(tiny_native_config(torch_dtype="float32"))
    assert storage_format("layers.1.ffn.experts.0.w1.weight", cfg) == "fp32"
    with pytest.raises(ValueError):
        storage_format("layers.0.attn.rotary", cfg)
