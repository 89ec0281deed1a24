"""DeepSeek-V4.1 built quantized-first on a device (the engine's ``device="cuda"``), from a checkpoint or dummy.

What each weight becomes:
  * routed experts: V4.1 stores them as V4 does (packed FP4 e2m1, low nibble the even column, one UE8M0 scale
    per output row and 32 inputs: spec §7), so each MoE's experts (the DSpark stages' too) become one stacked
    ``FusedFP4Experts`` (``model/device.py``, run by ``ops.moe_experts_fp4``), filled expert by expert from the
    stored codes: no dequantized copy of them is ever made, which is what lets V4.1-Flash's 384 experts of a
    layer (~6.8 GB of FP4) be built at all. Their routed sum comes back in the activation dtype and the shared
    expert is added to it in fp32 with one more cast (``MoE.forward``): in float32 the reference's sum up to
    its order; in bfloat16 one rounding more than the reference's single cast.
  * dense FP8 linears (32x32-block UE8M0 scales, not V4's 128x128): kept as stored, ``FP8Dense32``
    (``fp8_dense.py``, the op table's ``fp8_linear_b32``): half the bytes of a bf16 copy, which decode reads.
    With float16 activations (no kernel for them) they are dequantized to plain ``Linear`` weights instead.
  * Engram tables (FP8 e4m3, one UE8M0 scale per row and 32 columns): kept as stored, ``FP8Table``
    (``engram_table.py``: the codes and the scale bytes), each token's rows gathered and dequantized by
    ``ops.v41_engram_gather``, the same values as the plain model's dequantized table rows bit for bit. V4.1-Flash's
    two tables are ~98 GB each as codes, twice that as bf16. With float16 activations they are dequantized as the
    plain loader does, as the dense FP8 linears are.
  * embedding, head, norms, mHC and the rest: what the plain loader holds (``loader.py``).
The op table runs the norms, RoPE, the mHC coefficients, collapse and expansion, the key-list attention core,
the FP8 window rows, the ratio-2 compressors' pooling, the indexer's scoring and choice, the router, the experts'
activation and Engram's n-gram hash (``ops.rms_norm``, ``v41_rope``, ``v41_mix_finish``, ``v41_collapse`` /
``v41_expand``, ``v41_attend_lists``, ``v41_store_packed`` / ``v41_load_packed``, ``v41_compress_pool``,
``v41_index_select``, ``moe_route``, ``v41_swiglu``, ``v41_engram_hash``): one launch each on CUDA (the indexer's
choice: a scoring kernel, a top-k and a rows kernel). The router's gate weight is held in fp32 (the GEMM runs in
fp32 either way; no per-step upcast of it), a ratio-1 compressor's projection in the activation dtype (it projects
in that dtype: the same cast once, not every step).
FP8 routed experts (``expert_dtype="fp8"``) stay the plain per-expert loop, dequantized. Of the plain model's
modules only the compressors' projections (fp32 but ratio 1's), the indexer's own, the router and the head hold
dequantized or unquantized values.

Every tensor is created on the device (built on ``meta``, then ``to_empty``), each value generated or read
there one tensor at a time. Dummy weights are drawn on the device (``dummy.dummy_v41_tensor``): the same
seed gives other values than the CPU's generator, the same on every run of one device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from deepinfer.config.v41 import V41Config
from deepinfer.model.ckpt_files import CheckpointError, Files
from deepinfer.model.ckpt_plan import _finite
from deepinfer.model.device import FusedFP4Experts, _parent
from deepinfer.model.linear import Linear
from deepinfer.model.quant import scale_to_float
from deepinfer.model.v41.engram import Engram, EngramHasher, compressed_token_map
from deepinfer.model.v41.engram_table import FP8Table
from deepinfer.model.norm import RMSNorm
from deepinfer.model.v41.attention import Attention, Compressor, Indexer
from deepinfer.model.v41.fp8_dense import BLOCK, FP8Dense32
from deepinfer.model.v41.dspark import DSparkStage
from deepinfer.model.v41.model import Block, DeepseekV41
from deepinfer.model.v41.moe import Expert, MoE
from deepinfer.model.v41.names import ENGRAM_TABLE_BLOCK, scale_name, storage_format
from deepinfer.ops.table import OpTable

Value = Callable[[str, tuple[int, ...]], torch.Tensor]  # native name, shape -> its value (any float dtype)
# A quantized weight's native name and shape -> its stored (codes, scales).
Codes = Callable[[str, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]


def fused_experts(cfg: V41Config) -> bool:
    """Whether the routed experts run as ``FusedFP4Experts`` (FP4-stored experts)."""
    return cfg.quant is not None and cfg.quant.expert_dtype == "fp4"


def fp8_dense_names(model: DeepseekV41, dtype: torch.dtype) -> list[str]:
    """The ``Linear`` modules stored as FP8 with 32x32-block scales, which run as ``FP8Dense32`` (its kernel
    takes bf16 / fp32 activations)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return []
    return [name for name, m in model.named_modules() if isinstance(m, Linear) and
            storage_format(f"{name}.weight", model.cfg) == ("fp8", (BLOCK, BLOCK))]


def fp8_table_names(model: DeepseekV41, dtype: torch.dtype) -> list[str]:
    """The Engram tables (their ``embed`` modules) stored as FP8, which are held as ``FP8Table``: the same dtype
    rule as ``fp8_dense_names`` (float16 activations keep the plain model's dequantized tables)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return []
    return [f"{name}.embed" for name, m in model.named_modules() if isinstance(m, Engram) and
            storage_format(f"{name}.embed.weight", model.cfg) == ("fp8", ENGRAM_TABLE_BLOCK)]


def build_v41_on_device(cfg: V41Config, dtype: torch.dtype, device: torch.device | str, ops: OpTable, value: Value,
                        codes: Codes, *, raw_scales: bool = True, tokenizer=None, cache_qdq: bool = True,
                        dspark: bool = False) -> DeepseekV41:
    """A ``DeepseekV41`` on ``device`` whose FP4 experts are ``FusedFP4Experts`` in ``ops``' layout, whose
    32x32-block FP8 linears are ``FP8Dense32`` and whose FP8 Engram tables are ``FP8Table``, all filled from
    ``codes``, every other tensor from ``value``.
    ``raw_scales``: the experts' scales are UE8M0 bytes (else fp32 multipliers, as a checkpoint may store them)."""
    if cfg.active_engram_layers and tokenizer is None:
        raise ValueError("tokenizer: the Engram layers hash normalised token ids; pass the checkpoint's tokenizer")
    with torch.device("meta"):
        model = DeepseekV41(cfg, dtype, cache_qdq=cache_qdq, shapes_only=True, dspark=dspark)
    experts: list[tuple[str, int, FusedFP4Experts]] = []
    if fused_experts(cfg):
        for name, moe in model.named_modules():
            if isinstance(moe, MoE):
                n = len(moe.experts)
                moe.routed = FusedFP4Experts.empty(n, cfg.hidden_size, cfg.moe_intermediate_size, raw_scales,
                                                   cfg.swiglu_limit, ops, "meta")
                moe.experts = nn.ModuleList()  # their weights live in ``routed`` only
                experts.append((name, n, moe.routed))
    dense = fp8_dense_names(model, dtype)
    for name in dense:
        parent, leaf = _parent(model, name)
        old = getattr(parent, leaf)
        setattr(parent, leaf, FP8Dense32(old.weight.shape[0], old.weight.shape[1], ops))
    tables = fp8_table_names(model, dtype)
    for name in tables:
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, FP8Table(*getattr(parent, leaf).weight.shape, ops))
    model = model.to_empty(device=device)
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if ".routed." not in name and not name.endswith((".weight_fp8", ".weight_scale")):
                t.copy_(value(name, tuple(t.shape)).to(device=t.device, dtype=t.dtype))
        for name in dense + tables:
            module = model.get_submodule(name)
            module.load(*codes(f"{name}.weight", tuple(module.weight_fp8.shape)))
        for prefix, n, routed in experts:
            for e in range(n):
                for w in ("w1", "w3", "w2"):
                    routed.load(e, w, *codes(f"{prefix}.experts.{e}.{w}.weight",
                                             (h, inter) if w == "w2" else (inter, h)))
            routed.lay_out_arrived()  # ``load`` lays experts out in batches; the last batch is laid out here
            if routed.pending():
                raise ValueError(f"{prefix}: experts {routed.pending()} got only one of w1 / w3")
    for module in model.modules():
        # Their op-table entries (module docstring): one kernel each on CUDA.
        if isinstance(module, (Block, DSparkStage, Attention, Indexer, RMSNorm, MoE, Expert)):
            module.ops = ops
        if isinstance(module, MoE):  # its router GEMM runs in fp32: the weight held so, not upcast every step
            module.gate.weight.data = module.gate.weight.data.float()
        if isinstance(module, Compressor) and module.ratio == 1:  # projects in the activation dtype (same cast)
            module.wkv.weight.data = module.wkv.weight.data.to(dtype)
    if cfg.active_engram_layers:
        model.hasher = EngramHasher(cfg, *compressed_token_map(tokenizer)).to(device)
        model.hasher.ops = ops
    return model.eval()


def dummy_v41_on_device(cfg: V41Config, dtype: torch.dtype, device: torch.device | str, ops: OpTable, *,
                        tokenizer=None, cache_qdq: bool = True, dspark: bool = False, seed: int = 0) -> DeepseekV41:
    """``load_format="dummy"`` on ``device``: every value drawn there (``dummy.dummy_v41_tensor``)."""
    from deepinfer.model.v41.dummy import dummy_v41_tensor
    from deepinfer.model.v41.loader import dequantize

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        fmt, data, scale = dummy_v41_tensor(name, shape, cfg, seed, device)
        return data if scale is None else dequantize(fmt, data, scale, storage_format(name, cfg)[1])

    def codes(name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        _, data, scale = dummy_v41_tensor(name, shape, cfg, seed, device)
        return data, scale

    return build_v41_on_device(cfg, dtype, device, ops, value, codes, tokenizer=tokenizer, cache_qdq=cache_qdq,
                               dspark=dspark)


def load_v41_on_device(model_dir: str | Path, cfg: V41Config, dtype: torch.dtype, device: torch.device | str,
                       ops: OpTable, *, tokenizer=None, cache_qdq: bool = True, dspark: bool = False
                       ) -> DeepseekV41:
    """A checkpoint directory on ``device``, checked as ``loader.load_v41_model`` checks it (headers first,
    then every tensor's data, the experts' codes with their scales)."""
    from deepinfer.model.v41.loader import _read, plan_v41_checkpoint

    model_dir = Path(model_dir)
    with torch.device("meta"):
        meta = DeepseekV41(cfg, dtype, shapes_only=True, dspark=dspark)
    files = Files(model_dir)
    plans, _ = plan_v41_checkpoint(model_dir, files, meta)
    expert_scales = {p.scale.dtype for p in plans.values() if p.fmt == "fp4"}
    if len(expert_scales) > 1:
        raise CheckpointError(f"{model_dir}: the routed experts' scales mix dtypes {sorted(map(str, expert_scales))}")

    def codes(name: str, _shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        plan = plans[name]
        data, scale = files.read(plan.src), files.read(plan.scale)
        try:
            finite = _finite(plan.fmt, data, scale_to_float(scale), plan.block)
        except ValueError as e:
            raise CheckpointError(f"{plan.scale.where(scale_name(name))}: {e}") from e
        if not finite:
            raise CheckpointError(f"{plan.src.where(name)}: contains NaN or infinite values")
        return data, scale

    raw = not expert_scales or expert_scales.pop() != torch.float32
    model = build_v41_on_device(cfg, dtype, device, ops, lambda name, _: _read(plans[name], files), codes,
                                raw_scales=raw, tokenizer=tokenizer, cache_qdq=cache_qdq, dspark=dspark)
    files.release()
    return model
