"""DeepSeek-V4.1 on several ranks: data-parallel attention, tensor-parallel attention heads, and expert-parallel
or tensor-parallel MoE, cut as V4's (``model/parallel/``).

Each DP group owns its sequences whole: embedding, Engram, mHC, the CSA2 cache (window rows, compressors,
indexers, whose entries and top-k every head reads) and the head run on the group's tokens with the one-device
code. With tensor parallelism (``V41TPAttention``) a TP rank holds whole output groups of query heads
(``wq_b`` rows, sinks, ``wo_a`` rows) and ``wo_b``'s matching input columns: its output is a partial sum, added
up by one all-reduce over the TP group per layer; the rest of the attention is replicated, as in V4
(``model/parallel/attention.py``). The MoE: with expert parallelism the routed experts are spread over all
ranks in contiguous ranges (V4's ``expert_range``); each rank routes the tokens (the router and the shared
expert are replicated), the TP ranks of a DP group each dispatching a contiguous 1/TP of them, and exchanges
the (token, expert) pairs with the experts' ranks by V4's dispatch (``model/parallel/moe.ExpertDispatch``);
the TP ranks all-gather their token slices back. The expert-parallel combine is V4.1's own
(``model/v41/moe.MoE``): the shared expert's output in fp32, each routed expert's output added in fp32 times its
weight in ascending expert order, one cast at the end; every routed row is computed by the same expert weights
as on one device, so a token's output differs from the one-device model's only where a GEMM's row result depends
on the other rows of its batch (the CPU's float32 GEMMs may change a row's last bits with the row count; its
bfloat16 ones do not: bit-equal there). Without expert parallelism TP splits every expert's intermediate
dimension (``V41TPMoE``: the SwiGLU is element-wise there), summed by an all-reduce, as the heads: another
summation order than one device's (the tests state the bound).

Context parallelism and expert load balancing are not written (``check_v41_parallel`` and ``check_v41_ranks``
refuse them). A rank without tokens runs ``empty_step`` so that its peers' dispatches find it (one MoE call
per layer, as a step makes; the TP ranks of a DP group share its empty batch, so their all-reduces need no
call); the DSpark drafter stays whole on every rank (speculative decoding with several ranks is refused).
A rank's load (``load_v41_model(..., keep=shard_v41)``) cuts the freshly built model before reading anything and
reads only the tensors it holds, each cut as ``shard_v41`` cut it (``held_slice``): bit for bit the share of a
model loaded whole and then cut (the test's oracle). The cut slices the dequantized tensor (the CPU path keeps no
codes), so a rank reads a TP-split tensor whole before keeping its slice.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer.distributed.collectives import all_gather_rows, all_reduce
from deepinfer.distributed.world import ParallelContext
from deepinfer.model.linear import Linear
from deepinfer.model.parallel.attention import head_shards
from deepinfer.model.parallel.moe import ExpertDispatch, expert_groups, expert_range
from deepinfer.model.parallel.placement import static_placement
from deepinfer.model.parallel.slices import take
from deepinfer.model.shard import Shard
from deepinfer.model.v41.attention import Attention
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.model.v41.moe import MoE


class V41TPAttention(Attention):
    """An ``Attention`` holding ``1/tp`` of the query heads and output groups; its output is summed over the TP
    group (``_output`` is where both the plain forward and the engine's step, ``paged.py``, end a layer)."""

    pctx: ParallelContext
    shards = staticmethod(head_shards)

    def became_sharded(self, pctx: ParallelContext) -> None:
        self.pctx = pctx
        self.heads //= pctx.tp_size
        self.groups //= pctx.tp_size

    def _output(self, out: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
        return all_reduce(super()._output(out, ang), self.pctx.tp_group, self.pctx.ordered_sums)


class V41TPMoE(MoE):
    """Every routed and the shared expert hold ``1/tp`` of their intermediate dimension (w1/w3 rows, w2 columns);
    the layer's output (shared + routed partial sums) is summed over the TP group."""

    pctx: ParallelContext

    @staticmethod
    def shards(pctx: ParallelContext, n_experts: int) -> dict[str, Shard]:
        rows, cols = Shard(0, pctx.tp_rank, pctx.tp_size), Shard(1, pctx.tp_rank, pctx.tp_size)
        owners = [f"experts.{e}" for e in range(n_experts)] + ["shared_experts"]
        return {f"{o}.{w}.weight": spec for o in owners for w, spec in (("w1", rows), ("w3", rows), ("w2", cols))}

    def became_sharded(self, pctx: ParallelContext) -> None:
        if self.routed is not None:
            raise ValueError("tensor_parallel_size: DeepSeek-V4.1's fused device experts are not split over ranks "
                             "yet; allowed: device='cpu'")
        self.pctx = pctx

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x, image_mask), self.pctx.tp_group, self.pctx.ordered_sums)


class V41EPMoE(ExpertDispatch, MoE):
    """A V4.1 MoE holding the experts of ``expert_range`` as ``experts[0..n)``; its routed pairs go to their
    experts' ranks and come back (``ExpertDispatch``)."""

    first_expert: int

    def became_sharded(self, pctx: ParallelContext, local: range) -> None:
        if self.routed is not None:
            raise ValueError("enable_expert_parallel: DeepSeek-V4.1's fused device experts are not split over "
                             "ranks yet; allowed: device='cpu'")
        self.pctx, self.first_expert = pctx, local.start
        self.experts = nn.ModuleList(self.experts[e] for e in local)
        self.load, self.layer_index = None, 0
        self.set_placement(static_placement(self.cfg.n_routed_experts, pctx.ep_size))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        """``MoE.forward``'s math with the routed experts on their ranks."""
        weights, indices = self.select(x, image_mask)
        # The TP ranks of a DP group hold the same tokens: each takes a contiguous 1/TP of them.
        p = self.pctx
        sizes = [len(c) for c in torch.arange(len(x)).tensor_split(p.tp_size)]
        start = sum(sizes[: p.tp_rank])
        mine = slice(start, start + sizes[p.tp_rank])
        x, indices, weights = x[mine], indices[mine], weights[mine]
        out = self.shared_experts(x).float()
        expert, token, pair_weight, back = self._exchange(x, indices, weights, self._run_slots)
        for a, b in expert_groups(expert):  # ascending expert ids, as MoE.forward adds them
            out.index_add_(0, token[a:b], back[a:b].float() * pair_weight[a:b, None])
        return all_gather_rows(out.to(x.dtype), sizes, p.tp_group)

    def _run_slots(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert, in the activation dtype (``Expert.forward``'s output)."""
        out = rows.new_empty(rows.shape)
        for s in torch.unique(local_ids).tolist():
            where = torch.where(local_ids == s)[0]  # the received order: source rank, then token
            out[where] = self.experts[s](rows[where])
        return out


def shard_v41(model: DeepseekV41, pctx: ParallelContext) -> DeepseekV41:
    """Keep this rank's share of ``model`` (loaded whole) in place: its heads with tensor parallelism, its experts
    with expert parallelism (else their TP slices); records ``pctx`` as ``model.parallel``. Data parallelism
    alone keeps the whole model."""
    from deepinfer.config.v41_engine import check_v41_parallel

    c = pctx.config
    check_v41_parallel(tensor_parallel_size=c.tensor_parallel_size, data_parallel_size=c.data_parallel_size,
                       context_parallel_size=c.context_parallel_size)
    c.validate(model.cfg)  # type: ignore[arg-type]  # heads, groups, experts and their width split evenly
    model.parallel = pctx
    n_experts = model.cfg.n_routed_experts
    for i, block in enumerate(model.layers):
        if pctx.tp_size > 1:
            _cut(block.attn, f"layers.{i}.attn", V41TPAttention.shards(pctx))
            block.attn.__class__ = V41TPAttention
            block.attn.became_sharded(pctx)
        if pctx.ep_size > 1:
            local = expert_range(pctx, n_experts)
            block.ffn.__class__ = V41EPMoE
            block.ffn.became_sharded(pctx, local)
            block.ffn.owned_experts = local  # what a sliced load reads, into experts[0..n) (``held_slice``)
        elif pctx.tp_size > 1:
            _cut(block.ffn, f"layers.{i}.ffn", V41TPMoE.shards(pctx, n_experts))
            block.ffn.__class__ = V41TPMoE
            block.ffn.became_sharded(pctx)
    return model


def _cut(module: nn.Module, prefix: str, specs: dict[str, Shard]) -> None:
    """Replace each named parameter by this rank's slice (``model/parallel/slices.take``, as V4's cut)."""
    for rel, spec in specs.items():
        owner_name, _, attr = rel.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        piece = take(getattr(owner, attr).detach(), spec, f"{prefix}.{rel}")
        owner._parameters[attr] = nn.Parameter(piece, requires_grad=False)
        if isinstance(owner, Linear):
            owner.out_features, owner.in_features = piece.shape
        owner.param_shards = {**getattr(owner, "param_shards", {}), attr: spec}  # what a sliced load cuts


_EXPERT = re.compile(r"^(layers\.\d+\.ffn)\.experts\.(\d+)\.(.+)$")


def held_slice(model: DeepseekV41, name: str) -> tuple[str, Shard | None] | None:
    """Where checkpoint tensor ``name`` (its global name) lives in a model ``shard_v41`` cut: its local name and
    the slice of it the rank holds (None: all of it), or None when another rank holds it (an expert)."""
    m = _EXPERT.match(name)
    if m is not None:
        owned = getattr(model.get_submodule(m[1]), "owned_experts", None)
        if owned is not None:
            if int(m[2]) not in owned:
                return None
            name = f"{m[1]}.experts.{int(m[2]) - owned.start}.{m[3]}"
    owner_name, _, attr = name.rpartition(".")
    return name, getattr(model.get_submodule(owner_name), "param_shards", {}).get(attr)


def needs_empty_steps(model: DeepseekV41) -> bool:
    """Whether a rank without tokens must still join its layers' expert exchanges."""
    pctx = getattr(model, "parallel", None)
    return pctx is not None and pctx.ep_size > 1


@torch.no_grad()
def empty_step(model: DeepseekV41) -> None:
    """A step without tokens: every layer's MoE with zero rows (attention needs nothing from the other ranks)."""
    device = model.parallel.device
    x = torch.empty(0, model.cfg.hidden_size, dtype=model.dtype, device=device)
    mask = torch.empty(0, dtype=torch.bool, device=device)
    for block in model.layers:
        block.ffn(x, mask)
