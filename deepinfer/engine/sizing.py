"""Cache sizing at start-up: from an explicit block count, a memory budget, or free device memory."""

from __future__ import annotations

import torch

from deepinfer.config.engine import EngineConfig, RuntimeFacts
from deepinfer.kv.manager import CacheManager, blocks_for_budget, cdiv, tail_blocks_per_seq
from deepinfer.kv.spec import HISTORY, POOLS, build_layout
from deepinfer.kv.storage import KVStorage

_CPU_DEFAULT_BUDGET = 2 << 30  # 2 GiB when nothing else is said


def _num_blocks(config: EngineConfig, layout, dtype_bytes: int) -> dict[str, int]:
    sc, cc = config.scheduler, config.cache
    if cc.num_cache_blocks is not None:
        tail = {p: sc.max_num_seqs * tail_blocks_per_seq(layout, p) + cdiv(sc.max_num_batched_tokens, cc.block_size)
                for p in POOLS if p != HISTORY}
        return {HISTORY: cc.num_cache_blocks, **tail}
    if cc.cache_memory_gb is not None:
        budget = int(cc.cache_memory_gb * (1 << 30))
    elif config.device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        budget = int(free * cc.gpu_memory_utilization)
    else:
        # Enough for every sequence at full length, capped: small models need far less than the cap.
        full = sum(layout.bytes_per_block(p, dtype_bytes) for p in POOLS)
        budget = min(_CPU_DEFAULT_BUDGET, full * sc.max_num_seqs * cdiv(sc.max_model_len, cc.block_size))
    return blocks_for_budget(layout, budget, dtype_bytes, sc.max_num_seqs, sc.max_model_len,
                             max_num_batched_tokens=sc.max_num_batched_tokens)


def build_cache(config: EngineConfig) -> tuple[CacheManager, KVStorage, RuntimeFacts]:
    layout = build_layout(config.model, config.cache.block_size, include_mtp=False)
    dtype_bytes = torch.empty(0, dtype=config.dtype).element_size()
    counts = _num_blocks(config, layout, dtype_bytes)
    storage = KVStorage(layout, counts, config.dtype, config.device)
    facts = RuntimeFacts(
        num_blocks=dict(counts),
        bytes_per_block={p: layout.bytes_per_block(p, dtype_bytes) for p in POOLS},
        device_name=torch.cuda.get_device_name() if config.device == "cuda" else "cpu",
    )
    return CacheManager(layout, counts), storage, facts
