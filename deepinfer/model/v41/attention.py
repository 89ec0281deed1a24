"""V4.1 CSA2 attention (spec §2.4-§2.7): shared-KV MQA over a sliding window plus, for layers with ratio > 0,
the top-k compressed entries of the layer's KV source, with a per-head sink.

Layer roles: window-only (ratio 0); Full (a KV source: compressor, index keys, indexer); Reindex (its own
indexer queries over the source's keys, restricted to the candidate blocks when after the candidate
source); Reuse (reads the latest source's entries and the latest index source's top-k). No per-head q norm,
no ape bias, disjoint compression groups (ratio 2: a channel-wise softmax pool of two tokens; ratio 1: one
entry per token). The computation is dense over the cached positions (this is the reference path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config.v41 import V41Config, V41LayerRole
from deepinfer.model.linear import Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.model.v41.cache import LayerCache, write_rows
from deepinfer.model.v41.context import SharedKV, StepContext
from deepinfer.model.v41.rope import angles as rope_angles
from deepinfer.ops.ref.index_select_v41 import candidate_blocks, weigh
from deepinfer.ops.table import REF, OpTable


class Compressor(nn.Module):
    """``attn.compressor.``: wkv [D, H], wgate [D, H] (ratio 2 only), norm [D]. Weights are kept in fp32:
    the ratio-2 pool runs in fp32 (bf16 weights upcast); ratio 1 projects in the activation dtype."""

    def __init__(self, cfg: V41Config, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim, dtype=torch.float32)
        if ratio > 1:
            self.wgate = Linear(cfg.hidden_size, cfg.head_dim, dtype=torch.float32)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext, lc: LayerCache) -> torch.Tensor:
        """The step's new entries before rope [n_new, D]: entry j exists once token (j + 1) * r - 1 is in."""
        if self.ratio == 1:
            return self.norm(F.linear(x, self.wkv.weight.to(x.dtype)))
        lc.gate_kv = write_rows(lc.gate_kv, ctx.start, F.linear(x.float(), self.wkv.weight.float()))
        lc.gate_score = write_rows(lc.gate_score, ctx.start, F.linear(x.float(), self.wgate.weight.float()))
        first, last = ctx.start // self.ratio, ctx.end // self.ratio
        rows = slice(first * self.ratio, last * self.ratio)
        values = lc.gate_kv[rows].unflatten(0, (-1, self.ratio))
        scores = lc.gate_score[rows].unflatten(0, (-1, self.ratio))
        return self.norm((values * scores.softmax(dim=1)).sum(dim=1).to(x.dtype))


class Indexer(nn.Module):
    """``attn.indexer.``: wq_b [heads * d, q_lora], weights_proj [heads, H]; KV sources also wk [d, D] and
    k_norm [d] (the index keys of their entries)."""

    # The RoPE, cache-rounding and (engine step) selection ops (``ops.v41_rope``, ``ops.v41_qdq``,
    # ``ops.v41_index_select``): the device build sets the device's table.
    ops: OpTable = REF

    def __init__(self, cfg: V41Config, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        role = cfg.role(layer)
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.owns_keys, self.candidate_source = role.kv_source, role.candidate_source
        self.uses_candidates = role.uses_candidates
        self.topk_blocks, self.block = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, dtype=dtype)
        if self.owns_keys:
            self.wk = Linear(cfg.head_dim, self.dim, dtype=dtype)
            self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps)

    def keys(self, latent: torch.Tensor, ang: torch.Tensor, do_qdq: bool) -> torch.Tensor:
        k = self.ops.v41_rope(self.k_norm(self.wk(latent)), ang)
        return self.ops.v41_qdq(k, "mxfp4") if do_qdq else k

    def queries(self, x: torch.Tensor, qr: torch.Tensor, ang: torch.Tensor, cache_qdq: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [Q, H], qr [Q, q_lora] -> the rope'd index queries [Q, heads, d] (MXFP4-rounded with ``cache_qdq``)
        and the head weights [Q, heads]: row by row, so any batch of rows gives each row the same values."""
        q = self.ops.v41_rope(self.wq_b(qr).unflatten(-1, (self.heads, self.dim)), ang)
        w = self.weights_proj(x) * (self.dim ** -0.5 * self.heads ** -0.5)
        return self.ops.v41_qdq(q, "mxfp4") if cache_qdq else q, w

    def select(self, x: torch.Tensor, qr: torch.Tensor, ang: torch.Tensor, ctx: StepContext, shared: SharedKV
               ) -> None:
        """Score the source's entries for every query, publish candidates / restrict to them, keep the top-k
        (ascending entry ids, -1 past the finite scores) in ``shared``."""
        keys = shared.source.index_keys
        q_len, width = x.shape[0], keys.shape[0]
        if width == 0:
            shared.topk = torch.empty(q_len, 0, dtype=torch.long, device=x.device)
            if self.candidate_source:
                shared.candidates = torch.empty(q_len, 0, dtype=torch.bool, device=x.device)
            return
        q, w = self.queries(x, qr, ang, ctx.cache_qdq)
        visible = ((ctx.positions + 1) // shared.ratio).unsqueeze(-1)
        allowed = torch.arange(width, device=x.device) < visible
        scores = weigh(torch.einsum("shd,td->sht", q, keys), w).masked_fill(~allowed, -torch.inf)
        if self.candidate_source:
            shared.candidates = candidate_blocks(scores, visible, self.topk_blocks, self.block) & allowed
        elif self.uses_candidates:
            if shared.candidates is None or shared.candidates.shape != scores.shape:
                raise ValueError("a re-indexing layer after the candidate source found no candidates")
            scores = scores.masked_fill(~shared.candidates, -torch.inf)
        chosen = scores.topk(min(self.topk, width), dim=-1, sorted=False).indices.sort(dim=-1).values
        shared.topk = torch.where(torch.isfinite(scores.gather(-1, chosen)), chosen, -1)


class Attention(nn.Module):
    """Checkpoint names under ``layers.N.attn.``: wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink,
    compressor.* (KV sources), indexer.* (index sources)."""

    # The RoPE, cache-rounding, key-list attention and the engine step's compressor pooling ops (``ops.v41_rope``,
    # ``v41_qdq``, ``v41_attend_lists``, ``v41_compress_pool``): the device build sets the device's table.
    ops: OpTable = REF

    def __init__(self, cfg: V41Config, layer: int, dtype: torch.dtype, role: V41LayerRole | None = None) -> None:
        """``role``: what the layer owns (default: the schedule's ``cfg.role(layer)``)."""
        super().__init__()
        role = cfg.role(layer) if role is None else role
        self.ratio, self.kv_source, self.index_source = role.ratio, role.kv_source, role.index_source
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window = cfg.sliding_window
        self.table = "compress" if self.ratio else "main"
        self.rope = cfg.compress_rope if self.ratio else cfg.main_rope
        h, d = cfg.hidden_size, cfg.head_dim
        self.wq_a = Linear(h, cfg.q_lora_rank, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * d, dtype=dtype)
        self.wkv = Linear(h, d, dtype=dtype)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = Linear(self.heads * d // self.groups, self.groups * cfg.o_lora_rank, dtype=dtype)
        self.wo_b = Linear(self.groups * cfg.o_lora_rank, h, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        if self.kv_source:
            self.compressor = Compressor(cfg, self.ratio)
        if self.index_source:
            self.indexer = Indexer(cfg, layer, dtype)

    def _publish_entries(self, x: torch.Tensor, ctx: StepContext, lc: LayerCache, shared: SharedKV) -> None:
        """A KV source: its new compressed entries and index keys, and a fresh shared state pointing at them."""
        latent = self.compressor(x, ctx, lc)
        first = ctx.start // self.ratio
        # An encoder-side replay (spec §3.2) recomputes the latents of entries it finds cached; those stay.
        cached = min(latent.shape[0], max(0, ctx.emit_from // self.ratio - first))
        latent, first = latent[cached:], first + cached
        if latent.shape[0] or lc.entries is None:
            ang = rope_angles(self.rope, torch.arange(first, first + latent.shape[0], device=x.device) * self.ratio)
            entries = self.ops.v41_rope(latent, ang)
            lc.entries = write_rows(lc.entries, first, self.ops.v41_qdq(entries, "nvfp4") if ctx.cache_qdq else entries)
            lc.index_keys = write_rows(lc.index_keys, first, self.indexer.keys(latent, ang, ctx.cache_qdq))
        visible = ctx.end // self.ratio  # a replay's cache holds entries past the step: it sees them as a cold run
        source = lc if lc.entries.shape[0] == visible else \
            LayerCache(entries=lc.entries[:visible], index_keys=lc.index_keys[:visible])
        shared.source, shared.ratio, shared.topk, shared.candidates = source, self.ratio, None, None

    def forward(self, x: torch.Tensor, ctx: StepContext, lc: LayerCache, shared: SharedKV) -> torch.Tensor:
        ang = ctx.angles[self.table]
        q, qr, kv = self.project(x, ang, ctx.cache_qdq)
        lc.window = write_rows(lc.window, ctx.start, kv)
        keys, allowed = lc.window, self._window_mask(ctx)
        if self.ratio:
            if self.kv_source:
                self._publish_entries(x, ctx, lc, shared)
            keys, allowed = self.add_entries(x, qr, ang, ctx, shared, keys, allowed)
        return self._output(self._attend(q, keys, allowed), ang)

    def project(self, x: torch.Tensor, ang: torch.Tensor, cache_qdq: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [Q, H] -> rope'd queries [Q, heads, D], the normed q latent [Q, q_lora] (the indexer's input) and
        the rope'd window K=V rows [Q, D] as cached (FP8-rounded with ``cache_qdq``)."""
        qr = self.q_norm(self.wq_a(x))
        q = self.ops.v41_rope(self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim)), ang)
        kv = self.ops.v41_rope(self.kv_norm(self.wkv(x)), ang)
        return q, qr, self.ops.v41_qdq(kv, "fp8") if cache_qdq else kv

    def add_entries(self, x: torch.Tensor, qr: torch.Tensor, ang: torch.Tensor, ctx: StepContext, shared: SharedKV,
                    keys: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A compressed layer's keys: the window ``keys`` [K, D] / ``allowed`` [Q, K] followed by the KV source's
        entries, of which each query sees its top-k (selected here by an index source, else the latest index
        source's)."""
        self.pick(x, qr, ang, ctx, shared)
        entries, picked = shared.source.entries, shared.topk
        width = entries.shape[0]
        chosen = torch.zeros(x.shape[0], width + 1, dtype=torch.bool, device=x.device)
        chosen = chosen.scatter(-1, torch.where(picked >= 0, picked, width), True)[:, :width]
        return torch.cat((keys, entries)), torch.cat((allowed, chosen), dim=-1)

    def pick(self, x: torch.Tensor, qr: torch.Tensor, ang: torch.Tensor, ctx: StepContext, shared: SharedKV) -> None:
        """A compressed layer's top-k entries per query in ``shared.topk``: selected here by an index source,
        else the latest index source's."""
        if shared.source is None or shared.ratio != self.ratio:
            raise ValueError(f"a ratio-{self.ratio} layer found no preceding KV source of that ratio")
        if self.index_source:
            self.indexer.select(x, qr, ang, ctx, shared)

    def _output(self, out: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
        """[Q, heads, D] attention output -> [Q, H]: inverse rope at the query positions, grouped low-rank wo_a,
        wo_b."""
        out = self.ops.v41_rope(out, ang, inverse=True)
        grouped = self.wo_a.grouped(out.reshape(out.shape[0], self.groups, -1).transpose(0, 1))
        return self.wo_b(grouped.transpose(0, 1).flatten(1))

    def _window_mask(self, ctx: StepContext) -> torch.Tensor:
        """[Q, end]: which cached window positions each query sees, (t - W, t], none below ``window_from``."""
        key_pos = torch.arange(ctx.end, device=ctx.positions.device)
        t = ctx.positions.unsqueeze(1)
        return (key_pos <= t) & (key_pos > t - self.window) & (key_pos >= ctx.window_from)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Softmax over the allowed keys plus the sink logit (denominator only); K = V. fp32 inside."""
        keys = torch.cat((keys, keys.new_zeros(1, keys.shape[-1])))  # the sink's zero-valued key
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill(~allowed, -torch.inf)
        bias = torch.cat((bias.unsqueeze(0).expand(self.heads, -1, -1),
                          self.attn_sink.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)), dim=-1)
        logits = torch.einsum("shd,td->hst", q.float(), keys.float()) * self.head_dim ** -0.5
        probs = (logits + bias).softmax(dim=-1)
        return torch.einsum("hst,td->shd", probs, keys.float()).to(q.dtype)
