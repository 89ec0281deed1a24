"""ParallelConfig: how many devices a model runs on and how its parts are split over them (vLLM's names).

  * ``tensor_parallel_size`` (TP): each attention layer's query heads are split over TP ranks (on whole
    output groups, ``o_groups``), and without expert parallelism every expert's intermediate dimension is
    split too; the partial outputs are summed by an all-reduce.
  * ``data_parallel_size`` (DP): DP groups of TP ranks each own their sequences and their cache
    (data-parallel attention).
  * ``enable_expert_parallel`` (EP): the routed experts are spread over all DP x TP ranks, whole; tokens go
    to their experts' ranks and come back (dispatch/combine). The shared expert is replicated.
  * ``context_parallel_size`` (CP): a prefill chunk of at least ``context_parallel_min_tokens`` tokens is
    split over this many DP ranks (consecutive DP groups form a CP group), its queries in a zigzag layout;
    its cache stays with the DP rank that owns the sequence (``model/parallel/context.py``). CP borrows DP
    ranks, so it adds no processes: it must divide ``data_parallel_size``.
World size = DP x TP; rank = dp_rank x TP + tp_rank (TP ranks of one DP group are neighbours, as on one node).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config.model import ModelConfig


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    context_parallel_size: int = 1
    # Chunks shorter than this run on their owner alone (the collectives would cost more than they save).
    context_parallel_min_tokens: int = 1024

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "context_parallel_size",
                     "context_parallel_min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel: must be true or false, got {self.enable_expert_parallel!r}")
        cp, dp = self.context_parallel_size, self.data_parallel_size
        if dp % cp:
            raise ValueError(
                f"context_parallel_size: {cp} does not divide data_parallel_size ({dp}); context parallelism "
                f"splits a long prefill over the data-parallel attention ranks; allowed: "
                f"{', '.join(map(str, _divisors(dp)))}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.world_size if self.enable_expert_parallel else 1

    @property
    def cp_min_chunk(self) -> int:
        """The shortest chunk split over the CP ranks: the threshold, and at least one token per zigzag piece."""
        return max(self.context_parallel_min_tokens, 2 * self.context_parallel_size)

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def validate(self, cfg: ModelConfig) -> "ParallelConfig":
        """Raise ValueError naming the field and the allowed values when ``cfg`` cannot be split this way."""
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp > 1:
            allowed = _divisors(cfg.o_groups)
            if cfg.o_groups % tp or cfg.num_attention_heads % tp:
                raise ValueError(
                    f"tensor_parallel_size: {tp} does not divide the model's o_groups ({cfg.o_groups}) and "
                    f"num_attention_heads ({cfg.num_attention_heads}); allowed: {', '.join(map(str, allowed))}")
            if not self.enable_expert_parallel and cfg.moe_intermediate_size % tp:
                allowed = [d for d in allowed if cfg.moe_intermediate_size % d == 0]
                raise ValueError(
                    f"tensor_parallel_size: {tp} does not divide moe_intermediate_size ({cfg.moe_intermediate_size}) "
                    f"(experts split by TP without enable_expert_parallel); allowed: {', '.join(map(str, allowed))}")
        if ep > 1 and cfg.n_routed_experts % ep:
            raise ValueError(
                f"enable_expert_parallel: {cfg.n_routed_experts} routed experts cannot be spread evenly over "
                f"{ep} ranks (data_parallel_size x tensor_parallel_size); allowed world sizes: "
                f"{', '.join(map(str, _divisors(cfg.n_routed_experts)))}")
        return self


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


DEFAULT_MASTER_PORT = 29500  # torchrun's default


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Where this process's ranks sit when the engine starts the world itself on several nodes (torchrun's
    names: ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``). The same command runs on every
    node with its own ``node_rank``; each node starts world_size / nnodes ranks, node n holding the global
    ranks [n * per_node, (n + 1) * per_node) (so a TP group of at most per_node ranks stays inside one node).
    Node 0's first rank is the engine (it serves); the other nodes only follow its steps.

    ``master_addr``/``master_port``: node 0's address, reachable from every node, and a free port there (the
    rendezvous of torch.distributed). On one node they default to loopback and a free port.

    ``ranks_share_device``: every rank of a one-node world runs on the same CUDA device (the first visible one)
    instead of one device each, and the model's collectives run over gloo, staged through host memory
    (``collectives.py``; NCCL refuses two ranks on one device). It rehearses the multi-GPU code path -- the
    sharded loading into the Triton layouts, the expert exchange, the TP sums, context parallelism -- on a
    machine with one GPU; it is slower than one process on that GPU, never a way to serve faster. Each rank's
    cache then sizes itself from its share of the device (``engine/sizing.py``)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    ranks_share_device: bool = False

    def __post_init__(self) -> None:
        for name in ("nnodes", "node_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "nnodes" else 0):
                kind = "a positive integer" if name == "nnodes" else "an integer >= 0"
                raise ValueError(f"{name}: must be {kind}, got {value!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank: must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.master_addr is not None and (not isinstance(self.master_addr, str) or not self.master_addr.strip()):
            raise ValueError(f"master_addr: must be a host name or IP address, got {self.master_addr!r}")
        port = self.master_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
            raise ValueError(f"master_port: must be a TCP port in [1, 65535], got {port!r}")
        if self.nnodes > 1 and self.master_addr is None:
            raise ValueError("master_addr: required with nnodes > 1 (the address of node 0, reachable from every "
                             "node)")
        if not isinstance(self.ranks_share_device, bool):
            raise ValueError(f"ranks_share_device: must be true or false, got {self.ranks_share_device!r}")
        if self.ranks_share_device and self.nnodes > 1:
            raise ValueError(f"ranks_share_device: every rank on one device needs a one-node world, got nnodes="
                             f"{self.nnodes}; allowed: nnodes=1 (or ranks_share_device=False)")

    @property
    def is_multi_node(self) -> bool:
        return self.nnodes > 1

    def validate(self, parallel: ParallelConfig) -> "LaunchConfig":
        """Every node holds the same number of ranks; raise ValueError naming the field otherwise."""
        world = parallel.world_size
        if world % self.nnodes:
            raise ValueError(
                f"nnodes: {world} ranks (tensor_parallel_size x data_parallel_size) cannot be split evenly over "
                f"{self.nnodes} nodes; allowed: {', '.join(map(str, _divisors(world)))}")
        if self.ranks_share_device and parallel.is_single:
            raise ValueError("ranks_share_device: needs several ranks (tensor_parallel_size x data_parallel_size "
                             "> 1) to share the device; one rank already runs the single-process engine")
        return self

    def check_shared_device(self, device: str, under_launcher: bool) -> None:
        """With ``ranks_share_device``: raise ValueError naming it unless the engine starts a CUDA world itself
        (``under_launcher``: torchrun or another launcher started this rank)."""
        if not self.ranks_share_device:
            return
        if device != "cuda":
            raise ValueError(f"ranks_share_device: puts every rank on one CUDA device; device={device!r} (on the "
                             "CPU the ranks already share the machine); allowed: device='cuda', or "
                             "ranks_share_device=False")
        if under_launcher:
            raise ValueError("ranks_share_device: the engine starts the ranks that share the device itself; under "
                             "torchrun (RANK, WORLD_SIZE in the environment) leave it out, or run without torchrun")

    def ranks_sharing_device(self, parallel: ParallelConfig) -> int:
        """How many ranks hold one device: the whole world with ``ranks_share_device``, else one."""
        return parallel.world_size if self.ranks_share_device else 1

    def ranks_per_node(self, parallel: ParallelConfig) -> int:
        return parallel.world_size // self.nnodes

    def node_ranks(self, parallel: ParallelConfig) -> range:
        """The global ranks this node starts."""
        per = self.ranks_per_node(parallel)
        return range(self.node_rank * per, (self.node_rank + 1) * per)
