"""The process world: torchrun-compatible rendezvous, the process groups, and the frozen context passed to
every sharded module (no module-level globals: two worlds' models can coexist in one test process tree).

Environment (what ``torchrun`` sets, and what the engine sets for the workers it spawns): ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. Read here, not in
``deepinfer/env.py``: they are torch.distributed's variables, not deepinfer switches. Backend: NCCL on CUDA
(one rank per device, ``LOCAL_RANK``'s), gloo on the CPU; gloo too when the ranks share one CUDA device
(``LaunchConfig.ranks_share_device``: NCCL refuses two ranks on one device), the collectives then staging
CUDA tensors through host memory (``collectives.py``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.distributed.config import ParallelConfig

_ENV_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class WorldEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int | None = None  # ranks on this node (None: not told; then the whole world is assumed)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "WorldEnv":
        environ = os.environ if environ is None else environ
        missing = [k for k in (*_ENV_INTS, "MASTER_ADDR") if k not in environ and k != "LOCAL_RANK"]
        if missing:
            raise ValueError(f"{missing[0]}: not set; a multi-process world needs RANK, WORLD_SIZE, MASTER_ADDR, "
                             "MASTER_PORT (and LOCAL_RANK on multi-GPU nodes), as torchrun sets them")
        values = {}
        for k in _ENV_INTS:
            raw = environ.get(k, environ["RANK"] if k == "LOCAL_RANK" else None)
            try:
                values[k] = int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{k}: expected a non-negative integer, got {raw!r}") from None
        local_world = environ.get("LOCAL_WORLD_SIZE")
        try:
            local_world = None if local_world is None else int(local_world)
            if local_world is not None and local_world < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE: expected a positive integer, got {local_world!r}") from None
        env = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], environ["MASTER_ADDR"],
                  values["MASTER_PORT"], local_world)
        if not 0 <= env.rank < env.world_size:
            raise ValueError(f"RANK: must be in [0, WORLD_SIZE={env.world_size}), got {env.rank}")
        return env

    @property
    def ranks_on_node(self) -> int:
        """How many ranks share this rank's machine (what its CPU threads and devices are divided among)."""
        return self.local_world_size or self.world_size

    def as_environ(self) -> dict[str, str]:
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        if self.local_world_size is not None:
            out["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return out


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one rank of a world that a launcher (torchrun, a job scheduler's wrapper)
    describes in the environment, rather than the engine's own launch."""
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """One rank's place in the world and the groups its collectives run in (``None``: a group of one)."""

    config: ParallelConfig
    rank: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None  # the TP ranks of this rank's DP group
    ep_group: dist.ProcessGroup | None = None  # every rank, when expert parallel
    # The ranks with this rank's tp_rank in the DP groups of its CP group (context parallel; None: no CP).
    cp_group: dist.ProcessGroup | None = None
    # Sums over ranks in rank order (``collectives.all_reduce(ordered=True)``): DEEPINFER_BATCH_INVARIANT.
    ordered_sums: bool = False

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelContext":
        return cls(ParallelConfig(), 0, torch.device(device))

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def ep_size(self) -> int:
        return self.config.expert_parallel_size

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_size > 1 else 0

    @property
    def cp_size(self) -> int:
        return self.config.context_parallel_size

    @property
    def cp_rank(self) -> int:
        """This rank's place in its CP group (the DP groups of a CP group are consecutive)."""
        return self.dp_rank % self.cp_size

    def cp_global_rank(self, dp_rank: int) -> int:
        """The global rank of DP group ``dp_rank``'s member with this rank's tp_rank (a CP group peer)."""
        return dp_rank * self.tp_size + self.tp_rank


def init_world(config: ParallelConfig, device: str = "cpu", env: WorldEnv | None = None,
               timeout_s: float = 600.0, share_device: bool = False) -> ParallelContext:
    """Join the world described by ``env`` (default: the environment) and build the TP and EP groups.

    ``timeout_s`` bounds every collective: a rank that never arrives fails the others instead of hanging.
    ``share_device`` (``LaunchConfig.ranks_share_device``): every rank on CUDA device 0, over gloo."""
    env = env or WorldEnv.from_env()
    if env.world_size != config.world_size:
        raise ValueError(f"WORLD_SIZE: {env.world_size} processes, but tensor_parallel_size x data_parallel_size = "
                         f"{config.world_size}")
    if share_device:
        if device != "cuda":
            raise ValueError(f"ranks_share_device: puts every rank on one CUDA device, got device={device!r}; "
                             "allowed: device='cuda'")
        if env.ranks_on_node != env.world_size:
            raise ValueError(f"ranks_share_device: needs the whole world on one node, but this node runs "
                             f"{env.ranks_on_node} of {env.world_size} ranks (LOCAL_WORLD_SIZE)")
        if torch.cuda.device_count() < 1:
            raise ValueError("ranks_share_device: no CUDA device is visible")
        torch.cuda.set_device(0)
        dev, backend = torch.device("cuda", 0), "gloo"
    elif device == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK: {env.local_rank}, but this node has {torch.cuda.device_count()} visible "
                             "CUDA devices (one rank per device: start at most that many ranks per node)")
        torch.cuda.set_device(env.local_rank)
        dev, backend = torch.device("cuda", env.local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                                world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    tp = config.tensor_parallel_size
    tp_group = None
    for d in range(config.data_parallel_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(d * tp, (d + 1) * tp))) if tp > 1 else None
        if d == env.rank // tp:
            tp_group = group
    ep_group = dist.group.WORLD if config.expert_parallel_size > 1 else None
    cp, cp_group = config.context_parallel_size, None
    if cp > 1:  # CP group g, TP rank t: rank t of each of the DP groups g*cp .. g*cp + cp - 1
        for g in range(config.data_parallel_size // cp):
            for t in range(tp):
                ranks = [(g * cp + i) * tp + t for i in range(cp)]
                group = dist.new_group(ranks)
                if env.rank in ranks:
                    cp_group = group
    return ParallelContext(config, env.rank, dev, tp_group, ep_group, cp_group)


def free_port() -> int:
    """A free TCP port on this machine (for a world started here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
