"""Starting a node's ranks. Three ways into one torch.distributed world, the same command on every node:

  * one node (the default): this process is rank 0 and spawns ranks 1..W-1 here;
  * several nodes, started by deepinfer (``--nnodes N --node-rank n --master-addr HEAD --master-port P``):
    each node's process spawns its W/N ranks [n*W/N, (n+1)*W/N) minus the first, which it runs itself: on
    node 0 that is rank 0, the engine; on the other nodes a follower;
  * torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``): this process is exactly that rank.
A follower rank runs ``rank_main`` (its orders come from rank 0) and its process exits when the engine
shuts the world down, so a command such as ``deepinfer serve`` only serves on node 0.
"""

from __future__ import annotations

import multiprocessing

from deepinfer.config.engine import EngineConfig
from deepinfer.distributed.config import DEFAULT_MASTER_PORT
from deepinfer.distributed.world import WorldEnv, free_port
from deepinfer.executor.rank import rank_main


def node_worlds(config: EngineConfig) -> list[WorldEnv]:
    """The world environment of every rank this node starts, in rank order (the node's first rank first)."""
    launch, parallel = config.launch, config.parallel
    ranks = launch.node_ranks(parallel)
    addr = launch.master_addr or "127.0.0.1"
    port = launch.master_port or (DEFAULT_MASTER_PORT if launch.is_multi_node else free_port())
    return [WorldEnv(r, parallel.world_size, r - ranks.start, addr, port, len(ranks)) for r in ranks]


def spawn_ranks(envs: list[WorldEnv], config: EngineConfig) -> list[multiprocessing.Process]:
    """Start a follower process for each of ``envs`` (daemons: they die with this process)."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for env in envs:
        p = ctx.Process(target=rank_main, args=(env, config), daemon=True)
        p.start()
        procs.append(p)
    return procs


def follow(envs: list[WorldEnv], config: EngineConfig) -> int:
    """A node other than node 0: run its ranks until the engine shuts the world down; returns the exit
    status (nonzero when one of the spawned ranks failed)."""
    procs = spawn_ranks(envs[1:], config)
    rank_main(envs[0], config)
    for p in procs:
        p.join()
    return max((p.exitcode or 0 for p in procs), default=0)
