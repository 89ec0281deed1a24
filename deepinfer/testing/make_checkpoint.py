"""Write a random DeepSeek-V4 checkpoint in the released (native, quantized) on-disk format.

Used by tests and for trying the engine without real weights:

    python -m deepinfer.testing.make_checkpoint --out /tmp/tiny --preset tiny --seed 0

Every parameter is randomized, including those Hugging Face initializes to constants (tid2eid, attn_sink,
ape, router bias, mHC bases), so a loader that silently skipped one would be caught by a comparison.
FP8 tensors are e4m3 with UE8M0 (``float8_e8m0fnu``) block scales, FP4 experts are int8-packed e2m1 with
per-32 UE8M0 scales, everything else follows ``storage_format``. The function returns the fp32 values a
correct loader must produce; they are computed here from the quantizer's codes and integer exponents
(``ldexp``), not through the dequantizers the loader uses.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from deepinfer.config.model import ModelConfig
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.quant import (
    E2M1_VALUES,
    FP4_GROUP,
    exponent_to_ue8m0,
    pack_fp4,
    quant_fp4_exponents,
    quant_fp8_exponents,
    scale_name,
    storage_format,
)

_STORE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
_YARN = {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536}

PRESETS: dict[str, dict[str, Any]] = {
    # Shaped like tests/oracle/hf.py's tiny config: every layer kind, a hash layer, MTP, partial 128-blocks.
    "tiny": dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=97, hidden_size=32,
        num_hidden_layers=3, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2,
        o_lora_rank=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        compress_ratios=[0, 4, 128, 0], num_hash_layers=1, index_n_heads=16, index_head_dim=16, index_topk=8,
        sliding_window=128, rope_scaling=_YARN, num_nextn_predict_layers=1, torch_dtype="bfloat16",
        quantization_config=_QUANT, expert_dtype="fp4",
    ),
    # V4-Flash's structure (head_dim 512, rope 64, SWA+CSA+HCA, 3 hash-free routed layers) at ~60M params.
    "flash-like": dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=4096, hidden_size=512,
        num_hidden_layers=4, num_attention_heads=8, head_dim=512, qk_rope_head_dim=64, q_lora_rank=256,
        o_groups=4, o_lora_rank=256, n_routed_experts=16, num_experts_per_tok=6, n_shared_experts=1,
        moe_intermediate_size=256, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, index_n_heads=8,
        index_head_dim=128, index_topk=64, sliding_window=128, rope_scaling=_YARN, num_nextn_predict_layers=1,
        routed_scaling_factor=1.5, torch_dtype="bfloat16", quantization_config=_QUANT, expert_dtype="fp4",
    ),
}


def _randomize(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """Sane magnitudes: matrices ~ N(0, clamp(1/sqrt(fan_in), 0.02, 0.1)), norms ~ 1, biases small."""
    if name.endswith(".tid2eid"):
        # Distinct experts per token, as a real hash table has.
        return torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(dim=1)[:, : shape[1]].contiguous()
    if re.search(r"(^|\.|_)hc_\w+_scale$", name):
        return 1.0 + 0.2 * torch.randn(shape, generator=g)
    if re.search(r"(attn_sink|\.ape|_base)$", name):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("gate.bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 1:  # norm weights
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    std = min(0.1, max(0.02, 1.0 / math.sqrt(shape[-1])))
    return std * torch.randn(shape, generator=g)


def _encode(w: torch.Tensor, fmt: str, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fp32 value -> (stored tensor, stored scale or None, fp32 value a loader must reconstruct)."""
    if fmt == "fp8":
        block = cfg.quant.weight_block_size  # type: ignore[union-attr]
        q, exp = quant_fp8_exponents(w, block)
        mult = exp.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
        return q, exponent_to_ue8m0(exp), torch.ldexp(q.to(torch.float32), mult)
    if fmt == "fp4":
        codes, exp = quant_fp4_exponents(w)
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        magnitude = table[(codes & 7).long()]
        values = torch.where(codes >= 8, -magnitude, magnitude)
        mult = exp.repeat_interleave(FP4_GROUP, 1)[:, : w.shape[1]]
        return pack_fp4(codes), exponent_to_ue8m0(exp), torch.ldexp(values, mult)
    if fmt == "int64":
        return w, None, w
    stored = w.to(_STORE_DTYPE[fmt])
    return stored, None, stored.to(torch.float32)


def hf_name(native: str) -> str:
    """The spelling HF 5.23 ``save_pretrained`` writes (``model.`` prefix except on head.weight, ``attn.norm``
    for the KV norm, ``embed_tokens`` / ``hc_head.hc_*``) with HF's ``weight_scale_inv`` scale companions."""
    if native == "head.weight" or native.startswith("mtp."):  # HF never writes mtp.*; keep it native
        return native.removesuffix(".scale") + (".weight_scale_inv" if native.endswith(".scale") else "")
    name = {"embed.weight": "embed_tokens.weight"}.get(native, native)
    name = re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", name)
    name = re.sub(r"^(layers\.\d+)\.attn\.kv_norm\.weight$", r"\1.attn.norm.weight", name)
    name = re.sub(r"\.scale$", ".weight_scale_inv", name) if name.startswith("layers.") else name
    return "model." + name


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], shard_max_bytes: int | None) -> None:
    if shard_max_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        rel = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / rel), metadata={"format": "pt"})
        weight_map.update({name: rel for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_random_checkpoint(out_dir: str | Path, native_config: dict[str, Any], seed: int,
                            shard_max_bytes: int | None = None,
                            names: Literal["native", "hf"] = "native") -> dict[str, torch.Tensor]:
    """Write ``config.json`` + safetensors for ``native_config`` with random weights; return the fp32 values
    (int64 for tid2eid) a correct loader must produce, by native name."""
    if names not in ("native", "hf"):
        raise ValueError(f"names: expected 'native' or 'hf', got {names!r}")
    if shard_max_bytes is not None and shard_max_bytes <= 0:
        raise ValueError(f"shard_max_bytes: must be positive, got {shard_max_bytes}")
    cfg = ModelConfig.from_dict(native_config)
    with torch.device("meta"):
        meta = DeepseekV4(cfg, torch.float32)
    g = torch.Generator().manual_seed(seed)
    stored: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, t in meta.state_dict().items():
        fmt = storage_format(name, cfg)
        value, scale, expected[name] = _encode(_randomize(name, tuple(t.shape), cfg, g), fmt, cfg)
        rename = hf_name if names == "hf" else (lambda n: n)
        stored[rename(name)] = value.contiguous()
        if scale is not None:
            stored[rename(scale_name(name))] = scale.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(native_config, indent=2))
    _write_shards(out, stored, shard_max_bytes)
    return expected


def write_dummy_checkpoint(out_dir: str | Path, native_config: dict[str, Any], seed: int,
                           shard_max_bytes: int | None = None, device: str = "cpu") -> int:
    """Write ``config.json`` + safetensors holding ``load_format="dummy"``'s weights (``model/dummy.py``:
    native formats, generated on ``device``), one shard in memory at a time; fast enough for full-size
    shapes, unlike ``write_random_checkpoint``'s quantizer. Returns the bytes written."""
    from deepinfer.model.ckpt_plan import expected_tensors
    from deepinfer.model.dummy import dummy_tensor

    if shard_max_bytes is not None and shard_max_bytes <= 0:
        raise ValueError(f"shard_max_bytes: must be positive, got {shard_max_bytes}")
    cfg = ModelConfig.from_dict(native_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(native_config, indent=2))
    shards: list[list[str]] = [[]]
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        save_file(shard, str(out / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for name, (shape, _) in expected_tensors(cfg, torch.float32).items():
        data, scale = dummy_tensor(name, shape, cfg, seed, device)
        for key, t in ((name, data), (scale_name(name), scale)):
            if t is None:
                continue
            nbytes = t.numel() * t.element_size()
            if shard_max_bytes is not None and shard and size + nbytes > shard_max_bytes:
                flush()
                shards.append([])
                size = 0
            shard[key] = t.cpu().contiguous()
            shards[-1].append(key)
            size += nbytes
            total += nbytes
    flush()
    names = {i + 1: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))}
    for i, rel in names.items():
        (out / f"shard-{i:05d}.safetensors").rename(out / rel)
    if len(shards) == 1:
        (out / names[1]).rename(out / "model.safetensors")
    else:
        weight_map = {key: names[i + 1] for i, keys in enumerate(shards) for key in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m deepinfer.testing.make_checkpoint",
        description="Write a random DeepSeek-V4 checkpoint (config.json + safetensors) in the released "
                    "native format: FP8 e4m3 dense weights with UE8M0 128x128 block scales, FP4 e2m1 routed "
                    "experts with per-32 UE8M0 scales, BF16/F32/I64 for the rest.",
    )
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--shard-max-bytes", type=int, default=None,
                   help="split into shards of at most this many bytes, with model.safetensors.index.json")
    p.add_argument("--names", choices=("native", "hf"), default="native",
                   help="tensor names: DeepSeek-native (released files) or HF save_pretrained spelling")
    p.add_argument("--expert-dtype", choices=("fp4", "fp8", "bf16"), default=None,
                   help="override the preset's routed-expert format")
    p.add_argument("--dummy", action="store_true",
                   help="the values of --load-format dummy, generated fast (full-size shapes); native names")
    p.add_argument("--config", default=None, help="a config.json to write instead of a preset's")
    p.add_argument("--hf-overrides", default=None, help="JSON object of config.json fields to change")
    p.add_argument("--device", default="cpu", help="where --dummy generates the tensors (cpu, cuda)")
    args = p.parse_args(argv)
    config = json.loads(Path(args.config).read_text()) if args.config else copy.deepcopy(PRESETS[args.preset])
    config.update(json.loads(args.hf_overrides) if args.hf_overrides else {})
    if args.expert_dtype is not None:
        config["expert_dtype"] = args.expert_dtype
    if args.dummy:
        total = write_dummy_checkpoint(args.out, config, args.seed, args.shard_max_bytes, args.device)
        print(f"wrote {args.out}: {total / 1e9:.2f} GB of dummy weights in the native format")
        return
    weights = write_random_checkpoint(args.out, config, args.seed, args.shard_max_bytes, args.names)
    n = sum(t.numel() for t in weights.values())
    print(f"wrote {args.out}: preset {args.preset}, {len(weights)} tensors, {n / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
