"""Run a function on every rank of a real multi-process world on this machine (gloo on the CPU).

    results = run_world(fn, world_size=2, args=(...), timeout_s=120)

``fn(env: WorldEnv, *args)`` runs in a fresh (spawned) process per rank with the torchrun environment
variables set (a free local port); its return value comes back through a file, in rank order. A rank that
raises fails the call with its traceback; a world that is still running at ``timeout_s`` is terminated and
fails the call, so a hang in a collective ends a test instead of stalling it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from deepinfer.distributed.world import WorldEnv, free_port


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    env = WorldEnv(rank, world_size, rank, "127.0.0.1", port)
    os.environ.update(env.as_environ())
    torch.set_num_threads(1)  # ranks share the machine's cores
    result = fn(env, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_world(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 120.0) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"world of {world_size} ranks still running after {timeout_s}s (a hang?)")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
