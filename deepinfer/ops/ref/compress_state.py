"""Compressor state write for a whole batch: every new token's kv and biased gate rows, in fp32.

The first half of the per-sequence ``write_state`` (tests/oracle/per_sequence.py), flattened over the batch: the caller has
already run the token's projections (on the device path one GEMM serves every compressor of the layer, so
the kv and gate columns of one compressor are a column range of a wider projection). Twin of
``ops/triton/compress_state.py`` (one kernel on the GPU instead of casts, a gather, an add and two scatters).

  compress_state(proj, col, state, rows, ape, positions) -> None
  proj       [T, C] in the model dtype; columns [col, col+S) = kv, [col+S, col+2S) = gate (before the bias)
  state      [R, 2S] fp32; row rows[t] receives [kv, gate + ape[positions[t] % m]]; no other row changes
  rows       [T] int row ids (padding tokens name a spare row)
  ape        [m, S] fp32 position bias within the window
  positions  [T] int absolute positions
"""

from __future__ import annotations

import torch


def check_compress_state_args(proj: torch.Tensor, col: int, state: torch.Tensor, rows: torch.Tensor,
                              ape: torch.Tensor, positions: torch.Tensor) -> int:
    """Shape checks shared by both twins -> S (columns per half)."""
    s = ape.shape[1]
    assert state.dim() == 2 and state.shape[1] == 2 * s and state.dtype == torch.float32, (
        f"state {tuple(state.shape)} {state.dtype}: want [R, {2 * s}] fp32")
    assert proj.dim() == 2 and 0 <= col and col + 2 * s <= proj.shape[1], f"proj {tuple(proj.shape)}, col {col}"
    assert rows.shape == positions.shape == (proj.shape[0],), f"rows {tuple(rows.shape)} positions {tuple(positions.shape)}"
    assert ape.dtype == torch.float32, f"ape must be fp32, got {ape.dtype}"
    return s


def compress_state(proj: torch.Tensor, col: int, state: torch.Tensor, rows: torch.Tensor, ape: torch.Tensor,
                   positions: torch.Tensor) -> None:
    s = check_compress_state_args(proj, col, state, rows, ape, positions)
    kv = proj[:, col : col + s].float()
    gate = proj[:, col + s : col + 2 * s].float() + ape[positions % ape.shape[0]]
    state.index_copy_(0, rows.long(), torch.cat([kv, gate], dim=1))
