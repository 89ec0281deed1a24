"""Compressor emit for a whole batch: gather each closing window's slots, pool, normalise, rotate, store.

This is the per-sequence ``emit`` (tests/oracle/per_sequence.py) flattened over the batch, so one call (and on the GPU one
kernel, ``ops/triton/compress_emit.py``, same signature) serves every sequence of a step, with the slot
row ids precomputed by the caller instead of per-sequence position arithmetic.

Contract::

  compress_emit(state, slot_rows, entry_rows, out, norm_weight, eps, cos, sin, overlap) -> None
  state       [R, 2*S] fp32: one row per absolute position of a sequence (paged; rows addressed by id).
              overlap=False (HCA): S = W; columns [0:W] = kv, [W:2W] = gate (position bias already added).
              overlap=True  (CSA): S = 2W; columns [0:W] = kv "Ca", [W:2W] = kv "Cb",
                                   [2W:3W] = gate "Ca", [3W:4W] = gate "Cb".
  slot_rows   [T, NS] int32/int64 row ids into state; -1 = empty slot (kv 0, gate -inf -> weight 0).
              overlap=False: NS = m, every slot uses kv cols [0:W], gate cols [W:2W].
              overlap=True:  NS = 2m, slots 0..m-1 use the Ca halves (kv [0:W], gate [2W:3W]) -- the
                             previous window's positions, all -1 for window 0 -- and slots m..2m-1 the Cb
                             halves (kv [W:2W], gate [3W:4W]) of the window's own positions.
  entry_rows  [T] int row ids into out; -1 = token t closes no window (nothing read, nothing written).
  out         [R2, W] in the model dtype; row entry_rows[t] receives token t's entry, no other row changes.
  norm_weight [W] (fp32 or model dtype), eps float
  cos, sin    [T, rope_dim/2] in the model dtype: the RoPE angles at each emitting window's start position.

Per emitting token t: kv, gate [NS, W] gathered from the slots; entry = pool_windows(kv, gate, ...) (per
channel softmax over slots, weights and products in out.dtype, RMSNorm); entry = apply_rope(entry, cos[t],
sin[t]); out[entry_rows[t]] = entry. Rows of non-emitting tokens (padding in a captured batch) may hold
anything, including ids of rows that do not exist: they are never read.

This reference selects the emitting tokens with boolean indexing (a host sync); it is the CPU path.
"""

from __future__ import annotations

import torch

from deepinfer.ops.ref.compressor import pool_windows
from deepinfer.ops.ref.rope import apply_rope


def check_compress_emit_args(state: torch.Tensor, slot_rows: torch.Tensor, entry_rows: torch.Tensor,
                             out: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             overlap: bool) -> tuple[int, int, int]:
    """Shape checks shared by both twins (shapes only: nothing here reads device data) -> (W, NS, rope_dim)."""
    w = out.shape[1]
    s = 2 * w if overlap else w
    t, ns = slot_rows.shape
    rope_dim = 2 * cos.shape[-1]
    assert state.dim() == 2 and state.shape[1] == 2 * s and state.dtype == torch.float32, (
        f"state {tuple(state.shape)} {state.dtype}: want [R, {2 * s}] fp32")
    assert not overlap or ns % 2 == 0, f"overlap needs an even slot count (m Ca + m Cb), got {ns}"
    assert entry_rows.shape == (t,), f"entry_rows {tuple(entry_rows.shape)}, want ({t},)"
    assert norm_weight.shape == (w,), f"norm_weight {tuple(norm_weight.shape)}, want ({w},)"
    assert cos.shape == sin.shape == (t, rope_dim // 2), f"cos {tuple(cos.shape)} sin {tuple(sin.shape)}"
    assert 0 < rope_dim <= w and w % 2 == 0, f"rope_dim {rope_dim} must fit in W {w} (pairs)"
    assert not slot_rows.is_floating_point() and not entry_rows.is_floating_point()
    return w, ns, rope_dim


def gather_slots(state: torch.Tensor, slots: torch.Tensor, width: int, overlap: bool):
    """slots [E, NS] row ids (-1 empty) -> kv [E, NS, W] fp32 (0 where empty), gate [E, NS, W] (-inf)."""
    w = width
    present = (slots >= 0)[..., None]
    rows = state[slots.clamp(min=0).long()]  # [E, NS, 2S]; empty slots read row 0, masked below
    if overlap:
        m = slots.shape[1] // 2
        kv = torch.cat([rows[:, :m, 0:w], rows[:, m:, w:2 * w]], dim=1)
        gate = torch.cat([rows[:, :m, 2 * w:3 * w], rows[:, m:, 3 * w:4 * w]], dim=1)
    else:
        kv, gate = rows[..., :w], rows[..., w:2 * w]
    # masked_fill, not a multiply: whatever an unused row holds (even NaN) never reaches the result.
    return kv.masked_fill(~present, 0.0), gate.masked_fill(~present, float("-inf"))


def compress_emit(state: torch.Tensor, slot_rows: torch.Tensor, entry_rows: torch.Tensor, out: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  overlap: bool, *, pool=pool_windows) -> None:
    """Write the entry of every window closed by a token of the batch into ``out`` (see module docstring).
    ``pool``: the window pooling (the batch-invariant table passes its ordered-sum twin of ``pool_windows``)."""
    w, _, _ = check_compress_emit_args(state, slot_rows, entry_rows, out, norm_weight, cos, sin, overlap)
    emitting = entry_rows >= 0
    kv, gate = gather_slots(state, slot_rows[emitting], w, overlap)
    entries = pool(kv, gate, norm_weight, eps, out.dtype)
    entries = apply_rope(entries, cos[emitting], sin[emitting])
    out[entry_rows[emitting].long()] = entries
