"""DSpark blocks of many sequences at once, from device values only: the device build's drafting
(``runner/dspark.py``).

``DSpark.draft`` drafts one block from a sequence's context rows with its position p and anchor token as host
values, so the engine's reference path reads them back from the device after verification (p moves with the
accepted drafts). Here every input is a device tensor: p and the anchor token per block, and each block's
context as the W rows of positions p - W + 1 .. p (``valid`` marks the ones that exist: positions >= 0), so
the host never waits for the step's acceptance, as V4's MTP chain does not.

The arithmetic is ``draft``'s: embedding, the stages (``DSparkStage.run``), the final norm, the head, the
sequential Markov head and the confidence head; the draft pick is the MTP chain's ``pick_drafts`` (argmax for
greedy rows, argmax of logits / T plus the target's (seed, position) Gumbel noise for seeded ones: ``draft``'s
``noise`` formula, in the same float64 order). What differs is the attention's shape: each block row attends
to its block's listed keys (``DSparkAttention.block_lists``, ``ops.v41_attend_lists``), W context slots of
which those before position 0 are masked, where ``draft`` concatenates exactly the existing rows; the same keys
and formula, fp32 rounding apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.linear import Embedding, Linear
from deepinfer.model.v41 import mhc
from deepinfer.model.v41.dspark import DSpark
from deepinfer.model.v41.rope import angles
from deepinfer.sampling.speculative import pick_drafts


@dataclass(frozen=True, slots=True, eq=False)
class DraftRows:
    """Blocks of many sequences: draft k of block j is the guess for position p_j + k + 2."""

    tokens: torch.Tensor  # [m, B] int64
    confidence: torch.Tensor  # [m, B] fp32 in (0, 1): each draft's chance of acceptance given the ones before


def block_key_ids(valid: torch.Tensor, block: int) -> torch.Tensor:
    """valid [m, W] (which context slots exist) -> [m B, W + B]: each block row's keys as rows of the stacked
    context [m W, D] (-1 where a slot does not exist) followed by its block's B rows (m W + j B + b)."""
    m, w = valid.shape
    dev = valid.device
    owner = torch.arange(m, device=dev).repeat_interleave(block).unsqueeze(1)  # each block row's block
    ctx = torch.where(valid.repeat_interleave(block, dim=0), owner * w + torch.arange(w, device=dev), -1)
    return torch.cat((ctx, m * w + owner * block + torch.arange(block, device=dev)), dim=1)


@torch.no_grad()
def draft_lists(mtp: DSpark, embed: Embedding, head: Linear, context: list[torch.Tensor], valid: torch.Tensor,
                p: torch.Tensor, token: torch.Tensor, cache_qdq: bool, temperature: torch.Tensor,
                seeds: torch.Tensor, sampled: bool) -> DraftRows:
    """The blocks after positions ``p`` [m] (int64) of m sequences whose target drew ``token`` [m] there.
    ``context``: per stage [m W, D], block j's rows of positions p_j - W + 1 .. p_j at j W .. (j + 1) W - 1,
    ``valid`` [m, W] which of them exist; ``temperature`` [m] float64 / ``seeds`` [m] int64: each sequence's
    draft pick (``pick_drafts``; ``sampled``: some row may be seeded, host knowledge)."""
    cfg, d = mtp.cfg, mtp.cfg.dspark
    m, block = p.shape[0], d.block_size
    if len(context) != len(mtp) or valid.shape != (m, cfg.sliding_window):
        raise ValueError(f"context: expected {len(mtp)} stages and valid [{m}, {cfg.sliding_window}], got "
                         f"{len(context)} and {tuple(valid.shape)}")
    dev = p.device
    positions = p.unsqueeze(1) + 1 + torch.arange(block, device=dev)  # [m, B]: the block rows' positions
    ang = angles(cfg.main_rope, positions.flatten())
    ids = torch.full((m, block), d.noise_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = token
    x = embed(ids.flatten())
    streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1)
    pre = mhc.one_hot_pre(m * block, cfg.hc_mult, dev)
    key_ids = block_key_ids(valid, block)
    for stage, rows in zip(mtp, context):
        streams, pre = stage.run(streams, pre, lambda h, s=stage, r=rows: s.attn.block_lists(h, ang, r, key_ids,
                                                                                           cache_qdq))
    last = mtp[-1]
    hidden = mhc.collapse(streams, pre)
    normed = last.norm(hidden)
    base = head(normed.float()).unflatten(0, (m, block))
    conf_in = (hidden if d.confidence_input == "hidden" else normed).unflatten(0, (m, block))
    tokens = torch.empty(m, block, dtype=torch.long, device=dev)
    conf = torch.empty(m, block, dtype=torch.float32, device=dev)
    previous = token
    for k in range(block):  # sequential through the Markov head only, as ``draft``
        bias, code = last.markov_head(previous)
        logits = (base[:, k] + bias).to(base.dtype)
        conf[:, k] = last.confidence_head(conf_in[:, k], code)
        # Draft k is the token of position p + k + 2: the target's noise key there.
        tokens[:, k] = pick_drafts(logits, temperature, seeds, positions[:, k] + 1, sampled)
        previous = tokens[:, k]
    return DraftRows(tokens, torch.sigmoid(conf))
