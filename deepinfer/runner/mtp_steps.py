"""The MTP layer's two passes of a speculative step, head and draft pick included, as pure functions of device
tensors: what ``runner/mtp_graphs.py`` captures and what the eager path (CPU, GPU without graphs, steps no
graph fits) calls, so the two compute the same bits by construction.

  * ``rows_and_first_draft``: the MTP layer's attention half over every row of the step (filling its
    window), its FFN half, the head and the pick at each proposer's base row (its last emitted token,
    ``base_rows``: device values, since they depend on the step's accepted drafts).
  * ``chain_step``: one chained pass over single rows (the previous pass's streams and drafts), head and
    pick included. Its step index is built on the host at the positions of full acceptance and moved back
    by ``shift`` (accepted - drafts, <= 0) on the device, so the host never waits for the accepted counts.

Draft positions are the rows' positions + 2 (the MTP row at p reads token p + 1 and predicts p + 2).
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.step_index import StepIndex
from deepinfer.sampling.speculative import pick_drafts


def shifted(index: StepIndex, shift: torch.Tensor) -> StepIndex:
    """``index`` of single-token sequences (token i is sequence i, as ``build_slot_index`` and the chain
    buckets lay them out) with sequence i's position and length moved by ``shift[i]`` (padding: 0)."""
    return dataclasses.replace(index, positions=index.positions + shift, seq_end=index.seq_end + shift)


def rows_and_first_draft(model: DeepseekV4, storage: KVStorage, streams: torch.Tensor, next_ids: torch.Tensor,
                         index: StepIndex, base_rows: torch.Tensor, temperature: torch.Tensor,
                         seeds: torch.Tensor, sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP pass over the step's rows (target ``streams`` [T, hc, H], ``next_ids`` [T], the step's ``index``);
    returns the MTP streams at ``base_rows`` [n, hc, H] and the drafts picked there [n]. The other rows only
    fill the MTP layer's window, so the FFN half runs at the base rows alone."""
    x = model.mtp_forward(streams, next_ids, None, storage, index=index, rows=base_rows)
    drafts = pick_drafts(model.mtp_logits(x), temperature, seeds, index.positions[base_rows] + 2, sampled)
    return x, drafts


def chain_step(model: DeepseekV4, storage: KVStorage, x: torch.Tensor, drafts: torch.Tensor, index: StepIndex,
               shift: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
               sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chained pass: MTP rows fed ``x`` [n, hc, H] and the previous ``drafts`` [n] at the positions of
    ``index`` + ``shift``; returns (streams [n, hc, H], next drafts [n])."""
    index = shifted(index, shift)
    out = model.mtp_forward(x, drafts, None, storage, index=index)
    return out, pick_drafts(model.mtp_logits(out), temperature, seeds, index.positions + 2, sampled)
