"""DeepSeek-V4.1 on several ranks: data-parallel attention with expert-parallel MoE.

Each DP rank owns its sequences whole: embedding, Engram, mHC, CSA2 attention (its compressors, indexers and
their cache) and the head run on the rank's own tokens with the one-device code, unchanged. Only the MoE
crosses ranks: the routed experts are spread over all ranks in contiguous ranges (V4's ``expert_range``),
each rank routes its own tokens (the router and the shared expert are replicated) and exchanges the (token,
expert) pairs with the experts' ranks by V4's dispatch (``model/parallel/moe.ExpertDispatch``). The combine is
V4.1's own (``model/v41/moe.MoE``): the shared expert's output in fp32, each routed expert's output added in
fp32 times its weight in ascending expert order, one cast at the end. Every routed row is computed by the same
expert weights as on one device, so a token's output differs from the one-device model's only where a GEMM's
row result depends on the other rows of its batch (the CPU's float32 GEMMs may change a row's last bits with
the row count; the test states the bound).

Tensor parallelism of V4.1's attention (its heads split, the indexer and compressors replicated) is not
written: ``check_v41_parallel`` refuses it, as context parallelism and expert load balancing. A rank without
tokens runs ``empty_step`` so that its peers' dispatches find it (one MoE call per layer, as a step makes);
the DSpark drafter's MoE stays whole on every rank (speculative decoding with several ranks is refused).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.distributed.world import ParallelContext
from deepinfer.model.parallel.moe import ExpertDispatch, expert_groups, expert_range
from deepinfer.model.parallel.placement import static_placement
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.model.v41.moe import MoE
from deepinfer.ops.ref.moe import route


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

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
        """``MoE.forward``'s math with the routed experts on their ranks."""
        c = self.cfg
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        bias = torch.where(image_mask.unsqueeze(-1), self.gate.bias_vl, self.gate.bias)
        weights, indices = route(logits, "sqrtsoftplus", self.top_k, c.norm_topk_prob, c.routed_scaling_factor,
                                 bias=bias)
        out = self.shared_experts(x).float()
        expert, token, pair_weight, back = self._exchange(x, indices, weights, self._run_slots)
        for a, b in expert_groups(expert):  # ascending expert ids, as MoE.forward adds them
            out.index_add_(0, token[a:b], back[a:b].float() * pair_weight[a:b, None])
        return out.to(x.dtype)

    def _run_slots(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert, in the activation dtype (``Expert.forward``'s output)."""
        out = rows.new_empty(rows.shape)
        for s in torch.unique(local_ids).tolist():
            where = torch.where(local_ids == s)[0]  # the received order: source rank, then token
            out[where] = self.experts[s](rows[where])
        return out


def shard_v41(model: DeepseekV41, pctx: ParallelContext) -> DeepseekV41:
    """Keep this rank's experts of ``model`` (loaded whole) in place; records ``pctx`` as ``model.parallel``.
    Without expert parallelism every rank keeps the whole model (data parallelism alone)."""
    from deepinfer.config.v41_engine import check_v41_parallel

    c = pctx.config
    check_v41_parallel(tensor_parallel_size=c.tensor_parallel_size, data_parallel_size=c.data_parallel_size,
                       context_parallel_size=c.context_parallel_size)
    c.validate(model.cfg)  # type: ignore[arg-type]  # the experts spread evenly
    model.parallel = pctx
    if pctx.ep_size > 1:
        local = expert_range(pctx, model.cfg.n_routed_experts)
        for block in model.layers:
            block.ffn.__class__ = V41EPMoE
            block.ffn.became_sharded(pctx, local)
    return model


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
