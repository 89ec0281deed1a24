"""Tensor-parallel attention: each TP rank runs a whole number of output groups' query heads.

Split (``TPAttention.shards``): the query heads' up-projection ``wq_b`` and the per-head sinks by heads, the
grouped output projection ``wo_a`` by groups (its rows), ``wo_b`` by its input columns (row-parallel: each
rank's output is a partial sum, added up by one all-reduce over the TP group). Heads are split on whole
output groups because ``wo_a`` mixes the heads of a group: a rank must hold all of them.

Replicated, computed identically on every TP rank:
  * ``wq_a`` / ``q_norm``: the query latent feeds every head (low rank; splitting it would need a gather);
  * ``wkv`` / ``kv_norm``: V4 attention is MQA with one shared K=V latent head; every query head reads it,
    so there is nothing to split, and each rank keeps the whole cache of its sequences;
  * the compressors and the indexer: their entries and top-k picks are read by every head of the layer,
    and splitting the indexer's heads would need an all-reduce of its scores before the top-k.
"""

from __future__ import annotations

import torch

from deepinfer.distributed.collectives import all_reduce
from deepinfer.distributed.world import ParallelContext
from deepinfer.model.attention import Attention
from deepinfer.model.context import StepContext
from deepinfer.model.fused import StackedLinear, projection_sets
from deepinfer.model.shard import Shard
from deepinfer.model.rope import RopeTables


def head_shards(pctx: ParallelContext) -> dict[str, Shard]:
    """A tensor-parallel attention's cuts (V4's and V4.1's tensors share these names): the query heads (wq_b rows,
    the sinks) and the output groups (wo_a rows) by rank, wo_b by input columns."""
    rows, cols = Shard(0, pctx.tp_rank, pctx.tp_size), Shard(1, pctx.tp_rank, pctx.tp_size)
    return {"wq_b.weight": rows, "attn_sink": rows, "wo_a.weight": rows, "wo_b.weight": cols}


class TPAttention(Attention):
    """An ``Attention`` holding ``1/tp`` of the heads and groups; its output is summed over the TP group."""

    pctx: ParallelContext
    shards = staticmethod(head_shards)

    def became_sharded(self, pctx: ParallelContext) -> None:
        """Counts and stacks after the weights were cut (``model/parallel/shard.py``)."""
        self.pctx = pctx
        self.n_heads //= pctx.tp_size
        self.groups //= pctx.tp_size
        for attr, parts in projection_sets(self).items():  # column offsets of the (now smaller) stacks
            setattr(self, attr, StackedLinear.side_by_side(parts))

    def forward(self, x: torch.Tensor, ctx: StepContext, layer_key: str, ropes: RopeTables) -> torch.Tensor:
        return all_reduce(super().forward(x, ctx, layer_key, ropes), self.pctx.tp_group, self.pctx.ordered_sums)
