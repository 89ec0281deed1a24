"""The engine over a world of ranks: data-parallel scheduling on rank 0, one plan per DP rank per step.

Each DP rank owns its sequences and its cache: rank 0 keeps one scheduler and cache manager per DP rank
(the cache sized by that rank's ``Ready`` report) and gives each new request to the least loaded one
(fewest waiting + running sequences; ties to the lower rank). A step schedules every DP rank, broadcasts
their plans in one ``RunStep``, runs rank 0's own share, and gathers the results; a DP rank without work
runs an empty step while any other has work (the MoE collectives need every rank). With context parallelism,
each CP group's longest prefill chunk of at least ``context_parallel_min_tokens`` tokens is named in the step
(``RunStep.context_parallel``) and every rank of the group runs its zigzag share of it beside its own work
(``model/parallel/context.py``). With speculative decoding each DP rank's scheduler plans its sequences' drafts,
the rank verifies them and runs their MTP passes, its result carries the accepted tokens and next drafts, and
rejected drafts are rolled back on that rank's scheduler; ``RunStep.mtp_passes`` makes every rank run as many
MTP-layer expert collectives as the busiest one (not with context parallelism). Structured outputs: the
matchers live here; each plan carries its constrained sequences' masks, with drafts one per verified position
(the grammar advanced over the drafts before it: ``structured/step_masks.with_plan_masks``), the ranks apply
them before the acceptance, and the accepted tokens advance the matchers as on one device (``LLMEngine._apply``).
With expert-parallel load balancing, every ``step_interval`` steps the experts are re-placed between two steps
(``eplb.py``).

Launch (``launch.py``): ``launch_engine`` spawns ranks 1..W-1 on this machine (one device each, or all on one
with ``ranks_share_device``); with ``nnodes`` > 1, each node spawns its own share of the ranks; under
``torchrun`` (``RANK`` etc. set) it joins the world described there. Rank 0 returns the engine; every other rank serves orders until the engine shuts
down and then its process exits, so the same command runs on every node.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any

import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.config.v41 import V41Config
from deepinfer.distributed.world import WorldEnv, close_world, launched_by_torchrun
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.intake import Intake
from deepinfer.engine.warm_up import warm_up
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.progress import abort, build_output, finish
from deepinfer.executor.eplb import EplbDriver
from deepinfer.executor.launch import follow, node_worlds, spawn_ranks
from deepinfer.executor.messages import (ClearExpertLoad, CollectContextHistory, ContextHistory, Ready, RunStep,
                                         Shutdown)
from deepinfer.executor.rank import RankWorker, rank_main
from deepinfer.executor.remote_tiers import RemoteTiers
from deepinfer.executor.tier_messages import CloseTiers, CollectTierStats, TierReply, TierWork
from deepinfer.model.parallel.context import ContextParallelChunk
from deepinfer.engine.sizing import build_prefix_hasher, cache_layout
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.kv.manager import CacheManager
from deepinfer.kv.spec import HISTORY
from deepinfer.kv.tiers.stats import TierStats
from deepinfer.runner.model_runner import StepResult
from deepinfer.runner.speculative import mtp_passes
from deepinfer.sched.plan import StepPlan
from deepinfer.sched.scheduler import Schedule, Scheduler
from deepinfer.tokenizer import Tokenizer


class _Done:
    """A gathered result in the shape ``LLMEngine._apply`` reads (``StepHandle.result()``)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result


def launch_engine(config: EngineConfig) -> "ParallelLLMEngine":
    """This node's share of the world (``launch.py``): on the engine's node, the engine; elsewhere, the
    follower ranks, after which the process exits."""
    if launched_by_torchrun():  # torchrun: this process is one rank
        if config.launch.is_multi_node:
            raise ValueError("nnodes: the launcher already describes the world (RANK, WORLD_SIZE in the "
                             "environment); give the node count and rank to torchrun, not to deepinfer")
        env = WorldEnv.from_env()
        if env.rank != 0:
            rank_main(env, config)
            sys.exit(0)
        _share_cores(config, env)
        return ParallelLLMEngine(config, env, [])
    envs = node_worlds(config)
    if config.launch.node_rank != 0:
        sys.exit(follow(envs, config))
    _share_cores(config, envs[0])
    return ParallelLLMEngine(config, envs[0], spawn_ranks(envs[1:], config))


def _share_cores(config: EngineConfig, env: WorldEnv) -> None:
    if config.device == "cpu":  # the ranks share this machine's cores (rank_main divides them likewise)
        torch.set_num_threads(max(1, torch.get_num_threads() // env.ranks_on_node))


class ParallelLLMEngine(LLMEngine):
    def __init__(self, config: EngineConfig, env: WorldEnv, procs: list) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer_dir)
        self._procs = procs
        self.worker = RankWorker(config, env)
        self.model = self.worker.model
        ready = self.worker.channel.gather(Ready(0, self.worker.facts))
        tp, mc, sc = config.parallel.tensor_parallel_size, config.model, config.scheduler
        spec = config.speculative  # each DP rank's scheduler plans its drafts; its ranks verify them
        layout = cache_layout(config)  # V4's or V4.1's, as the ranks' caches (engine/sizing.py)
        counts = [ready[d * tp].facts.num_blocks for d in range(config.parallel.data_parallel_size)]
        prefix = build_prefix_hasher(config)
        caches = [CacheManager(layout, c) for c in counts]
        # Cache tiers: each rank keeps its own (rank_tiers.py); each DP group's scheduler asks its ranks.
        tiers = config.cache.tiers
        warm = tiers.host_bytes > 0 and tiers.disk_dir is not None
        self.remote_tiers = [RemoteTiers(d, tp, cache.replay > 0, self._ask, warm) for d, cache in enumerate(caches)] \
            if tiers.enabled and prefix is not None else None
        self.schedulers = [Scheduler(sc, cache, (mc.eos_token_id,), spec, prefix,
                                     self.remote_tiers[d] if self.remote_tiers else None)
                           for d, cache in enumerate(caches)]
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec is not None else 0)
        self.facts = ready[0].facts
        max_cached = min(c[HISTORY] for c in counts) * config.cache.block_size
        image_id = mc.image_token_id if isinstance(mc, V41Config) else None  # text only: no vision encoder yet
        self.intake = Intake(self.tokenizer, mc.vocab_size, sc.max_model_len, max_cached, mc.eos_token_id,
                             refused_token_id=image_id)
        # Async scheduling: per DP rank, the schedule of the step in flight (None: no work there), its results
        # applied once the next step is submitted, as in LLMEngine.step.
        self.async_scheduling = config.async_scheduling
        self._inflight: list[Schedule | None] | None = None
        # Rank 0's own tier link (the engine never drives it: RunStep and the tier orders do).
        self.tiers = self.worker.tiers.link if self.worker.tiers is not None else None
        # Per rank, its store's counters as last sent with a step's results (StepDone.tiers): /metrics reads
        # every rank's tiers from here (server/engine_stats.py); None until the rank's first report.
        self.rank_tier_stats: list[TierStats | None] = [None] * env.world_size
        self.requests = {}
        self._pending: list[RequestOutput] = []
        self.build_output = build_output  # as LLMEngine.build_output (the server's core installs deltas)
        self._owner: dict[str, int] = {}  # request id -> DP rank
        self._closed = False
        self.eplb = None  # set after the warm-up: its steps neither count towards a rebalance nor trigger one
        self.context_parallel_chunks = 0  # prefill chunks run split over a CP group
        atexit.register(self.close)
        if config.warm_up:
            warm_up(self)
            self.context_parallel_chunks = 0  # the warm-up's are not served chunks
            if config.eplb is not None:
                self._ask(ClearExpertLoad())  # nor do its expert loads count towards the first placement
        self.eplb = EplbDriver(config.eplb) if config.eplb is not None else None

    def _ask(self, order) -> list:
        """Every rank carries out ``order`` (between steps); their replies in rank order."""
        self.worker.channel.broadcast(order)
        return self.worker.channel.gather(self.worker.handle(order))

    def context_history(self) -> list[ContextHistory]:
        """Every rank's context-parallel history replicas, in rank order (needs context_parallel_size > 1)."""
        return self._ask(CollectContextHistory())

    def tier_stats(self) -> list[TierReply]:
        """Every rank's tier counters (blocks saved and loaded, its store's stats), in rank order."""
        return self._ask(CollectTierStats()) if self.remote_tiers else []

    # What single-rank callers read (the server's metrics, tests): DP rank 0's scheduler and cache.
    @property
    def scheduler(self) -> Scheduler:
        return self.schedulers[0]

    @property
    def cache(self) -> CacheManager:
        return self.schedulers[0].cache

    def add_request(self, request_id: str, prompt: Any, sampling_params: Any = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        req = self.intake.build(request_id, prompt, sampling_params)
        # The DP rank whose cache holds the longest prefix of the prompt; the least loaded among equals.
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        hits = [s.cached_prefix(req.seqs[0]) for s in self.schedulers]
        dp = min(range(len(loads)), key=lambda d: (-hits[d], loads[d]))
        self.requests[request_id] = req
        self._owner[request_id] = dp
        for seq in req.seqs:
            self.schedulers[dp].add(seq)

    def abort_request(self, request_ids) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            req = self.requests.pop(rid, None)
            if req is not None:
                self._pending.append(abort(req, self.schedulers[self._owner.pop(rid)].remove, self.build_output))

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        touched: set[str] = set()
        if self._inflight is not None and any(seq.grammar is not None for s in self.schedulers for seq in s.running):
            touched |= self._flush()  # a grammar's next mask (computed when planning) needs the token in flight
        schedules = [self._with_grammar_masks(s.schedule()) for s in self.schedulers]
        for schedule in schedules:
            for seq in schedule.unschedulable:
                finish(seq, "length")
                touched.add(seq.request.request_id)
        done = None
        tier_work = self._tier_work(schedules)
        # Work, departures or tier work somewhere, or (async) a step in flight whose results the ranks still hold.
        if any(s.plan != StepPlan() for s in schedules) or any(tier_work) or self._inflight is not None:
            order = RunStep(tuple(s.plan for s in schedules), busy=any(not s.empty for s in schedules),
                            copies=tuple(s.copies for s in schedules),
                            context_parallel=self._context_parallel([s.plan for s in schedules]),
                            mtp_passes=max(mtp_passes(s.plan) for s in schedules) if self.config.speculative else 0,
                            in_flight=self.async_scheduling, tiers=tier_work)
            done = self._run(order)
        for scheduler, schedule in zip(self.schedulers, schedules):
            scheduler.commit(schedule)
        # As LLMEngine.step: sync, this step's results; async, the previous step's (``done`` holds those), this
        # step staying in flight. Per DP rank, its schedule, or None where it had no work.
        current = [None if s.empty else s for s in schedules]
        if self.async_scheduling:
            current, self._inflight = self._inflight, (current if any(c is not None for c in current) else None)
        touched |= self._apply_all(current, done)
        for rid in [r for r in self.requests if r in touched]:  # arrival order
            req = self.requests[rid]
            for seq in req.seqs:
                if seq.finished:
                    self.schedulers[self._owner[rid]].remove(seq)
            outputs.append(self.build_output(req))
            if req.finished:
                del self.requests[rid]
                del self._owner[rid]
        return outputs

    def _run(self, order: RunStep) -> list:
        """Every rank runs ``order``; their replies, in rank order."""
        self.worker.channel.broadcast(order)
        done = self.worker.channel.gather(self.worker.run(order))
        for reply in done:
            if reply.tiers is not None:
                self.rank_tier_stats[reply.rank] = reply.tiers
        self.context_parallel_chunks += len(order.context_parallel)
        if self.eplb is not None and order.busy:
            self.eplb.after_step(self.worker)  # between this step and the next
        return done

    def _apply_all(self, schedules, done) -> set[str]:
        """Fold each DP rank's results (its first TP rank's report in ``done``) into its schedule's sequences."""
        touched: set[str] = set()
        tp = self.config.parallel.tensor_parallel_size
        for d, schedule in enumerate(schedules or ()):
            if schedule is not None:
                touched |= self._apply(schedule, _Done(done[d * tp].result))
        return touched

    def _flush(self) -> set[str]:
        """Async: an empty step that brings the step in flight home, and its results applied (no new work)."""
        dp = self.config.parallel.data_parallel_size
        inflight, self._inflight = self._inflight, None
        return self._apply_all(inflight, self._run(RunStep(tuple(StepPlan() for _ in range(dp)), busy=False,
                                                           in_flight=True)))

    def _rollback(self, seq, num_rejected: int) -> None:
        self.schedulers[self._owner[seq.request.request_id]].rollback(seq, num_rejected)  # the owning DP rank's

    def _tier_work(self, schedules) -> tuple[TierWork, ...]:
        """Per DP group, the step's tier work (its loads name blocks by hash: ``RemoteTiers.fetch_all``)."""
        if not self.remote_tiers:
            return ()
        work = tuple(TierWork(s.saves, s.loads, r.take_prefetch()) for s, r in zip(schedules, self.remote_tiers))
        return work if any(w != TierWork() for w in work) else ()

    def _context_parallel(self, plans: list[StepPlan]) -> tuple[ContextParallelChunk, ...]:
        """Per CP group, the longest prompt chunk of at least ``cp_min_chunk`` tokens among its DP ranks' plans
        (ties: the lower rank, then the earlier work), to be split over the group."""
        pc = self.config.parallel
        cp = pc.context_parallel_size
        if cp == 1:
            return ()
        out = []
        for g in range(pc.data_parallel_size // cp):
            best = None
            for d in range(g * cp, (g + 1) * cp):
                for w in plans[d].work:
                    # Known tokens only (the chunk's ids go to every rank of the group), no verify runs.
                    if w.num_tokens >= pc.cp_min_chunk and not w.num_placeholders and not w.num_drafts and (
                            best is None or w.num_tokens > best[0]):
                        best = (w.num_tokens, ContextParallelChunk(d, w.seq_id))
            if best is not None:
                out.append(best[1])
        return tuple(out)

    def close(self) -> None:
        """Stop every rank and leave the world (also at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        if self.remote_tiers:  # write the device's cached blocks down first: a restart finds them all
            self._ask(CloseTiers(tuple(tuple(s.cache.cached_blocks()) for s in self.schedulers)))
        self.worker.channel.broadcast(Shutdown())
        for p in self._procs:
            p.join(timeout=30)
        close_world()
