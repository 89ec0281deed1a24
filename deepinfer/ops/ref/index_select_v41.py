"""DeepSeek-V4.1's two-level indexer selection over a step's key lists (spec §2.6); twin of
``ops/triton/index_select_v41.py``.

  select_entries(q [T, h, d], w [T, h], keys [Re, d], base [T], visible [T], width, topk, parts (a callable),
                 candidates [T, width] bool | None, publish (topk_blocks, block) | None)
      -> (rows [T, min(topk, width)] long, candidate mask [T, width] bool | None)

Query t's own sequence's index keys are rows base[t] .. base[t] + visible[t] - 1 of ``keys`` (slot j = its
sequence's entry j); slots at or past ``visible[t]`` are not its. Each visible slot scores
``weigh(q . k, w)``: ReLU, the head weight and the sum over heads in the activation dtype (the reference keeps
those roundings: "promoting them can change the discrete top-k"). With ``publish`` (the candidate source) the
candidate blocks of those scores are returned (``candidate_blocks``); with ``candidates`` (a re-indexing layer
after it) only the slots inside them compete. The chosen ``min(topk, width)`` slots come back as rows of
``keys``, ascending, with every -1 (a pick that was not a finite score) after them.

``parts()`` says how this reference walks the rows (``model/v41/select_lists.EntryLists.parts``): (rows, None)
gathers each query's slots (a copy of its keys per query), (rows, (first, count)) scores one run's rows
against its sequence's keys in one matmul, as ``Indexer.select`` does for one sequence (the same ops, so the
CPU engine's choices are the plain model's bit for bit). The kernel reads the keys in place for every row
and never calls ``parts`` (laying the walk out is host work per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weigh(dots: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dots [Q, heads, E] (queries . keys), w [Q, heads] -> scores [Q, E], in the activation dtype."""
    return (dots.relu() * w.unsqueeze(-1)).sum(dim=1)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """scores [Q, E] (-inf where not visible), visible [Q, 1] -> bool [Q, E]: entries in the top
    ``topk_blocks`` blocks of ``block`` entries by their best score, the block of the last visible entry
    always kept; blocks with no finite score never."""
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block), value=-torch.inf).unflatten(-1, (-1, block)).amax(dim=-1)
    return keep_blocks(blocks, (visible - 1) // block, topk_blocks).repeat_interleave(block, dim=-1)[..., :width]


def keep_blocks(blocks: torch.Tensor, last_block: torch.Tensor, topk_blocks: int) -> torch.Tensor:
    """Block maxima [Q, B] (-inf: no finite score), each query's last visible block [Q, 1] (-1: none) -> which
    blocks are candidates [Q, B] bool: the top ``topk_blocks`` by their maximum, the last visible one forced in."""
    ids = torch.arange(blocks.shape[-1], device=blocks.device)
    blocks = blocks.masked_fill(ids == last_block, torch.inf)
    chosen = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
    return torch.zeros_like(blocks, dtype=torch.bool).scatter(-1, chosen.indices, chosen.values > -torch.inf)


def _widen(t: torch.Tensor, width: int, fill) -> torch.Tensor:
    """[Q, n] -> [Q, width], the new columns ``fill``."""
    if t.shape[1] == width:
        return t
    return torch.cat((t, t.new_full((t.shape[0], width - t.shape[1]), fill)), dim=1)


def select_entries(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, base: torch.Tensor, visible: torch.Tensor,
                   width: int, topk: int, parts, candidates: torch.Tensor | None = None,
                   publish: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    k = min(topk, width)
    rows, published = [], []
    for part, run in parts():
        seen = visible[part].unsqueeze(-1)
        if run is None:  # each query's own sequence's keys gathered, slot j = its entry j
            first, n = base[part].unsqueeze(-1), width
            slots = torch.arange(n, device=q.device)
            allowed = slots < seen
            own = keys[torch.where(allowed, first + slots, 0)]  # a slot past the bound reads row 0, masked below
            dots = torch.einsum("shd,sed->she", q[part], own)
        else:  # one run's rows against its sequence's keys
            first, n = run
            allowed = torch.arange(n, device=q.device) < seen
            dots = torch.einsum("shd,td->sht", q[part], keys[first:first + n])
        scores = weigh(dots, w[part]).masked_fill(~allowed, -torch.inf)
        if publish is not None:
            published.append(_widen(candidate_blocks(scores, seen, *publish) & allowed, width, False))
        elif candidates is not None:
            scores = scores.masked_fill(~candidates[part, :n], -torch.inf)
        chosen = scores.topk(min(topk, n), dim=-1, sorted=False).indices
        ids = torch.where(torch.isfinite(scores.gather(-1, chosen)), chosen, n).sort(dim=-1).values
        rows.append(_widen(torch.where(ids < n, ids + first, -1), k, -1))
    return torch.cat(rows), torch.cat(published) if publish is not None else candidates
