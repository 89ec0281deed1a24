"""Cache sizing at start-up: from an explicit block count, a memory budget, or device memory.

On CUDA without an explicit budget the cache gets what is left of ``gpu_memory_utilization`` x total
memory after everything already resident (weights, CUDA context) and the activation peak of a profiling
forward of ``max_num_batched_tokens`` tokens (the largest step the scheduler can plan; V4.1's in
``profile_v41.py``). Decode graphs are
captured afterwards from the remaining headroom (their batches are far smaller than a prefill step).
When the ranks of a world share one device (``LaunchConfig.ranks_share_device``) each rank takes 1/ranks of
that fraction, less what it holds itself (what its allocator reserved plus ``SHARED_RANK_OVERHEAD``): the
device's free memory would count the other ranks' weights and caches, which come and go while it sizes.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.config.engine import EngineConfig, RuntimeFacts
from deepinfer.config.v41 import V41Config
from deepinfer.kv.block_budget import blocks_for_budget, cdiv, retained_tail_blocks, tail_blocks_per_seq
from deepinfer.kv.manager import CacheManager
from deepinfer.kv.prefix_hash import BlockHasher, CacheNamespace, model_fingerprint
from deepinfer.kv.spec import HISTORY, POOLS, CacheLayout, build_layout
from deepinfer.kv.spec_v41 import build_v41_layout
from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.step_index import build_step_index

log = logging.getLogger("deepinfer")

_CPU_DEFAULT_BUDGET = 2 << 30  # 2 GiB when nothing else is said
# Share of the cache budget that keeps cached block boundaries' window/state tails (prefix caching): a hit
# needs them, and per boundary they cost several history blocks (bench/results/prefix_cache*.md).
RETAINED_TAIL_FRACTION = 0.2
# What a rank sharing its device holds beyond its allocator's reservation: its CUDA context, the kernels'
# modules, cuBLAS workspaces (memory_reserved does not see them; about 0.5-1 GiB per process).
SHARED_RANK_OVERHEAD = 1 << 30


@torch.no_grad()
def profile_activation_bytes(model, config: EngineConfig, layout) -> int:
    """Peak bytes a forward of ``max_num_batched_tokens`` tokens allocates beyond what is resident.

    V4: the step is all padding (a throw-away one-block storage, no sequence rows): it runs every layer's
    projections, MoE and kernels at full width, with entry columns sized for ``max_model_len``. V4.1: the
    largest step its scheduler could plan (``profile_v41.py``: the most sequences, each at the longest length).
    """
    if isinstance(config.model, V41Config):
        from deepinfer.engine.profile_v41 import run_largest_v41_step

        return peak_bytes(lambda: run_largest_v41_step(model, config, layout))

    def run() -> None:
        sc = config.scheduler
        scratch = KVStorage(layout, {p: 1 for p in POOLS}, config.dtype, config.device)
        index = build_step_index(ForwardBatch(()), scratch, model.cfg.sliding_window,
                                 num_tokens=sc.max_num_batched_tokens, num_seqs=1,
                                 max_len=sc.max_model_len).to(config.device)
        ids = torch.zeros(sc.max_num_batched_tokens, dtype=torch.long, device=config.device)
        streams = model(ids, None, scratch, index)
        model.logits(streams[-sc.max_num_seqs:])

    return peak_bytes(run)


def peak_bytes(run) -> int:
    """Peak bytes ``run()`` allocates on the current CUDA device beyond what was allocated before it; what it
    made is freed when it returns."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()
    return peak


def device_cache_budget(total: int, in_use: int, utilization: float, activations: int, ranks: int = 1) -> int:
    """Bytes of cache for one rank: its share (1/``ranks`` of the device's ``utilization`` x ``total``) less
    what it already uses (``in_use``: on a device of its own everything resident, else its own holdings) and
    its activation peak. Raises ValueError naming the field when nothing is left."""
    share = int(total * utilization / ranks)
    budget = share - in_use - activations
    if budget <= 0:
        whose = "" if ranks == 1 else f" (each of the {ranks} ranks sharing the device gets 1/{ranks} of it)"
        fix = "raise it or lower max_num_batched_tokens" if ranks == 1 else \
            "raise it, lower max_num_batched_tokens, or give cache_memory_gb / num_cache_blocks per rank"
        raise ValueError(f"gpu_memory_utilization: {utilization} leaves no memory for the cache{whose} "
                         f"({in_use / 2**30:.1f} GiB in use, activation peak {activations / 2**30:.2f} GiB of "
                         f"{share / 2**30:.1f} GiB); {fix}")
    return budget


def _cuda_budget(config: EngineConfig, model, layout) -> int:
    activations = profile_activation_bytes(model, config, layout) if model is not None else 0
    free, total = torch.cuda.mem_get_info()
    ranks = config.launch.ranks_sharing_device(config.parallel)
    in_use = total - free if ranks == 1 else torch.cuda.memory_reserved() + SHARED_RANK_OVERHEAD
    util = config.cache.gpu_memory_utilization
    budget = device_cache_budget(total, in_use, util, activations, ranks)
    log.info("cache budget %.2f GiB (total %.1f, in use %.1f, activation peak %.2f GiB, utilization %.2f, ranks on "
             "the device %d)", budget / 2**30, total / 2**30, in_use / 2**30, activations / 2**30, util, ranks)
    return budget


def spec_slack(config: EngineConfig) -> tuple[int, int]:
    """(rollback depth, extra resident positions) of speculative decoding: a verify step of k drafts may be
    rolled back by k; its MTP chain writes up to k - 1 positions past the step. With async scheduling the
    host's lengths assume full acceptance of the step in flight and of the one just planned, so a
    sequence may be 2k positions ahead of its real length when its tail blocks are released."""
    k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return speculative_slack(k, config.async_scheduling)


def speculative_slack(num_speculative_tokens: int, async_scheduling: bool = False) -> tuple[int, int]:
    """``spec_slack`` of ``num_speculative_tokens`` drafts per step (also what ``deepinfer info`` plans with)."""
    k = num_speculative_tokens
    depth = 2 * k if async_scheduling else k
    return depth, depth + k


def _num_blocks(config: EngineConfig, layout, dtype_bytes: int, model=None) -> dict[str, int]:
    sc, cc = config.scheduler, config.cache
    slack = spec_slack(config)[1]
    retained = RETAINED_TAIL_FRACTION if cc.enable_prefix_caching else 0.0
    if cc.num_cache_blocks is not None:
        # The budget these history blocks would be the rest of: its retained share keeps boundaries' tails.
        hist_bytes = cc.num_cache_blocks * layout.bytes_per_block(HISTORY, dtype_bytes)
        extra = retained_tail_blocks(layout, int(hist_bytes * retained / (1 - retained)), dtype_bytes)
        tail = {p: sc.max_num_seqs * tail_blocks_per_seq(layout, p, slack) + cdiv(sc.max_num_batched_tokens, cc.block_size)
                + extra[p] for p in POOLS if p != HISTORY}
        return {HISTORY: cc.num_cache_blocks, **tail}
    if cc.cache_memory_gb is not None:
        budget = int(cc.cache_memory_gb * (1 << 30))
    elif config.device == "cuda":
        budget = _cuda_budget(config, model, layout)
    else:
        # Enough for every sequence at full length, capped: small models need far less than the cap.
        full = sum(layout.bytes_per_block(p, dtype_bytes) for p in POOLS)
        need = full * sc.max_num_seqs * cdiv(sc.max_model_len, cc.block_size)
        budget = min(_CPU_DEFAULT_BUDGET, int(need / (1 - retained)))
    return blocks_for_budget(layout, budget, dtype_bytes, sc.max_num_seqs, sc.max_model_len, spec_slack=slack,
                             max_num_batched_tokens=sc.max_num_batched_tokens, retained_fraction=retained)


def cache_layout(config: EngineConfig) -> CacheLayout:
    """The cache specs of the engine's model: V4's (the MTP layer's window rows live in the window pool beside
    the target's, with speculative decoding only) or V4.1's (``kv/spec_v41.py``; its rounded rows packed in the
    released FP8/FP4 formats under ``kv_cache_dtype="auto"``)."""
    if isinstance(config.model, V41Config):
        return build_v41_layout(config.model, config.cache.block_size, dspark=config.speculative is not None,
                                prefix_replay=config.v41_prefix_replay, packed=config.cache.released_formats)
    return build_layout(config.model, config.cache.block_size, include_mtp=config.speculative is not None)


def pool_blocks(config: EngineConfig, layout: CacheLayout, model=None) -> dict[str, int]:
    """Blocks per pool of the engine's cache (``model``: profiled on CUDA when no budget is given)."""
    return _num_blocks(config, layout, torch.empty(0, dtype=config.dtype).element_size(), model)


def build_cache(config: EngineConfig, model=None) -> tuple[CacheManager, KVStorage, RuntimeFacts]:
    """``model`` (optional): profiled on CUDA to size the cache from ``gpu_memory_utilization``."""
    layout = cache_layout(config)
    dtype_bytes = torch.empty(0, dtype=config.dtype).element_size()
    counts = pool_blocks(config, layout, model)
    storage = KVStorage(layout, counts, config.dtype, config.device)
    facts = RuntimeFacts(
        num_blocks=dict(counts),
        bytes_per_block={p: layout.bytes_per_block(p, dtype_bytes) for p in POOLS},
        device_name=torch.cuda.get_device_name() if config.device == "cuda" else "cpu",
    )
    return CacheManager(layout, counts, spec_slack=spec_slack(config)[0]), storage, facts


def build_prefix_hasher(config: EngineConfig) -> BlockHasher | None:
    """The hash chain of the prefix cache (None when it is off). Its namespace covers what decides a cached
    row's bits besides the tokens: the checkpoint (dummy weights: their seed), the block size, the cache
    dtype and the kernels that computed the rows."""
    if not config.cache.enable_prefix_caching:
        return None
    model_dir = config.model_dir if config.load_format == "auto" else None
    kernels = f"{config.device}/{'triton' if config.device == 'cuda' else 'reference'}"
    if config.load_format != "auto":
        kernels += f"/{config.load_format}-weights-seed{config.seed}"
    cache_dtype = str(config.dtype).removeprefix("torch.")
    if isinstance(config.model, V41Config):  # V4.1 rows are rounded to the released formats under "auto"
        cache_dtype += f"/kv_cache_dtype={config.cache.kv_cache_dtype}"
        if config.cache.released_formats:  # and stored packed: a block's bytes are not the unpacked rows'
            cache_dtype += "/packed"
        if config.speculative is not None:  # window blocks then hold the DSpark context rows too
            cache_dtype += "/dspark"
        if config.v41_prefix_replay != "exact":  # rows computed after a replayed hit differ from a cold run's
            cache_dtype += f"/prefix_replay={config.v41_prefix_replay}"
    ns = CacheNamespace(model_fingerprint(config.model, model_dir), config.cache.block_size, cache_dtype, kernels)
    return BlockHasher(ns)
