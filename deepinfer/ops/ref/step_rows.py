"""A step's cache row lists from its index tensors (``model/step_index.py``), in plain PyTorch; twin of
``ops/triton/step_rows.py`` (one launch instead of this path's ~100 tiny kernels per step).

Inputs (device tensors, int64): token_seq [T] (the table row of each token), positions [T], the block
tables window_table / state_table / history_table [B, blocks] (-1: released or past the end) and seq_end [B]
(positions each sequence covers after the step); ints: span (positions the entry lists cover), block_size,
window, spare_window / spare_state (rows padding tokens write to); kinds: the (ratio m, overlap) of the
compressed layers. Output: (window_rows [T] int64, state_rows [T] int64, window_keys [T, window] int32,
one ``KindRows`` per kind). What each list means: ``model/step_index.py`` (``StepRows``, ``CompressIndex``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KindRows(NamedTuple):
    limits: torch.Tensor  # [T] int32
    slot_rows: torch.Tensor  # [T, m or 2m] int32
    entry_rows: torch.Tensor  # [T] int64
    emit_pos: torch.Tensor  # [T] int64
    seq_rows: torch.Tensor  # [B, max(ceil(span / m), 1)] int32
    visible_rows: torch.Tensor | None  # HCA (no overlap): [T, max(ceil(span / m), 1)] int32; CSA: None


def lookup(table: torch.Tensor, seq: torch.Tensor, p: torch.Tensor, per_block: int) -> torch.Tensor:
    """Row of position p (any shape, one sequence per leading row) through a block table; -1 where p < 0
    or its block is -1."""
    s = seq.view(-1, *([1] * (p.dim() - 1)))
    blocks = table[s, (p // per_block).clamp(0, table.shape[1] - 1)]
    return torch.where((p >= 0) & (blocks >= 0), blocks * per_block + p % per_block, -1)


def step_rows(token_seq: torch.Tensor, positions: torch.Tensor, window_table: torch.Tensor,
              state_table: torch.Tensor, history_table: torch.Tensor, seq_end: torch.Tensor, span: int,
              block_size: int, window: int, kinds: tuple[tuple[int, bool], ...], spare_window: int,
              spare_state: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[KindRows]]:
    seq, pos, bs = token_seq, positions, block_size
    dev = pos.device
    window_rows = lookup(window_table, seq, pos, bs)
    state_rows = lookup(state_table, seq, pos, bs)
    kp = pos[:, None] - window + 1 + torch.arange(window, device=dev)
    per_kind = []
    for m, overlap in kinds:
        closes = (pos + 1) % m == 0
        w = torch.where(closes, (pos + 1) // m - 1, -1)
        own = w[:, None] * m + torch.arange(m, device=dev)
        slots = torch.cat([own - m, own], dim=1) if overlap else own
        slots = torch.where(closes[:, None], slots, -1)
        j = torch.arange(max(-(-span // m), 1), device=dev)
        seqs = torch.arange(history_table.shape[0], device=dev)
        seq_rows = lookup(history_table, seqs, j.expand(len(seqs), -1), bs // m)
        seq_rows = torch.where(j[None, :] < (seq_end // m)[:, None], seq_rows, -1).to(torch.int32)
        limits = ((pos + 1) // m).to(torch.int32)
        # HCA layers attend every visible entry: one list per step serves all of them.
        visible = None if overlap else torch.where(j[None, :] < limits[:, None], seq_rows[seq], -1)
        per_kind.append(KindRows(limits, lookup(state_table, seq, slots, bs).to(torch.int32),
                                 lookup(history_table, seq, w, bs // m), torch.where(closes, w * m, 0), seq_rows,
                                 visible))
    return (torch.where(window_rows >= 0, window_rows, spare_window),
            torch.where(state_rows >= 0, state_rows, spare_state),
            lookup(window_table, seq, kp, bs).to(torch.int32), per_kind)
