"""Reference (plain PyTorch) FP8 / FP4 weight formats of the DeepSeek-V4 checkpoints (architecture note §1.3).

* FP8 dense linears: ``float8_e4m3fn`` weight [N, K] and one UE8M0 scale per (bn x bk) block, stored as
  ``float8_e8m0fnu`` [ceil(N/bn), ceil(K/bk)]; value = e4m3 * 2^(e-127). Edge blocks may be partial.
* FP4 routed experts: int8 container [N, K/2] holding two e2m1 codes per byte (low nibble = element 2k,
  high nibble = element 2k+1), one UE8M0 scale per row per 32 input elements: [N, ceil(K/32)].

UE8M0 scales are decoded from their *bits* (the byte is a biased exponent), never by a numeric
conversion of ``float8_e8m0fnu``: a byte is a byte on every torch version, and 255 (NaN) is rejected loudly
instead of silently poisoning a weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer.config.model import ModelConfig

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP4_GROUP = 32  # input elements per FP4 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
# Round-to-nearest on the e2m1 grid: midpoints between neighbours. Ties go to the even code (IEEE style):
# 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)

Format = Literal["fp8", "fp4", "bf16", "fp16", "fp32", "int64"]


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight exactly as stored on disk, kept for the GPU path (which runs FP8/FP4 GEMMs directly).

    ``data``: e4m3 [N, K] (fp8) or packed int8 [N, K/2] (fp4). ``scale``: the stored scale tensor
    (``float8_e8m0fnu``, or fp32 multipliers for checkpoints that ship them). ``block``: (rows, cols) of
    the weight covered by one scale: (bn, bk) for fp8, (1, 32) for fp4.
    """

    format: Literal["fp8", "fp4"]
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        if self.format == "fp8":
            return dequant_fp8_block(self.data, self.scale, self.block)
        return dequant_fp4(self.data, self.scale)


# ---- UE8M0 scales ------------------------------------------------------------------------------------------
def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (``float8_e8m0fnu`` or ``uint8``) -> fp32 2^(e-127), decoded from the bits."""
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"UE8M0 scale: expected float8_e8m0fnu or uint8, got {scale.dtype}")
    e = scale.contiguous().view(torch.uint8).to(torch.int32)
    if bool((e == 255).any()):
        raise ValueError("UE8M0 scale: byte 255 encodes NaN; the checkpoint's scale tensor is corrupt")
    # fp32 with biased exponent field e and zero mantissa is exactly 2^(e-127); e == 0 is the subnormal
    # 2^-127 = mantissa bit 22 set. Building the bits avoids any pow/exp rounding question.
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def exponent_to_ue8m0(exp: torch.Tensor) -> torch.Tensor:
    """Unbiased int exponents in [-127, 127] -> ``float8_e8m0fnu`` bytes (e + 127)."""
    if bool(((exp < -127) | (exp > 127)).any()):
        raise ValueError("UE8M0 exponent out of range [-127, 127]")
    return (exp.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Any stored scale -> fp32 multipliers: UE8M0 bytes are decoded bitwise; fp32 scales (some FP8-expert
    checkpoints ship them) are taken as multipliers and must be finite and positive."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return ue8m0_to_float(scale)
    if scale.dtype == torch.float32:
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError("fp32 scale: values must be finite and positive")
        return scale
    raise TypeError(f"scale: expected float8_e8m0fnu, uint8 or float32, got {scale.dtype}")


def _pow2_exponent(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest e with amax / 2^e <= limit (ceil(log2(amax / limit)), exact via frexp); 0 for empty blocks."""
    mant, ex = torch.frexp(amax.to(torch.float32) / limit)  # v = mant * 2^ex, mant in [0.5, 1)
    e = torch.where(mant == 0.5, ex - 1, ex)  # v is exactly 2^(ex-1)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return e.clamp(-127, 127)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Scale grid -> per-element multipliers of ``shape`` (edge blocks cut to size)."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    n, k = shape
    return (-(-n // block[0]), -(-k // block[1]))


def fp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Scale grid of the *unpacked* [N, K] weight."""
    n, k = shape
    return (n, -(-k // FP4_GROUP))


# ---- FP8 e4m3, block scales ----------------------------------------------------------------------------------
def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """e4m3 [N, K] with scales [ceil(N/bn), ceil(K/bk)] -> fp32 [N, K]."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight: expected float8_e4m3fn, got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"FP8 weight: expected 2-D, got shape {tuple(w.shape)}")
    want = fp8_scale_shape(tuple(w.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale: expected {want} for weight {tuple(w.shape)} and block {block}, "
                         f"got {tuple(scale.shape)}")
    return w.to(torch.float32) * _expand(scale_to_float(scale), tuple(w.shape), block)


def quant_fp8_exponents(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 [N, K], int32 exponents [ceil(N/bn), ceil(K/bk)]); the block's amax maps <= 448."""
    w = w.to(torch.float32)
    n, k = w.shape
    sn, sk = fp8_scale_shape((n, k), block)
    padded = torch.zeros(sn * block[0], sk * block[1], dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    amax = padded.abs().view(sn, block[0], sk, block[1]).amax(dim=(1, 3))
    exp = _pow2_exponent(amax, E4M3_MAX)
    scaled = w / _expand(ue8m0_to_float(exponent_to_ue8m0(exp)), (n, k), block)  # exact: power of two
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), exp.to(torch.int32)


def quant_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 [N, K], UE8M0 scale ``float8_e8m0fnu`` [ceil(N/bn), ceil(K/bk)])."""
    q, exp = quant_fp8_exponents(w, block)
    return q, exponent_to_ue8m0(exp)


# ---- FP4 e2m1, per-32 scales ---------------------------------------------------------------------------------
def _e2m1_table(device: torch.device | None = None) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])  # code | 8 is the negative of code (code 8 is -0.0)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [N, K/2] -> fp32 [N, K]; element 2k is the low nibble of byte k, element 2k+1 the high nibble."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"FP4 weight: expected an int8 container, got {packed.dtype}")
    u8 = packed.contiguous().view(torch.uint8)
    table = _e2m1_table(packed.device)
    # One gather from a 256-entry table of (low, high) value pairs instead of two nibble lookups.
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=-1)  # [256, 2]
    return pairs[u8.long()].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K/2] with UE8M0 scales [N, ceil(K/32)] -> fp32 [N, K]."""
    values = unpack_fp4(packed)
    if values.dim() != 2:
        raise ValueError(f"FP4 weight: expected 2-D, got shape {tuple(packed.shape)}")
    want = fp4_scale_shape(tuple(values.shape))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP4 scale: expected {want} for unpacked weight {tuple(values.shape)}, "
                         f"got {tuple(scale.shape)}")
    return values * _expand(scale_to_float(scale), tuple(values.shape), (1, FP4_GROUP))


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already scaled into [-6, 6]) -> e2m1 codes (uint8 0..15), round to nearest, ties to even."""
    a = x.abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32)
    idx = torch.bucketize(a, mids)  # a == midpoint rounds down here ...
    idx = idx + torch.isin(a, torch.tensor(_E2M1_TIES_UP, dtype=torch.float32)).long()  # ... unless odd->even is up
    sign = ((x < 0) & (idx > 0)).long() << 3  # no -0.0 codes from rounding
    return (idx | sign).to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [N, K] (K even) -> int8 [N, K/2], low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4: the input dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def quant_fp4_exponents(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e2m1 codes uint8 [N, K], int32 exponents [N, ceil(K/32)]); each group's amax maps <= 6."""
    w = w.to(torch.float32)
    n, k = w.shape
    groups = -(-k // FP4_GROUP)
    padded = torch.zeros(n, groups * FP4_GROUP, dtype=torch.float32)
    padded[:, :k] = w
    amax = padded.abs().view(n, groups, FP4_GROUP).amax(dim=2)
    exp = _pow2_exponent(amax, E2M1_MAX)
    scaled = w / _expand(ue8m0_to_float(exponent_to_ue8m0(exp)), (n, k), (1, FP4_GROUP))
    return round_to_e2m1(scaled), exp.to(torch.int32)


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (packed int8 [N, K/2], UE8M0 scale ``float8_e8m0fnu`` [N, ceil(K/32)])."""
    codes, exp = quant_fp4_exponents(w)
    return pack_fp4(codes), exponent_to_ue8m0(exp)


# ---- which tensor is stored how ------------------------------------------------------------------------------
_FP32_PARAM = re.compile(r"(^|\.)(hc_(attn|ffn|head)_(fn|base|scale)|ape|attn_sink|ffn\.gate\.bias)$")
_FP8_DENSE = re.compile(
    r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123]"
    r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$"
)
_ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_DTYPE_FORMAT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float": "fp32", "half": "fp16"}


def config_float_format(cfg: ModelConfig) -> Format:
    """The float format of an unquantized checkpoint (its ``torch_dtype``; bf16 when unset or "auto")."""
    return _DTYPE_FORMAT.get(cfg.dtype.removeprefix("torch."), "bf16")  # type: ignore[return-value]


def storage_format(native_name: str, cfg: ModelConfig) -> Format:
    """How ``native_name`` is stored on disk for ``cfg`` (§1.3). Scale companions are not covered."""
    if native_name.endswith(".tid2eid"):
        return "int64"
    fp32_param = bool(_FP32_PARAM.search(native_name))
    if not fp32_param and not native_name.endswith(".weight"):
        raise ValueError(f"{native_name}: not a DeepSeek-V4 parameter name")
    if cfg.quant is None:
        return config_float_format(cfg)  # unquantized checkpoints store every float in the config dtype
    if fp32_param:
        return "fp32"
    if _FP8_DENSE.search(native_name):
        return "fp8"
    if _ROUTED_EXPERT.search(native_name):
        return {"fp4": "fp4", "fp8": "fp8"}.get(cfg.quant.expert_dtype, "bf16")  # type: ignore[return-value]
    return "bf16"  # embed, head, norms, router weight, compressor/indexer-compressor wkv/wgate, weights_proj


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.scale`` (the native companion name)."""
    return weight_name.removesuffix(".weight") + ".scale"
