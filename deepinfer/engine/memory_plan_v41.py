"""The memory plan of a DeepSeek-V4.1 deployment (``deepinfer info``), from ``config.json`` alone.

The same questions as V4's plan (``memory_plan.py``), answered from V4.1's own parts:

  * weights: every tensor of a meta-device ``DeepseekV41`` (its real names, shapes and dtypes), the quantized
    ones in the checkpoint's formats (``model/v41/names.py``: FP8 e4m3 dense projections with one UE8M0 byte
    per 32x32 block, packed FP4 routed experts with one UE8M0 byte per row and 32 inputs, FP8 Engram tables
    with one UE8M0 byte per row and 32 columns), the others as the module holds them. The routed experts and
    the Engram tables are shown on their own lines; the DSpark drafter (``mtp.*``) is planned separately,
    since the engine builds it only with ``speculative_config`` method ``dspark``;
  * cache: the engine's V4.1 cache specs (``kv/spec_v41.py``) split a budget as the engine does
    (``blocks_for_budget``); bytes per token per pool are the layout's under the default ``kv_cache_dtype``
    ("auto"): window KV and DSpark context rows packed as FP8 (528 B for 512 channels), compressed entries as
    NVFP4 (288 B), index keys as MXFP4 (68 B), the compressor state in fp32;
  * activations: V4's estimate (V4.1 has the same streams, heads and MoE fields) plus the Engram lookup of the
    widest layer.

Parallel layouts: the engine runs V4.1 with data- and tensor-parallel attention and expert- or tensor-parallel
experts (``model/v41/parallel.py``, ``config/v41_engine.check_v41_parallel``): a device holds its share of each
tensor as ``shard_v41`` cuts it (``ranks_sharing``; the Engram tables, embedding, head, compressors and indexers
whole on every rank) and its DP group's cache. Context parallelism is not planned (the engine refuses it); the
plan says why. The DSpark drafter is not planned with several ranks (the engine refuses it there). The engine also
runs V4.1 on its CPU reference path only, which dequantizes the weights as it reads them:
``weights_dequantized_gib`` is what that path holds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from deepinfer.config.v41 import V41Config
from deepinfer.config.v41_engine import check_v41_parallel
from deepinfer.engine.memory_plan import (GIB, Deployment, MemoryPlan, activation_bytes_estimate, fit,
                                          quantized_bytes)
from deepinfer.engine.sizing import speculative_slack
from deepinfer.kv.spec import POOLS, STATE, WINDOW, CacheLayout
from deepinfer.kv.spec_v41 import build_v41_layout
from deepinfer.model.summary import Specs
from deepinfer.model.v41.names import storage_format

_ROUTED = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.")
_ENGRAM_TABLE = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")
_DRAFTER = "mtp."
# The activation dtype of the plan: what a bf16 model holds its floats in (and unpacked cache rows).
PLAN_DTYPE = torch.bfloat16
_LARGEST_DEVICE_GIB = 1 << 16  # where the search for the smallest device that fits gives up


def v41_parameter_specs(cfg: V41Config, dtype: torch.dtype = PLAN_DTYPE) -> Specs:
    """Every state-dict tensor's (shape, dtype) of a meta-device ``DeepseekV41`` of activation dtype ``dtype``,
    the DSpark drafter's (``mtp.*``) included when the config has stages."""
    from deepinfer.model.v41.model import DeepseekV41

    with torch.device("meta"):
        model = DeepseekV41(cfg, dtype, shapes_only=True, dspark=cfg.num_nextn_predict_layers > 0)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def tensor_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype, cfg: V41Config) -> int:
    """Bytes of one tensor as the checkpoint stores it (with its UE8M0 scale bytes) when quantized, else as the
    module holds it (``dtype``)."""
    fmt, block = storage_format(name, cfg)
    if fmt == "float":
        return math.prod(shape) * dtype.itemsize
    return quantized_bytes(fmt, shape, block)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class V41Weights:
    """Weight bytes of the target model or of the DSpark drafter (one device holds all of them)."""

    total: int  # in the checkpoint's formats (``tensor_bytes``)
    routed_experts: int  # of total
    engram_tables: int  # of total
    dequantized: int  # what the CPU reference path holds: every tensor in its module dtype

    @classmethod
    def of(cls, cfg: V41Config, specs: Specs, drafter: bool, d: Deployment | None = None) -> "V41Weights":
        """``d``: one device's share in that layout (``ranks_sharing``); None: the whole model."""
        total = experts = engram = plain = 0
        for name, (shape, dtype) in specs.items():
            if name.startswith(_DRAFTER) != drafter:
                continue
            split = ranks_sharing(name, d) if d is not None else 1
            b = tensor_bytes(name, shape, dtype, cfg) // split
            total += b
            experts += b if _ROUTED.match(name) else 0
            engram += b if _ENGRAM_TABLE.match(name) else 0
            plain += math.prod(shape) * dtype.itemsize // split
        return cls(total, experts, engram, plain)


_TP_ATTENTION = re.compile(r"^layers\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")
_SHARED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.shared_experts\.")
_BACKBONE_ROUTED = re.compile(r"^layers\.\d+\.ffn\.experts\.")


def ranks_sharing(name: str, d: Deployment) -> int:
    """Over how many ranks ``model/v41/parallel.shard_v41`` splits tensor ``name`` (1: every rank holds it): the
    backbone's routed experts over the world with expert parallelism, else by TP; the heads' tensors by TP; the
    shared expert by TP without expert parallelism. The DSpark drafter stays whole (refused on several ranks)."""
    tp = d.tensor_parallel_size
    if _BACKBONE_ROUTED.match(name):
        return d.world_size if d.enable_expert_parallel else tp
    if _TP_ATTENTION.match(name) or (_SHARED_EXPERT.match(name) and not d.enable_expert_parallel):
        return tp
    return 1


def engram_activation_bytes(cfg: V41Config, d: Deployment) -> int:
    """The Engram lookup of one step on an Engram layer: the dequantized table rows of every (order, head) and
    the ``wkv`` output (a key per stream and the shared value), per token."""
    if not cfg.active_engram_layers:
        return 0
    per_token = cfg.engram_hash_heads * cfg.engram_head_dim + (cfg.hc_mult + 1) * cfg.hidden_size
    return d.max_num_batched_tokens * per_token * PLAN_DTYPE.itemsize


def cache_layout(cfg: V41Config, d: Deployment, dspark: bool) -> CacheLayout:
    """The engine's layout under ``kv_cache_dtype="auto"``: the rounded rows packed."""
    return build_v41_layout(cfg, d.block_size, dspark=dspark, packed=True)


def bytes_per_token(layout: CacheLayout) -> dict[str, float]:
    """Cache bytes one position takes in each pool (the window and state pools keep only their tails)."""
    return {p: layout.bytes_per_block(p, PLAN_DTYPE.itemsize) / layout.block_size for p in POOLS}


def unsupported(d: Deployment) -> str:
    """Why the engine cannot run V4.1 as ``d`` asks ("" when it can)."""
    if d.ranks_share_device and d.world_size > 1:  # check_v41_ranks: several ranks run on the CPU only
        return ("ranks_share_device: DeepSeek-V4.1 on several ranks runs on the CPU so far (its device experts are "
                "not split over ranks); allowed: one rank")
    try:
        check_v41_parallel(tensor_parallel_size=d.tensor_parallel_size, data_parallel_size=d.data_parallel_size,
                           context_parallel_size=d.context_parallel_size)
    except ValueError as e:
        return str(e)
    return ""


def plan_v41(cfg: V41Config, d: Deployment, device_bytes: int, specs: Specs, *, dspark: bool = False
             ) -> MemoryPlan:
    """One device's plan; ``dspark``: with the drafter's weights, its context rows in the window pool and the
    rollback slack of a full block of drafts. Raises ValueError naming the field when the engine cannot run
    ``d`` for V4.1."""
    drafter = V41Weights.of(cfg, specs, drafter=True) if dspark else None
    return _plan(cfg, d, device_bytes, V41Weights.of(cfg, specs, drafter=False, d=d), drafter)


def _plan(cfg: V41Config, d: Deployment, device_bytes: int, target: V41Weights, drafter: V41Weights | None
          ) -> MemoryPlan:
    why = unsupported(d)
    if why:
        raise ValueError(why)
    weights, experts = target.total, target.routed_experts
    if drafter is not None:
        weights, experts = weights + drafter.total, experts + drafter.routed_experts
    acts = activation_bytes_estimate(cfg, d) + engram_activation_bytes(cfg, d)  # type: ignore[arg-type]
    slack = speculative_slack(cfg.dspark.block_size if drafter is not None else 0)[1]
    return fit(d, device_bytes, weights, experts, acts, cache_layout(cfg, d, drafter is not None),
               PLAN_DTYPE.itemsize, spec_slack=slack)


def smallest_device_gib(cfg: V41Config, d: Deployment, specs: Specs, dspark: bool = False) -> int | None:
    """The fewest whole GiB one device needs for ``d`` (None: more than ``_LARGEST_DEVICE_GIB``); the plan is
    monotone in the device's memory, so a bisection finds it."""
    target = V41Weights.of(cfg, specs, drafter=False, d=d)
    drafter = V41Weights.of(cfg, specs, drafter=True) if dspark else None

    def fits(gib: int) -> bool:
        return _plan(cfg, d, gib * GIB, target, drafter).fits

    lo, hi = 0, _LARGEST_DEVICE_GIB
    if not fits(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _gib(n: float) -> float:
    return round(n / GIB, 2)


def _plan_dict(p: MemoryPlan, w: V41Weights) -> dict:
    out = p.as_dict()
    gib = out["per_device_gib"]
    at = list(gib).index("of_which_routed_experts") + 1  # shown beside the experts
    out["per_device_gib"] = dict([*list(gib.items())[:at], ("of_which_engram_tables", _gib(w.engram_tables)),
                                  *list(gib.items())[at:]])
    return out


def _not_fitting(cfg: V41Config, d: Deployment, specs: Specs, dspark: bool) -> str:
    need = smallest_device_gib(cfg, d, specs, dspark)
    where = (f"a device of at least {need} GiB (--device-memory-gib {need})" if need is not None
             else f"no device of up to {_LARGEST_DEVICE_GIB} GiB")
    layout = f"{d.world_size} devices as laid out" if d.world_size > 1 else "one device"
    return (f"DeepSeek-V4.1 does not fit {layout} (every rank holds its Engram tables, embedding and head whole): "
            f"{where} would hold it at --gpu-memory-utilization {d.gpu_memory_utilization}")


def _dspark_dict(cfg: V41Config, d: Deployment, device_bytes: int, specs: Specs) -> dict:
    try:
        cfg.check_dspark()
    except ValueError as e:
        return {"available": False, "reason": str(e)}
    if d.world_size > 1:
        return {"available": False, "reason": "speculative_config: DSpark speculative decoding of DeepSeek-V4.1 on "
                "several ranks is not written yet; allowed with several ranks: None"}
    drafter = V41Weights.of(cfg, specs, drafter=True)
    without = bytes_per_token(cache_layout(cfg, d, dspark=False))
    extra = {p: b - without[p] for p, b in bytes_per_token(cache_layout(cfg, d, dspark=True)).items()}
    p = plan_v41(cfg, d, device_bytes, specs, dspark=True)
    out = {
        "stages": cfg.num_nextn_predict_layers,
        "weights_gib": _gib(drafter.total),
        "of_which_routed_experts_gib": _gib(drafter.routed_experts),
        "weights_dequantized_gib": _gib(drafter.dequantized),
        "cache_bytes_per_token": {k: v for k, v in extra.items() if v},  # context rows: window pool only
        "with_drafter": {"weights_gib": _gib(p.weight_bytes), "cache_gib": _gib(max(p.cache_bytes, 0)),
                         "cache_tokens_per_dp_rank": p.cache_tokens, "fits": p.fits,
                         **({"reason": p.reason} if p.reason else {})},
    }
    if not p.fits:
        out["with_drafter"]["suggestion"] = _not_fitting(cfg, d, specs, dspark=True)
    return out


def describe_v41(cfg: V41Config, d: Deployment, device_bytes: int, specs: Specs | None = None) -> dict:
    """The plan as ``deepinfer info`` prints it: the target model's, the drafter's rows, and a suggestion when it
    does not fit. A layout the engine does not run for V4.1 is not planned: ``supported`` false, the reason,
    and the one-device plan as the suggestion."""
    specs = specs if specs is not None else v41_parameter_specs(cfg)
    why = unsupported(d)
    if why:
        one = dataclasses.replace(d, tensor_parallel_size=1, data_parallel_size=1, context_parallel_size=1,
                                  enable_expert_parallel=False)
        single = plan_v41(cfg, one, device_bytes, specs)
        return {"tensor_parallel_size": d.tensor_parallel_size, "data_parallel_size": d.data_parallel_size,
                "enable_expert_parallel": d.enable_expert_parallel, "devices": d.world_size,
                "supported": False, "fits": False, "reason": why,
                "suggestion": ("--tensor-parallel-size 1 --data-parallel-size 1 (1 device)" if single.fits
                               else _not_fitting(cfg, one, specs, dspark=False))}
    w = V41Weights.of(cfg, specs, drafter=False, d=d)
    p = plan_v41(cfg, d, device_bytes, specs)
    layout = cache_layout(cfg, d, dspark=False)
    out = _plan_dict(p, w)
    out["supported"] = True
    out["weights_format"] = ("as the checkpoint stores them: FP8 e4m3 dense projections and Engram tables, FP4 "
                             "routed experts, one UE8M0 byte per scale; the rest in its module dtype")
    out["weights_dequantized_gib"] = _gib(w.dequantized)
    out["cache_bytes_per_token"] = bytes_per_token(layout)
    out["cache_format"] = ("kv_cache_dtype auto: window KV and DSpark context FP8 e4m3 + UE8M0 per 32, compressed KV "
                           "NVFP4, index keys MXFP4 (packed), compressor state fp32")
    out["cache_positions_kept_per_sequence"] = {WINDOW: layout.tail(WINDOW) + 1, STATE: layout.tail(STATE) + 1}
    if cfg.num_nextn_predict_layers > 0:
        out["dspark"] = _dspark_dict(cfg, d, device_bytes, specs)
    out["note"] = ("per device as one device holding the checkpoint's formats needs it (device cuda: the device "
                   "build keeps them); the CPU reference path dequantizes the weights as it reads them: "
                   "weights_dequantized_gib at dtype bfloat16")
    if d.world_size > 1:
        out["note"] += ("; several ranks run on device cpu only so far (V4.1's device experts are not split over "
                        "ranks)")
    if not p.fits:
        out["suggestion"] = _not_fitting(cfg, d, specs, dspark=False)
    return out
