"""Engine configuration: the frozen tree every component takes its own branch of.

``EngineArgs`` is what users pass (``LLM(model=..., **engine_args)``, CLI flags); ``EngineConfig.create``
validates it against the model and the machine and freezes the result. Facts discovered at start-up
(the number of cache blocks after sizing) live in ``RuntimeFacts``, separately.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.config.eplb import EplbConfig
from deepinfer.config.model import ModelConfig
from deepinfer.distributed.config import LaunchConfig, ParallelConfig
from deepinfer.config.speculative import SpeculativeConfig
from deepinfer.config.v41 import V41Config, is_v41_config

LOAD_FORMATS = ("auto", "dummy")  # how the weights are obtained (EngineArgs.load_format)
# EngineArgs.kv_cache_dtype (vLLM's name). "auto": the model's released cache formats -- for DeepSeek-V4.1
# the window KV rounded to FP8, indexer queries and keys to MXFP4 and compressed KV to NVFP4 as its reference
# does; for DeepSeek-V4 what deepinfer has always done, rows kept in the activation dtype, unrounded (V4's own
# FP8 cache rounding is not implemented). "bfloat16" / "float32": no cache quantization, rows in that dtype,
# which must be the activation dtype (``dtype``). V4.1's rounded rows are stored packed in those formats
# (``kv/spec_v41.py``: 528 B per 512-channel window row instead of 1024 B in bf16, 288 B per NVFP4 entry, 68 B
# per MXFP4 index key) and dequantized as they are read, the same values as the rounding bit for bit.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """User-facing engine arguments (vLLM-style names)."""

    model: str | None = None  # None -> the bundled demo model
    tokenizer: str | None = None  # default: the model directory
    dtype: str = "auto"  # auto -> float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None -> DEEPINFER_ACCELERATOR (default cuda if available else cpu)
    block_size: int = 256
    num_cache_blocks: int | None = None  # explicit history-pool block count (overrides the memory budget)
    cache_memory_gb: float | None = None  # memory budget for all cache pools
    gpu_memory_utilization: float = 0.9  # fraction of device memory (CUDA) when no explicit budget is set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(model's max positions, 8192)
    seed: int = 0
    load_progress: bool = True
    enforce_eager: bool = False  # CUDA: no decode graphs (every step launches its kernels from Python)
    # Plan and submit step N+1 before reading step N's tokens (the same tokens). None: on where it pays and
    # is supported (``auto_async_scheduling``), else False / True as asked.
    async_scheduling: bool | None = None
    # Compile the kernels' variants at start-up (engine/warm_up.py) rather than during the first requests.
    # None: on CUDA (the CPU runs no compiled kernels).
    warm_up: bool | None = None
    # Prefix caching (kv/manager.py, kv/prefix_hits.py): hits at every block boundary whose window/state tails are retained.
    enable_prefix_caching: bool = True
    # The cache tiers below the device pools (sizes in GiB, like cache_memory_gb; kv/offload.py): evicted
    # prefix-cache blocks go to host memory, then to the disk directory, and come back on a hit. With several
    # ranks each rank keeps its own tiers (executor/rank_tiers.py): its disk tier is kv_cache_dir/rank<r> and
    # both sizes are per node, split evenly among the node's ranks.
    kv_cache_dir: str | None = None  # local directory of the disk tier (kept across restarts)
    kv_host_cache_gb: float = 0.0  # host-memory tier (device copies staged in pinned buffers); 0 = none
    kv_disk_cache_gb: float | None = None  # size limit of kv_cache_dir; required with it
    # Parallelism (vLLM's names; deepinfer/distributed/config.py): world size = DP x TP worker processes.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # Context parallelism over the DP ranks (distributed/config.py): prefill chunks of at least
    # context_parallel_min_tokens tokens are split over context_parallel_size DP ranks.
    context_parallel_size: int = 1
    context_parallel_min_tokens: int = 1024
    # Several nodes without torchrun (torchrun's names; distributed/config.py LaunchConfig): the same command
    # on every node, each with its node_rank; node 0 at master_addr:master_port is the rendezvous and serves.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # Every rank of a one-node world on the one CUDA device, collectives over gloo through host memory
    # (distributed/config.py LaunchConfig): rehearses the multi-GPU path on a single GPU; not a fast mode.
    ranks_share_device: bool = False
    # Expert-parallel load balancing (config/eplb.py): redundant replicas of hot experts, re-placed every
    # step_interval steps. eplb_config: {"num_redundant_experts": N, "window_size": W, "step_interval": S,
    # "log_balancedness": bool} (or its JSON text); needs enable_expert_parallel.
    enable_eplb: bool = False
    eplb_config: dict | str | None = None
    # "auto": the model directory's safetensors; "dummy": random weights in the native formats from
    # config.json alone, generated on the device (benchmarks of full shapes without the download).
    load_format: str = "auto"
    hf_overrides: dict[str, Any] | None = None  # config.json fields to change, e.g. {"num_hidden_layers": 4}
    # Speculative decoding with the checkpoint's drafter: {"method": "mtp", "num_speculative_tokens": k} (V4),
    # {"method": "dspark", ...} (V4.1), or its JSON text; None: off.
    speculative_config: dict | str | None = None
    kv_cache_dtype: str = "auto"  # cache numerics, vLLM's name; KV_CACHE_DTYPES says what each value means
    # DeepSeek-V4.1 only: decoder-side bounded replay of long prefill chunks, "off" / "v41" / "exact"
    # (config/v41_engine.py DECODER_REPLAY_MODES). Named for the model it applies to, in vLLM's snake_case
    # style; the values name the behaviour (the released model's, or the exact halo) rather than a boolean.
    v41_decoder_replay: str = "off"
    # DeepSeek-V4.1 only: how a prefix-cache hit is taken, "exact" (the boundary's window tails kept: hit == no
    # hit) / "v41" (the released encoder-side replay of the window behind the boundary, spec §3.2; needed for
    # prefix caching with v41_decoder_replay on). config/v41_engine.py PREFIX_REPLAY_MODES.
    v41_prefix_replay: str = "exact"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown engine argument; allowed: {', '.join(cls.field_names())}")
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """Cache tiers below the device pools; all zero / None when there are none."""

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    num_cache_blocks: int | None
    cache_memory_gb: float | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool = True
    tiers: KVTierConfig = KVTierConfig()
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES (checked against the activation dtype)

    @property
    def released_formats(self) -> bool:
        """Whether the model's released cache formats are asked for (``auto``). V4.1 then rounds its cache rows;
        V4's path implements none of its formats, so for V4 this changes nothing."""
        return self.kv_cache_dtype == "auto"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    tokenizer_dir: str
    model: ModelConfig | V41Config  # V41Config: a DeepSeek-V4.1 checkpoint (model/v41/paged.py runs it)
    dtype: torch.dtype
    device: str
    scheduler: SchedulerConfig
    cache: CacheConfig
    seed: int
    load_progress: bool = True
    enforce_eager: bool = False
    async_scheduling: bool = False
    warm_up: bool = False  # EngineArgs.warm_up, resolved for the device
    parallel: ParallelConfig = ParallelConfig()
    load_format: str = "auto"
    speculative: SpeculativeConfig | None = None
    eplb: EplbConfig | None = None  # None: experts stay where expert parallelism put them
    launch: LaunchConfig = LaunchConfig()  # which of the world's ranks this node starts
    # DEEPINFER_BATCH_INVARIANT: the batch-invariant op table (ops/table.py; README "Batch invariance").
    batch_invariant: bool = False
    v41_decoder_replay: str = "off"  # EngineArgs.v41_decoder_replay (checked against the model)
    v41_prefix_replay: str = "exact"  # EngineArgs.v41_prefix_replay (checked against the model)
    extra: dict = field(default_factory=dict)

    @classmethod
    def create(cls, args: EngineArgs) -> "EngineConfig":
        from deepinfer import env
        from deepinfer.assets import demo_model_dir

        model_dir = args.model or str(demo_model_dir())
        if args.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: {args.load_format!r} is not supported; allowed: {', '.join(LOAD_FORMATS)}")
        if args.hf_overrides is not None and not isinstance(args.hf_overrides, dict):
            raise ValueError(f"hf_overrides: expected a dict of config.json fields, got {args.hf_overrides!r}")
        device = args.device or env.accelerator()
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: {device!r} is not supported; allowed: cpu, cuda")
        model = _model_config(model_dir, args, device)
        dtype = _resolve_dtype(args.dtype, device)
        kv_cache_dtype = _kv_cache_dtype(args.kv_cache_dtype, dtype)
        max_len = args.max_model_len or min(model.max_position_embeddings, 8192)
        _check_positive(args)
        if max_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {max_len} exceeds the model's max_position_embeddings {model.max_position_embeddings}"
            )
        speculative = SpeculativeConfig.parse(args.speculative_config, env.enable_mtp_varlen())
        if speculative is not None:
            _check_speculative(speculative, model, args)
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {args.gpu_memory_utilization}")
        parallel = ParallelConfig(args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel,
                                  args.context_parallel_size, args.context_parallel_min_tokens).validate(model)
        launch = LaunchConfig(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                              args.ranks_share_device).validate(parallel)
        _check_parallel(parallel, launch, args, device)
        if speculative is not None and args.async_scheduling:
            _check_async_speculative(parallel)
        from deepinfer.engine.cp_plan import check_chunk_budget

        check_chunk_budget(parallel, args.max_num_batched_tokens)  # a CP group that could never split a chunk
        eplb = _eplb_config(args, parallel, model)
        batch_invariant = env.batch_invariant()
        if batch_invariant:
            _check_batch_invariant(parallel)
        decoder_replay = _decoder_replay(args.v41_decoder_replay, model)
        prefix_replay = _prefix_replay(args.v41_prefix_replay, model)
        return cls(
            model_dir=model_dir,
            tokenizer_dir=args.tokenizer or model_dir,
            model=model,
            dtype=dtype,
            device=device,
            scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len),
            cache=CacheConfig(args.block_size, args.num_cache_blocks, args.cache_memory_gb,
                              args.gpu_memory_utilization,
                              _check_bool("enable_prefix_caching", args.enable_prefix_caching), _tier_config(args),
                              kv_cache_dtype),
            seed=args.seed,
            load_progress=args.load_progress,
            enforce_eager=bool(args.enforce_eager),
            async_scheduling=(auto_async_scheduling(device, speculative, parallel,
                                                    bool(args.kv_host_cache_gb or args.kv_cache_dir is not None),
                                                    isinstance(model, V41Config))
                              if args.async_scheduling is None else _check_bool("async_scheduling",
                                                                                 args.async_scheduling)),
            warm_up=device == "cuda" if args.warm_up is None else _check_bool("warm_up", args.warm_up),
            parallel=parallel,
            load_format=args.load_format,
            speculative=speculative,
            eplb=eplb,
            launch=launch,
            batch_invariant=batch_invariant,
            v41_decoder_replay=decoder_replay,
            v41_prefix_replay=prefix_replay,
        )

    def mode_labels(self) -> dict[str, str]:
        """What the engine runs as, for the start-up log and the /metrics info series."""
        return {"device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                "batch_invariant": "1" if self.batch_invariant else "0"}


def _model_config(model_dir: str, args: EngineArgs, device: str) -> ModelConfig | V41Config:
    """The checkpoint's config: DeepSeek-V4 (``ModelConfig``) or V4.1 (``V41Config``), by ``model_type``."""
    from deepinfer.config.v41_engine import check_v41_engine_args, read_config_json

    if not is_v41_config(read_config_json(model_dir)):
        return ModelConfig.from_model_dir(model_dir, args.hf_overrides)
    check_v41_engine_args(args, device)
    return V41Config.from_model_dir(model_dir, args.hf_overrides)


def _decoder_replay(mode: object, model: ModelConfig | V41Config) -> str:
    from deepinfer.config.v41_engine import check_decoder_replay

    if check_decoder_replay(mode) != "off" and not isinstance(model, V41Config):
        raise ValueError(f"v41_decoder_replay: {mode!r} applies to DeepSeek-V4.1 checkpoints only (their decoder "
                         "layers); allowed for this model: off")
    return mode


def _prefix_replay(mode: object, model: ModelConfig | V41Config) -> str:
    from deepinfer.config.v41_engine import check_prefix_replay

    if check_prefix_replay(mode) != "exact" and not isinstance(model, V41Config):
        raise ValueError(f"v41_prefix_replay: {mode!r} applies to DeepSeek-V4.1 checkpoints only (their encoder-side "
                         "replay of prefix hits); allowed for this model: exact")
    return mode


def _kv_cache_dtype(name: object, dtype: torch.dtype) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}")
    if name != "auto" and _DTYPES[name] != dtype:
        act = str(dtype).removeprefix("torch.")
        raise ValueError(f"kv_cache_dtype: {name!r} differs from the activation dtype {act} (the cache keeps rows in "
                         f"the activation dtype); allowed with dtype={act}: auto, {act}")
    return name


def _resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; allowed: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def auto_async_scheduling(device: str, speculative: SpeculativeConfig | None, parallel: ParallelConfig,
                          tiers: bool, v41: bool = False) -> bool:
    """``async_scheduling=None``: whether the engine overlaps planning with the device's step. On a CUDA device,
    where the host's work per step (planning, inputs, applying tokens, outputs) runs while the device computes
    the step before (the same tokens as the synchronous loop, tested); bench/results/serve_demo.md measures it
    against the synchronous loop, bench/results/spec_verify_cuda.md with speculation (MTP, k = 3 on V4-Flash
    layers: faster at batch 1, 8 and 32). Off on the CPU, where host and "device" are one thread and nothing
    overlaps; with speculation on several devices, with context parallelism and with cache tiers on several
    ranks (not supported: an explicit True is refused); off for DeepSeek-V4.1 (``v41``), whose CUDA path has
    been checked on the GPU with the synchronous loop only (its async loop is tested on the CPU: an explicit
    True runs it)."""
    if device != "cuda" or parallel.context_parallel_size > 1 or v41:
        return False
    if speculative is not None:
        return parallel.is_single
    return parallel.is_single or not tiers


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be true or false, got {value!r}")
    return value


def _check_parallel(parallel: ParallelConfig, launch: LaunchConfig, args: EngineArgs, device: str) -> None:
    from deepinfer.distributed.world import launched_by_torchrun

    if parallel.is_single:
        return
    launch.check_shared_device(device, launched_by_torchrun())
    if args.async_scheduling and parallel.context_parallel_size > 1:
        # A step in flight leaves placeholders in the plans; a CP group's helpers run shares of known tokens only.
        raise ValueError("async_scheduling: not supported with context_parallel_size > 1 yet; allowed: false "
                         "(or context_parallel_size=1)")
    # Devices are counted per node; under torchrun each rank checks its LOCAL_RANK when it joins.
    per_node = launch.ranks_per_node(parallel) // launch.ranks_sharing_device(parallel)  # devices wanted
    if device == "cuda" and not launched_by_torchrun() and per_node > torch.cuda.device_count():
        where = f" on each of {launch.nnodes} nodes" if launch.is_multi_node else ""
        raise ValueError(f"tensor_parallel_size x data_parallel_size: {per_node} devices wanted{where}, "
                         f"{torch.cuda.device_count()} visible")
    if args.speculative_config is not None and parallel.context_parallel_size > 1:
        # A context-parallel chunk's streams come back without the step index the MTP layer's pass reads.
        raise ValueError("speculative_config: not supported with context_parallel_size > 1 yet; allowed: None "
                         "(or context_parallel_size=1)")
    if (args.kv_host_cache_gb or args.kv_cache_dir is not None) and (args.async_scheduling
                                                                      or args.speculative_config is not None):
        # Each works with several ranks on its own; together they are not tested yet.
        name = "kv_host_cache_gb" if args.kv_host_cache_gb else "kv_cache_dir"
        raise ValueError(f"{name}: cache tiers with several ranks are not supported together with async_scheduling "
                         "or speculative_config yet; allowed: no cache tiers, or async_scheduling=false and "
                         "speculative_config=None")


def _check_batch_invariant(parallel: ParallelConfig) -> None:
    # Several ranks: every rank runs the invariant table and sums over ranks in rank order
    # (executor/rank.py, distributed/collectives.all_reduce); expert parallelism only moves rows.
    if parallel.context_parallel_size > 1:
        # A chunk's queries on other ranks, through the share path (model/parallel/context.py): not proven
        # to give the bits of the same chunk on one rank.
        raise ValueError("DEEPINFER_BATCH_INVARIANT=1: not supported with context_parallel_size > 1 yet; allowed: "
                         "context_parallel_size=1 (tensor, data and expert parallelism are supported)")


def _eplb_config(args: EngineArgs, parallel: ParallelConfig, model: ModelConfig) -> EplbConfig | None:
    enabled = _check_bool("enable_eplb", args.enable_eplb)
    if not enabled:
        if args.eplb_config is not None:
            raise ValueError("eplb_config: set without enable_eplb=True (the load balancer it configures)")
        return None
    if parallel.expert_parallel_size < 2:
        raise ValueError("enable_eplb: needs enable_expert_parallel=True with data_parallel_size x "
                         "tensor_parallel_size > 1 (it balances the experts over the expert-parallel ranks)")
    return EplbConfig.parse(args.eplb_config).validate(model.n_routed_experts, parallel.expert_parallel_size)


def _check_speculative(spec: SpeculativeConfig, model: ModelConfig | V41Config, args: EngineArgs) -> None:
    if isinstance(model, V41Config):
        from deepinfer.config.v41_engine import check_v41_speculative

        check_v41_speculative(spec, model)
    elif spec.method != "mtp":
        raise ValueError(f"speculative_config.method: {spec.method!r} is DeepSeek-V4.1's drafter; allowed for this "
                         "DeepSeek-V4 checkpoint: mtp")
    elif model.num_nextn_predict_layers < 1:
        raise ValueError("speculative_config.method: 'mtp' needs a checkpoint with an MTP layer "
                         "(num_nextn_predict_layers >= 1); this model has none")
    if args.async_scheduling and spec.method != "mtp":
        # DSpark drafts from the accepted count on the host; the MTP chain moves its positions on the device.
        raise ValueError(f"speculative_config: cannot be combined with async_scheduling=True for method "
                         f"{spec.method!r}; allowed: method 'mtp' (one device), speculative_config=None, or "
                         "async_scheduling=False")


def _check_async_speculative(parallel: ParallelConfig) -> None:
    if not parallel.is_single:
        # One device plans a verify step on the device's results of the one in flight (``llm_engine.py``); the
        # parallel engine's ranks do not yet.
        raise ValueError("speculative_config: cannot be combined with async_scheduling=True on several devices; "
                         "allowed: speculative_config=None, async_scheduling=False, or one device")


def _check_positive(args: EngineArgs) -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if args.block_size % 128:
        raise ValueError(f"block_size: must be a multiple of 128, got {args.block_size}")
    if args.num_cache_blocks is not None and (not isinstance(args.num_cache_blocks, int) or args.num_cache_blocks < 1):
        raise ValueError(f"num_cache_blocks: must be a positive integer, got {args.num_cache_blocks!r}")
    if args.cache_memory_gb is not None and not args.cache_memory_gb > 0:
        raise ValueError(f"cache_memory_gb: must be > 0, got {args.cache_memory_gb!r}")


def _gib(name: str, value: object, allow_zero: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}: must be a number {'>= 0' if allow_zero else '> 0'} (GiB), got {value!r}")
    return int(value * (1 << 30))


def _tier_config(args: EngineArgs) -> KVTierConfig:
    host = _gib("kv_host_cache_gb", args.kv_host_cache_gb, allow_zero=True)
    disk_dir = args.kv_cache_dir
    if disk_dir is not None:
        if not isinstance(disk_dir, str) or not disk_dir.strip():
            raise ValueError(f"kv_cache_dir: must be a directory path, got {disk_dir!r}")
        disk_dir = os.path.expanduser(disk_dir)
        if os.path.exists(disk_dir) and not os.path.isdir(disk_dir):
            raise ValueError(f"kv_cache_dir: {disk_dir!r} exists and is not a directory")
        if args.kv_disk_cache_gb is None:
            raise ValueError("kv_disk_cache_gb: required with kv_cache_dir (the disk tier's size limit in GiB)")
    elif args.kv_disk_cache_gb is not None:
        raise ValueError("kv_disk_cache_gb: set without kv_cache_dir (the directory of the disk tier)")
    disk = 0 if disk_dir is None else _gib("kv_disk_cache_gb", args.kv_disk_cache_gb, allow_zero=False)
    tiers = KVTierConfig(host, disk_dir, disk)
    if tiers.enabled and not args.enable_prefix_caching:
        name = "kv_host_cache_gb" if host else "kv_cache_dir"
        raise ValueError(f"{name}: the cache tiers hold prefix-cache blocks; they need enable_prefix_caching=True")
    return tiers


@dataclass(frozen=True, slots=True)
class RuntimeFacts:
    """Discovered at start-up; read-only afterwards."""

    num_blocks: dict
    bytes_per_block: dict
    device_name: str
