"""Per-expert load counters of one rank, on its device: no host sync per step (read at rebalance time only).

  * ``logical`` [layers, window, experts]: the (token, expert) pairs this rank's tokens routed to each logical
    expert, one row per engine step over the last ``window`` steps (a ring; ``advance`` starts a step's row).
    The rebalance sums them over the window and over the ranks (each token is counted once: by the rank
    that dispatches it, the TP ranks of a DP group each counting their own slice).
  * ``physical`` [layers, slots]: the rows this rank sent to each physical slot since the placement was last
    set, i.e. what each slot's rank computed under the current placement: the measured effect of it.
"""

from __future__ import annotations

import torch


class ExpertLoadWindow:
    def __init__(self, num_layers: int, num_experts: int, num_slots: int, window: int,
                 device: torch.device) -> None:
        # int32: a step's count per expert is below 2**31 by far; a V4-Flash rank's default 1000-step
        # window is 43 x 1000 x 256 x 4 bytes = 44 MB.
        self.logical = torch.zeros(num_layers, window, num_experts, dtype=torch.int32, device=device)
        self.physical = torch.zeros(num_layers, num_slots, dtype=torch.int64, device=device)
        self.cursor = 0

    def advance(self) -> None:
        """A new engine step: its row replaces the oldest one in the window."""
        self.cursor = (self.cursor + 1) % self.logical.shape[1]
        self.logical[:, self.cursor].zero_()

    def record(self, layer: int, experts: torch.Tensor, slots: torch.Tensor) -> None:
        """One MoE forward's pairs: their logical experts and the physical slots they were sent to."""
        if len(experts) == 0:
            return
        self.logical[layer, self.cursor].index_add_(0, experts, torch.ones_like(experts, dtype=torch.int32))
        self.physical[layer].index_add_(0, slots, torch.ones_like(slots))

    def window_loads(self) -> list[list[int]]:
        """[layer][expert]: pairs routed over the window (a host copy)."""
        return self.logical.sum(dim=1).tolist()

    def slot_loads(self) -> list[list[int]]:
        """[layer][slot]: pairs sent to each slot since the placement was set (a host copy)."""
        return self.physical.tolist()

    def placement_changed(self) -> None:
        self.physical.zero_()

    def clear(self) -> None:
        """Forget every count (the window starts again at its first row)."""
        self.logical.zero_()
        self.physical.zero_()
        self.cursor = 0
