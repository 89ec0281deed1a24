"""One rank of a parallel engine: its share of the model, its DP group's cache and batch state, its runner.

Rank 0 holds one of these inside the engine; every other rank runs ``rank_main``: join the world, load,
report ``Ready``, then follow the engine's orders (``RunStep``; between steps, with expert-parallel load
balancing, ``CollectExpertLoad`` and ``MoveExperts``) until ``Shutdown``. All TP ranks of a DP
group get the same plan and compute the same logits (the all-reduce gives every rank the same sums), so
their seeded draws agree; only the group's first rank reports them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.config.v41 import V41Config
from deepinfer.distributed.world import WorldEnv, close_world, init_world
from deepinfer.engine.llm_engine import load_v41_step
from deepinfer.engine.sizing import build_cache
from deepinfer.executor.channel import Channel
from deepinfer.executor.messages import (ClearExpertLoad, CollectContextHistory, CollectExpertLoad, ContextHistory,
                                         ExpertLoad, ExpertsMoved, MoveExperts, Ready, RunStep, Shutdown, StepDone)
from deepinfer.executor.rank_tiers import RankTiers
from deepinfer.executor.tier_messages import TIER_ORDERS
from deepinfer.kv.block_budget import cdiv
from deepinfer.kv.offload import move_blocks
from deepinfer.model.device import use_op_table
from deepinfer.model.draft_head import attach_draft_head
from deepinfer.model.loader import load_model
from deepinfer.model.parallel.context import ContextShare
from deepinfer.model.parallel.context_history import HistoryReplicas
from deepinfer.model.parallel.eplb import ExpertBalancer
from deepinfer.model.parallel.shard import empty_mtp_passes, empty_step, needs_empty_steps, sharding_hook
from deepinfer.model.v41 import parallel as v41_parallel
from deepinfer.ops.table import select as select_ops
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.model_runner import ModelRunner, StepResult
from deepinfer.runner.speculative import mtp_passes


class RankWorker:
    def __init__(self, config: EngineConfig, env: WorldEnv) -> None:
        # With DEEPINFER_BATCH_INVARIANT (read once, into the config rank 0 sent) every rank runs the
        # batch-invariant op table and sums over ranks in rank order.
        self.pctx = dataclasses.replace(init_world(config.parallel, config.device, env,
                                                   share_device=config.launch.ranks_share_device),
                                        ordered_sums=config.batch_invariant)
        self.channel = Channel()
        # Built on the meta device as this rank's sharded module types, then only the rank's slices are read,
        # quantized-first: on CUDA straight into the kernels' layout, on the CPU dequantized per tensor.
        cuda = config.device == "cuda"
        ops = select_ops(config.device, config.batch_invariant)
        if isinstance(config.model, V41Config):  # its share only, on the CPU (model/v41/parallel.py)
            self.model = load_v41_step(config, keep=functools.partial(v41_parallel.shard_v41, pctx=self.pctx))
            self._empty_step = functools.partial(v41_parallel.empty_step, self.model.model) \
                if v41_parallel.needs_empty_steps(self.model.model) else None
        else:
            self.model = load_model(config.model_dir, dtype=config.dtype, device=self.pctx.device, strict_mtp=False,
                                    progress=config.load_progress and env.rank == 0, ops=ops if cuda else None,
                                    cfg=config.model, load_format=config.load_format, seed=config.seed,
                                    shard_model=sharding_hook(self.pctx))
            self._empty_step = functools.partial(empty_step, self.model) if needs_empty_steps(self.model) else None
        if not cuda and ops.batch_invariant:
            use_op_table(self.model, ops)
        if config.speculative is not None and config.speculative.fp8_draft_head(config.device):
            attach_draft_head(self.model, ops)  # the LM head is whole on every rank: so is its FP8 copy
        # Redundant expert slots before the cache is sized: they take their memory first.
        self.balancer = ExpertBalancer(self.model, config.eplb) if config.eplb is not None else None
        cache, self.storage, self.facts = build_cache(config, self.model)
        # This rank's own cache tiers (rank_tiers.py): it saves and loads its blocks (its shard of them) itself.
        self.tiers = RankTiers.open(config, env, self.pctx.dp_rank, self.storage, replay=cache.replay > 0)
        sc, mc = config.scheduler, config.model
        batch = InputBatch(sc.max_num_seqs, cdiv(sc.max_model_len, config.cache.block_size), mc.vocab_size,
                           self.pctx.device)
        # No decode graphs: the expert dispatch sizes its exchange on the host every step, and a world whose
        # ranks share one device stages every collective through host memory, which no graph can hold
        # (distributed/collectives.py). With speculative decoding the rank verifies its own sequences' drafts and
        # runs the MTP passes for them (the MTP layer is sharded like the layers; its window rows live in this
        # rank's cache).
        self.speculative = config.speculative is not None
        self.runner = ModelRunner(self.model, self.storage, batch, speculative=self.speculative)
        self.reports = self.pctx.tp_rank == 0
        # Context parallelism: what this rank keeps of a sequence's history between its CP chunks.
        self.cp_history = HistoryReplicas() if self.pctx.cp_size > 1 else None
        self._inflight = None  # async scheduling: the step submitted last, its results not yet reported

    def handle(self, order):
        """Carry out one order of the engine; returns this rank's reply."""
        if isinstance(order, RunStep):
            return self.run(order)
        if isinstance(order, (CollectExpertLoad, ClearExpertLoad)):
            window, slots = self.balancer.report()
            if isinstance(order, ClearExpertLoad):
                self.balancer.clear()
            return ExpertLoad(self.pctx.rank, tuple(map(tuple, window)), tuple(map(tuple, slots)))
        if isinstance(order, MoveExperts):
            self.balancer.apply(order.placements)
            return ExpertsMoved(self.pctx.rank)
        if isinstance(order, CollectContextHistory) and self.cp_history is not None:
            h = self.cp_history
            return ContextHistory(self.pctx.rank, tuple(r.seq_id for r in h.replicas.values()), h.nbytes,
                                  h.chunks_from_replica, h.catch_ups, h.dropped_on_leave)
        if isinstance(order, TIER_ORDERS) and self.tiers is not None:
            return self.tiers.handle(order)
        raise TypeError(f"rank {self.pctx.rank}: unexpected order {type(order).__name__}")

    def run(self, order: RunStep) -> StepDone:
        if self.balancer is not None:
            self.balancer.advance()
        plan = order.plans[self.pctx.dp_rank]
        tier_work = order.tiers[self.pctx.dp_rank] if order.tiers else None
        copies = order.copies[self.pctx.dp_rank] if order.copies else ()
        move_blocks(self.storage, self.tiers if tier_work is not None else None, tier_work, copies, tier_work)
        if self.cp_history is not None:
            self.cp_history.retire(order.plans)
        share = self._share(order)
        handle = self.runner.submit(plan, share=share)
        if plan.empty and share is None and order.busy and self._empty_step is not None:
            self._empty_step()
        if order.mtp_passes and self._empty_step is not None:  # after the passes the runner ran, in order
            empty_mtp_passes(self.model, order.mtp_passes - (mtp_passes(plan) if self.speculative else 0))
        if order.in_flight:  # its placeholders were filled from the step before, on this rank's device
            handle, self._inflight = self._inflight, handle
        result = handle.result() if handle is not None else StepResult()
        if self.cp_history is not None:
            self.cp_history.finish_step(order.plans)
        return StepDone(self.pctx.rank, result if self.reports else None,
                        self.tiers.report() if self.tiers is not None else None)

    def _share(self, order: RunStep) -> ContextShare | None:
        """This rank's part in its CP group's chunk of the step, if the group has one."""
        pctx = self.pctx
        for chunk in order.context_parallel:
            if chunk.owner // pctx.cp_size != pctx.dp_rank // pctx.cp_size:
                continue
            work = next(w for w in order.plans[chunk.owner].work if w.seq_id == chunk.seq_id)
            return ContextShare(pctx.cp_group, pctx.cp_rank, pctx.cp_size, pctx.cp_global_rank(chunk.owner),
                                chunk.owner == pctx.dp_rank, chunk.seq_id, work.first_pos, work.token_ids,
                                self.cp_history.track(chunk.owner, chunk.seq_id, work.first_pos))
        return None


@torch.no_grad()
def rank_main(env: WorldEnv, config: EngineConfig) -> None:
    """A worker rank (spawned by the engine, or started by torchrun on another node)."""
    torch.set_num_threads(max(1, torch.get_num_threads() // env.ranks_on_node))  # the node's ranks share its cores
    worker = RankWorker(config, env)
    worker.channel.gather(Ready(env.rank, worker.facts))
    while True:
        order = worker.channel.broadcast()
        if isinstance(order, Shutdown):
            break
        worker.channel.gather(worker.handle(order))
    close_world()
