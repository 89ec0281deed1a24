"""ParallelConfig: how many devices a model runs on and how its parts are split over them (vLLM's names).

  * ``tensor_parallel_size`` (TP): each attention layer's query heads are split over TP ranks (on whole
    output groups, ``o_groups``), and without expert parallelism every expert's intermediate dimension is
    split too; the partial outputs are summed by an all-reduce.
  * ``data_parallel_size`` (DP): DP groups of TP ranks each own their sequences and their cache
    (data-parallel attention).
  * ``enable_expert_parallel`` (EP): the routed experts are spread over all DP x TP ranks, whole; tokens go
    to their experts' ranks and come back (dispatch/combine). The shared expert is replicated.
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

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel: must be true or false, got {self.enable_expert_parallel!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.world_size if self.enable_expert_parallel else 1

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
