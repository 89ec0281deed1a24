"""The memory plan of a deployment, per device, from ``config.json`` alone (``deepinfer info``).

Before anything is loaded it answers: how many bytes of weights each device holds in the formats the GPU
path keeps them in (FP8 e4m3 with fp32 block scales for the dense linears, packed FP4 with one scale byte
per 32 weights for the routed experts, bf16/fp32 for the rest), what the cache needs, an estimate of the
activation peak of the largest step, and whether it fits ``gpu_memory_utilization`` of the device; when
it does not, the smallest data-parallel + expert-parallel world that would.

Parallel layouts are the engine's (``distributed/config.py``, ``model/parallel/``): ``tensor_parallel_size``
splits attention heads (``wq_b``, ``wo_a``, the sinks, ``wo_b``'s input) and, without expert parallelism,
the routed and shared experts' intermediate dimension; the single shared K=V latent, the compressors, the
indexer, the embedding and the LM head are replicated. ``data_parallel_size`` replicates what TP does not
split and gives every DP group its own cache. ``enable_expert_parallel`` spreads whole routed experts over
all ``tp x dp`` devices and replicates the shared expert. ``context_parallel_size`` splits long prefill chunks
over groups of DP ranks: no weights and no cache of its own, a transient share of the chunk and the rows it
reads on every rank of the group (``cp_plan.py``), counted into the activations.

Slices are assumed to fall on whole FP8 scale blocks (they do on V4's shapes; a tiny model whose split does
not keeps that module dequantized and holds more). The activation figure is an estimate (the engine measures the real peak with a profiling step at start-up,
``engine/sizing.py``); the weight and cache figures are exact for the formats above.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from deepinfer.config.model import ModelConfig
from deepinfer.distributed.config import ParallelConfig
from deepinfer.engine.cp_plan import ContextParallelPlan, check_chunk_budget, plan_context_parallel
from deepinfer.kv.block_budget import blocks_for_budget
from deepinfer.kv.spec import HISTORY, CacheLayout, build_layout
from deepinfer.model.quant import FP4_GROUP, fp8_scale_shape, storage_format
from deepinfer.model.summary import Specs, parameter_specs

GIB = 1 << 30
H200_BYTES = 140 * GIB  # what an H200 reports (torch.cuda.mem_get_info total)
# CUDA context, NCCL buffers, CUDA-graph pools and allocator slack: held back on every device.
RESERVED_BYTES = 2 * GIB
_ROUTED = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.")
_SHARED = re.compile(r"\.ffn\.shared_experts\.")
_HEAD_SPLIT = re.compile(r"\.attn\.(wq_b\.weight|wo_a\.weight|attn_sink)$")
_HEAD_INPUT_SPLIT = re.compile(r"\.attn\.wo_b\.weight$")


@dataclass(frozen=True, slots=True)
class Deployment:
    """What the plan is for: the parallel layout and the engine limits that size the cache and activations."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    max_num_seqs: int = 64
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    block_size: int = 256
    gpu_memory_utilization: float = 0.9
    context_parallel_size: int = 1
    context_parallel_min_tokens: int = 1024
    # Every rank on one device (``LaunchConfig.ranks_share_device``): each rank plans 1/world of it.
    ranks_share_device: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs", "max_model_len",
                     "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        # The engine's own checks (context_parallel_size must divide data_parallel_size, ...), then the chunk
        # budget: a CP group that could never split a chunk is a layout that cannot work.
        check_chunk_budget(self.parallel, self.max_num_batched_tokens)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ranks_per_device(self) -> int:
        return self.world_size if self.ranks_share_device else 1

    @property
    def devices(self) -> int:
        return 1 if self.ranks_share_device else self.world_size

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.data_parallel_size, self.enable_expert_parallel,
                              self.context_parallel_size, self.context_parallel_min_tokens)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    deployment: Deployment
    device_bytes: int  # memory of one device
    # The figures below are one rank's: per device, or per rank when the ranks share one device.
    weight_bytes: int  # per device (the largest share when experts do not divide evenly)
    expert_bytes: int  # of weight_bytes: routed experts
    activation_bytes: int  # per device, estimated
    reserved_bytes: int
    cache_bytes: int  # per device: what is left for the cache pools (may be negative)
    cache_tokens: int  # history tokens one device's cache holds (0 when it cannot hold one sequence)
    fits: bool
    reason: str  # why it does not fit ("" when it fits)
    context_parallel: ContextParallelPlan | None = None  # None: no context parallelism (its bytes: activation_bytes)

    def as_dict(self) -> dict:
        d = self.deployment
        return {
            "tensor_parallel_size": d.tensor_parallel_size, "data_parallel_size": d.data_parallel_size,
            "enable_expert_parallel": d.enable_expert_parallel, "devices": d.devices,
            **({"ranks_share_device": True} if d.ranks_share_device else {}),
            "per_rank_gib" if d.ranks_share_device else "per_device_gib": {
                "device": round(self.device_bytes / GIB, 2),
                "usable": round(self.device_bytes * d.gpu_memory_utilization / d.ranks_per_device / GIB, 2),
                "weights": round(self.weight_bytes / GIB, 2),
                "of_which_routed_experts": round(self.expert_bytes / GIB, 2),
                "activations_estimate": round(self.activation_bytes / GIB, 2),
                "reserved": round(self.reserved_bytes / GIB, 2),
                "cache": round(max(self.cache_bytes, 0) / GIB, 2),
            },
            "cache_tokens_per_dp_rank": self.cache_tokens,
            **({"context_parallel": self.context_parallel.as_dict()} if self.context_parallel else {}),
            "fits": self.fits,
            **({"reason": self.reason} if self.reason else {}),
        }


# What to change when ranks sharing one device do not fit it (more ranks only divide it further).
SHARED_DEVICE_HINT = ("fewer layers (--hf-overrides '{\"num_hidden_layers\": N}' with --load-format dummy), a lower "
                      "--max-model-len or --max-num-batched-tokens, or fewer ranks")


def device_memory_bytes() -> int:
    """The visible CUDA device's memory, else an H200's (plans are usually made before reaching the GPUs)."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1]
    return H200_BYTES


def device_bytes_of(name: str, shape: tuple[int, ...], dtype: torch.dtype, cfg: ModelConfig) -> int:
    """Bytes of one parameter as the GPU path holds it (with its scales); ``dtype``: the model parameter's."""
    fmt = storage_format(name, cfg)
    if fmt == "fp8":
        # e4m3 codes + fp32 block scales (FP8Linear decodes UE8M0 once)
        return quantized_bytes("fp8", shape, cfg.quant.weight_block_size, fp8_scale_bytes=4)  # type: ignore[union-attr]
    if fmt == "fp4":
        return quantized_bytes("fp4", shape, (1, FP4_GROUP))
    return math.prod(shape) * dtype.itemsize


def quantized_bytes(fmt: str, shape: tuple[int, ...], block: tuple[int, int], fp8_scale_bytes: int = 1) -> int:
    """Bytes of one FP8 (one e4m3 byte per weight, one scale per ``block``) or packed FP4 weight (two e2m1
    codes a byte, one UE8M0 byte per row and 32 inputs) with its scales; ``fp8_scale_bytes``: 1 for the UE8M0
    bytes a checkpoint stores, 4 where the scales are decoded to fp32."""
    numel = math.prod(shape)
    if fmt == "fp8":
        rows, cols = fp8_scale_shape(shape, block)
        return numel + fp8_scale_bytes * rows * cols
    if fmt == "fp4":
        return numel // 2 + numel // FP4_GROUP
    raise ValueError(f"fmt: {fmt!r} is not a quantized format; allowed: fp8, fp4")


def _share(name: str, d: Deployment) -> float:
    """The fraction of parameter ``name`` one device holds (experts under EP: see ``weights_per_device``)."""
    tp = d.tensor_parallel_size
    if _ROUTED.match(name) or _SHARED.search(name):
        return 1.0 if d.enable_expert_parallel else 1.0 / tp
    if _HEAD_SPLIT.search(name) or _HEAD_INPUT_SPLIT.search(name):
        return 1.0 / tp
    return 1.0


def weights_per_device(cfg: ModelConfig, d: Deployment, specs: Specs | None = None
                       ) -> tuple[int, int]:
    """(weight bytes, routed-expert bytes) per device. The MTP layer counts (the engine keeps it), its experts
    spread like the others'. Raises ValueError naming the field when ``cfg`` cannot be split as ``d`` asks."""
    d.parallel.validate(cfg)
    specs = specs if specs is not None else parameter_specs(cfg)
    total = experts = 0.0
    for name, (shape, dtype) in specs.items():
        b = device_bytes_of(name, shape, dtype, cfg) * _share(name, d)
        total += b
        experts += b if _ROUTED.match(name) else 0.0
    if d.enable_expert_parallel:  # whole experts, E / world of them per device
        held = experts / d.world_size
        total += held - experts
        experts = held
    return int(total), int(experts)


def _per_token_bytes(cfg: ModelConfig, d: Deployment) -> int:
    """A layer's live bytes per token: mHC streams in and out, the query heads and attention output, the MoE's
    routed intermediates for the token's top-k experts."""
    h, tp = cfg.hidden_size, d.tensor_parallel_size
    streams = 3 * cfg.hc_mult * h * 2  # streams in, out and the mHC collapse (bf16)
    heads = 3 * (cfg.num_attention_heads // tp) * cfg.head_dim * 2  # q, attention output, grouped wo_a input
    moe = cfg.num_experts_per_tok * 3 * (cfg.moe_intermediate_size // (1 if d.enable_expert_parallel else tp)) * 2
    return streams + heads + moe + 4 * h * 2


def activation_bytes_estimate(cfg: ModelConfig, d: Deployment, cp: ContextParallelPlan | None = None) -> int:
    """A generous estimate of the transient peak of one step of ``max_num_batched_tokens`` tokens on one
    device: a layer's live tensors (``_per_token_bytes``) plus the logits of the sampled rows; with context
    parallelism (``cp``), a rank's share of a chunk beside its own tokens, what it receives for it, and the
    history replicas it keeps between a sequence's chunks."""
    t = d.max_num_batched_tokens
    logits = min(d.max_num_seqs, t) * cfg.vocab_size * 4 * 2  # fp32 logits and the sampler's working copy
    extra = 0
    if cp is not None:
        extra = (cp.share_tokens * _per_token_bytes(cfg, d) + cp.gathered_bytes + cp.catch_up_bytes + cp.streams_bytes
                 + (cp.context_parallel_size - 1) * cp.replica_bytes * 5 // 4)  # growing buffers: 5/4 at most
    return t * _per_token_bytes(cfg, d) + logits + extra


def plan(cfg: ModelConfig, d: Deployment, device_bytes: int, cache_dtype: torch.dtype = torch.bfloat16,
         specs: Specs | None = None) -> MemoryPlan:
    """``specs``: the model's ``parameter_specs`` when already known (building them is the slow part).
    Raises ValueError naming the field when the model cannot be split as ``d`` asks."""
    weights, experts = weights_per_device(cfg, d, specs)
    cp = plan_context_parallel(cfg, d.parallel, d.max_num_batched_tokens, d.max_model_len)
    acts = activation_bytes_estimate(cfg, d, cp)
    layout = build_layout(cfg, d.block_size, include_mtp=False)
    return fit(d, device_bytes, weights, experts, acts, layout, torch.empty(0, dtype=cache_dtype).element_size(),
               cp=cp)


def fit(d: Deployment, device_bytes: int, weights: int, experts: int, acts: int, layout: CacheLayout,
        cache_dtype_bytes: int, *, spec_slack: int = 0, cp: ContextParallelPlan | None = None) -> MemoryPlan:
    """The fit check of one device holding ``weights`` and ``acts`` bytes: what is left of
    ``gpu_memory_utilization`` after them and the reserve goes to the cache pools of ``layout``, split as the
    engine splits a budget (``blocks_for_budget``); it must hold one ``max_model_len`` sequence. Ranks sharing
    the device (``ranks_share_device``) each get 1/world of ``gpu_memory_utilization``, as the engine sizes
    them (``engine/sizing.py``), and each holds its own reserve (a CUDA context per process)."""
    n = d.ranks_per_device
    usable = int(device_bytes * d.gpu_memory_utilization / n)
    cache = usable - weights - acts - RESERVED_BYTES
    reason, tokens = "", 0
    if cache <= 0:
        whose = "device" if n == 1 else f"rank ({n} ranks share the device)"
        reason = (f"weights {weights / GIB:.1f} GiB + activations ~{acts / GIB:.1f} GiB + reserved "
                  f"{RESERVED_BYTES / GIB:.0f} GiB per {whose} exceed {usable / GIB:.1f} GiB usable "
                  f"({d.gpu_memory_utilization}{'' if n == 1 else f' / {n}'} of {device_bytes / GIB:.1f} GiB)")
    else:
        try:
            counts = blocks_for_budget(layout, cache, cache_dtype_bytes, d.max_num_seqs, d.max_model_len,
                                       spec_slack=spec_slack, max_num_batched_tokens=d.max_num_batched_tokens)
            tokens = counts[HISTORY] * d.block_size
        except ValueError as e:
            reason = f"the {cache / GIB:.2f} GiB left for the cache is too small: {e}"
            if cp is not None:
                reason += " (context parallelism does not pool the DP ranks' caches: a sequence stays on one)"
    return MemoryPlan(d, device_bytes, weights, experts, acts, RESERVED_BYTES, cache, tokens, not reason, reason, cp)


def smallest_fitting(cfg: ModelConfig, d: Deployment, device_bytes: int, limit: int = 64,
                     specs: Specs | None = None) -> Deployment | None:
    """The smallest data-parallel + expert-parallel world (same TP and CP) that fits, up to ``limit`` devices
    (world sizes that divide the experts; DP sizes that CP divides)."""
    import dataclasses

    specs = specs if specs is not None else parameter_specs(cfg)
    dp = d.context_parallel_size
    while d.tensor_parallel_size * dp <= limit:
        cand = dataclasses.replace(d, data_parallel_size=dp, enable_expert_parallel=dp * d.tensor_parallel_size > 1)
        if cfg.n_routed_experts % cand.world_size == 0 and plan(cfg, cand, device_bytes, specs=specs).fits:
            return cand
        dp *= 2
    return None


def describe(cfg: ModelConfig, d: Deployment, device_bytes: int,
             specs: Specs | None = None) -> dict:
    """The plan as ``deepinfer info`` prints it, with a suggestion when it does not fit."""
    specs = specs if specs is not None else parameter_specs(cfg)
    p = plan(cfg, d, device_bytes, specs=specs)
    out = p.as_dict()
    if not p.fits and d.ranks_share_device:
        out["suggestion"] = SHARED_DEVICE_HINT
    elif not p.fits:
        alt = smallest_fitting(cfg, d, device_bytes, specs=specs)
        out["suggestion"] = (
            f"--tensor-parallel-size {alt.tensor_parallel_size} --data-parallel-size {alt.data_parallel_size}"
            + (" --enable-expert-parallel" if alt.enable_expert_parallel else "")
            + (f" --context-parallel-size {alt.context_parallel_size}" if alt.context_parallel_size > 1 else "")
            + f" ({alt.world_size} devices)" if alt else "no layout up to 64 devices fits; lower max_num_batched_tokens")
    return out
