"""DeepSeek-V4.1's packed cache rows: ``quantize`` / ``dequantize`` against ``qdq`` (bit for bit), the byte
layout of each format (codes then scales, the even channel in the low nibble), and the packed layout's pools:
bytes per block by the formats' formula, what the storage allocates, block copies and tier payloads of uint8
rows. (``test_v41_components.py`` ties the round trip to the oracle's quantizer too.)"""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.v41 import V41Config
from deepinfer.kv.spec import HISTORY, POOLS, STATE, WINDOW, E2M1_E4M3_16, E2M1_UE8M0_32, FP8_UE8M0_32
from deepinfer.kv.spec_v41 import build_v41_layout
from deepinfer.kv.storage import KVStorage
from deepinfer.kv.tiers import pack, unpack
from deepinfer.model.v41.cache_quant import BLOCK, PACKED, dequantize, qdq, quantize
from tests.oracle.v41 import checkpoint_config, tiny_text_config, tiny_tokenizer

FORMATS = ("fp8", "mxfp4", "nvfp4")
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _values(channels: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows over many binades, an all-zero and a negative-zero row, tiny and huge magnitudes, e2m1 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, channels, generator=g) * torch.exp2(torch.randint(-40, 40, (40, 1), generator=g).float())
    x[0], x[1] = 0.0, -0.0
    x[2] = 1e-30 * torch.randn(channels, generator=g)
    x[3, :3] = torch.tensor([1e-38, -3e-39, 5e-45])[:channels]  # subnormal fp32
    x[4] = 1e30 * torch.randn(channels, generator=g)
    x[5, :1] = 3e38
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[6] = ties.repeat(-(-channels // 8))[:channels]
    x[7] = -x[6]
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [512, 128, 48, 33, 7])  # 48, 33, 7: a partial last block; 33, 7: odd
def test_round_trip_equals_qdq_bitwise(fmt, dtype, channels) -> None:
    for seed in range(2):
        x = _values(channels, dtype, seed)
        packed = quantize(x, fmt)
        assert packed.dtype == torch.uint8 and packed.shape == (40, PACKED[fmt].row_bytes(channels))
        back = dequantize(packed, fmt, channels, dtype)
        assert back.dtype == dtype
        assert torch.equal(back.view(_INT[dtype]), qdq(x, fmt).view(_INT[dtype]))
        # Leading dimensions are kept; rows are independent.
        assert torch.equal(quantize(x.view(4, 10, channels), fmt).flatten(0, 1), packed)


def test_fp8_bytes() -> None:
    """e4m3 codes, then one UE8M0 byte per 32 channels: the biased exponent of the power-of-two scale."""
    x = torch.ones(1, 64)
    x[0, 32:] = -3.0  # amax 3: scale 2^ceil(log2(3/448)) = 2^-7, 3 / 2^-7 = 384
    row = quantize(x, "fp8")[0]
    # 1 / 2^-8 = 256 = 2^8: e4m3 exponent 8 + 7 -> 0x78; 384 = 1.5 * 2^8 -> 0x7C, with the sign 0xFC.
    assert row[:32].tolist() == [0x78] * 32 and row[32:64].tolist() == [0xFC] * 32
    assert row[64:].tolist() == [127 - 8, 127 - 7]


@pytest.mark.parametrize("fmt, scale_bytes", [("mxfp4", [127]), ("nvfp4", [0x38, 0x38])])
def test_fp4_bytes(fmt, scale_bytes) -> None:
    """Two e2m1 codes per byte, channel 2k in the low nibble, the sign in the nibble's top bit; then the scales
    (amax 6: MXFP4 scale 2^0, UE8M0 127; NVFP4 scale 1.0, e4m3 0x38 per 16 channels)."""
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([0.5, -1.0, 6.0, 0.0, -0.0])
    x[0, 16] = 6.0
    row = quantize(x, fmt)[0]
    assert row[:3].tolist() == [0x1 | 0xA << 4, 0x7 | 0x0 << 4, 0x8]  # 0.5 | -1 << 4, 6 | 0 << 4, -0
    assert row[8].tolist() == 0x7 and row[16:].tolist() == scale_bytes


def test_dequantize_refuses_rows_of_another_width() -> None:
    with pytest.raises(ValueError, match=r"^rows: packed e2m1\+ue8m0/32 rows of 128 channels are uint8 \[\.\.\., 68\]"):
        dequantize(torch.zeros(2, 66, dtype=torch.uint8), "mxfp4", 128, torch.float32)


def test_released_record_sizes() -> None:
    """Spec §4.1: window KV 512 + 16 B, compressed KV 256 + 32 B, index keys 64 + 4 B."""
    assert (FP8_UE8M0_32.row_bytes(512), E2M1_E4M3_16.row_bytes(512), E2M1_UE8M0_32.row_bytes(128)) == (528, 288, 68)
    assert {f: p.block for f, p in PACKED.items()} == BLOCK


@pytest.fixture(scope="module")
def cfg() -> V41Config:
    return V41Config.from_dict(checkpoint_config(tiny_text_config(tiny_tokenizer(512))))


def _fp8(c: int) -> int:
    return c + -(-c // 32)


def _fp4(c: int, block: int) -> int:
    return -(-c // 2) + -(-c // block)


@pytest.mark.parametrize("dspark", [False, True])
def test_packed_pools_bytes_per_block_follow_the_formula(cfg, dspark) -> None:
    bs = 128
    layout = build_v41_layout(cfg, bs, dspark=dspark, packed=True)
    sources = [cfg.role(i).ratio for i in range(cfg.num_hidden_layers) if cfg.role(i).kv_source]
    d, di = cfg.head_dim, cfg.index_head_dim
    window_rows = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if dspark else 0)
    want = {
        WINDOW: bs * (window_rows * _fp8(d) + 4),  # + Engram's float32 token id
        HISTORY: sum(bs // r * (_fp4(d, 16) + _fp4(di, 32)) for r in sources),
        STATE: sum(bs * 2 * d * 4 for r in sources if r == 2),  # fp32 value and gate, unpacked
    }
    formats = {(s.key.split(".")[0], t.name): t.dtype for s in layout.layers for t in s.tensors}
    assert formats == {("layers", "window_kv"): FP8_UE8M0_32.name, ("layers", "entries"): E2M1_E4M3_16.name,
                       ("layers", "index_keys"): E2M1_UE8M0_32.name, ("layers", "compressor_state"): "float32",
                       ("engram", "token_ids"): "float32", **({("mtp", "window_kv"): FP8_UE8M0_32.name} if dspark
                                                             else {})}
    for dtype_bytes in (2, 4):  # packed rows do not depend on the activation dtype; the token ids and state neither
        assert {p: layout.bytes_per_block(p, dtype_bytes) for p in POOLS} == want
    unpacked = build_v41_layout(cfg, bs, dspark=dspark)
    assert unpacked.bytes_per_block(HISTORY, 2) == sum(bs // r * 2 * (d + di) for r in sources)
    storage = KVStorage(layout, {p: 3 for p in POOLS}, torch.bfloat16)
    assert storage.packed and not KVStorage(unpacked, {p: 1 for p in POOLS}, torch.bfloat16).packed
    for pool in POOLS:
        allocated = sum(t.numel() * t.element_size() for (key, name), t in storage.tensors.items()
                        if storage.spec(key, name).pool == pool)
        assert allocated == 4 * want[pool], pool  # 3 blocks and the spare


def test_block_copy_and_tier_payload_of_packed_rows(cfg) -> None:
    layout = build_v41_layout(cfg, 128, dspark=True, packed=True)
    src, dst = KVStorage(layout, {p: 3 for p in POOLS}, torch.float32), KVStorage(layout, {p: 3 for p in POOLS},
                                                                                  torch.float32)
    g = torch.Generator().manual_seed(0)
    for t in src.tensors.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    for pool in POOLS:
        data = pack(src, pool, 1)
        assert len(data) == layout.bytes_per_block(pool, 4)
        unpack(data, dst, pool, 2)
        src.copy_block(pool, 1, 0)
        for (key, name), t in src.tensors.items():
            spec = src.spec(key, name)
            if spec.pool == pool:  # compared as bytes: the random float32 rows (state, token ids) hold NaNs
                n, t, out = layout.rows_per_block(spec), t.view(torch.uint8), dst.get(key, name).view(torch.uint8)
                assert torch.equal(t[0:n], t[n:2 * n]) and torch.equal(out[2 * n:3 * n], t[n:2 * n]), (key, name)
                assert (src.get(key, name).dtype == torch.uint8) == (spec.packed is not None), (key, name)


def test_packed_storage_needs_the_models_rounding(cfg) -> None:
    """Packed rows hold the released formats' roundings: a model loaded without them (``cache_qdq=False``,
    ``kv_cache_dtype`` float32's) is refused on such a storage, naming it."""
    from deepinfer.model.batch import ForwardBatch
    from deepinfer.model.step_index import build_step_index
    from deepinfer.model.v41.dummy import load_dummy_v41
    from deepinfer.model.v41.paged import PagedV41

    model = PagedV41(load_dummy_v41(cfg, torch.float32, tokenizer=tiny_tokenizer(512), cache_qdq=False))
    storage = KVStorage(build_v41_layout(cfg, 128, packed=True), {p: 1 for p in POOLS}, torch.float32)
    index = build_step_index(ForwardBatch(()), storage, cfg.sliding_window, num_tokens=2, num_seqs=1, max_len=128)
    with pytest.raises(ValueError, match=r"^storage: packed cache rows .*\(cache_qdq=False\)"):
        model(torch.zeros(2, dtype=torch.long), None, storage, index)


def test_e2m1_grid_computed_on_the_device_is_the_format_table() -> None:
    """The e2m1 levels and midpoints are computed where they are used (no host copy: a sync on a GPU)."""
    from deepinfer.model.v41 import cache_quant

    for dtype in (torch.float32, torch.bfloat16):
        mids, levels = cache_quant._e2m1_grid(torch.device("cpu"), dtype)
        assert levels.tolist() == list(cache_quant._E2M1_LEVELS) and levels.dtype == dtype
        assert mids.tolist() == list(cache_quant._E2M1_MIDPOINTS)
