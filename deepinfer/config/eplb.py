"""Expert-parallel load balancing (EPLB) settings: ``enable_eplb=True`` with ``eplb_config={...}``.

vLLM's spelling and defaults (``--enable-eplb --eplb-config '{"num_redundant_experts": N, ...}'``):
  * ``num_redundant_experts``: physical expert slots beyond the logical experts, over all EP ranks; hot
    experts get that many extra replicas, and each rank holds (experts + redundant) / ranks slots;
  * ``window_size``: the per-expert load counters cover the last this-many engine steps;
  * ``step_interval``: every this-many steps the engine re-places the experts from the window's loads;
  * ``log_balancedness``: log the balancedness (mean / max tokens per rank) before and after each re-placement.
What the rebalance does is in ``model/parallel/eplb.py`` and ``executor/eplb.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.config.json_object import json_object

_FIELDS = ("num_redundant_experts", "window_size", "step_interval", "log_balancedness")


@dataclass(frozen=True, slots=True)
class EplbConfig:
    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000
    log_balancedness: bool = False

    def __post_init__(self) -> None:
        n = self.num_redundant_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"eplb_config.num_redundant_experts: must be an integer >= 0, got {n!r}")
        for name in ("window_size", "step_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"eplb_config.{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.log_balancedness, bool):
            raise ValueError(f"eplb_config.log_balancedness: must be true or false, got {self.log_balancedness!r}")

    @classmethod
    def parse(cls, value: Any) -> "EplbConfig":
        """A dict, its JSON text, an instance, or None (the defaults). Errors name the field."""
        if value is None:
            return cls()
        if isinstance(value, EplbConfig):
            return value
        return cls(**json_object(value, "eplb_config", _FIELDS,
                                 '{"num_redundant_experts": 2, "step_interval": 3000}'))

    def validate(self, num_experts: int, ep_size: int) -> "EplbConfig":
        """Every EP rank holds the same number of slots: (experts + redundant) must divide by the EP size
        (the experts already do, so the redundant slots must too)."""
        if self.num_redundant_experts % ep_size:
            raise ValueError(
                f"eplb_config.num_redundant_experts: {self.num_redundant_experts} cannot be spread evenly over "
                f"{ep_size} expert-parallel ranks ({num_experts} experts + redundant slots must divide by the "
                f"ranks); allowed: multiples of {ep_size}")
        return self
