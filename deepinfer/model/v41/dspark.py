"""DeepSeek-V4.1's DSpark block drafter (spec §5), stored in the checkpoint as ``mtp.0`` .. ``mtp.{S-1}``.

Each stage is a V4.1 block without compressor, indexer or Engram: window-only attention with the main rope
table, an MoE of its own size (Flash: 128 experts, top 3, plus the shared one) and single-pass mHC. Stage 0
also owns ``main_proj``/``main_norm``, which turn the target's taps into the drafter's context; the last
stage owns the final ``norm``, the Markov head and the confidence head. Embedding and LM head are the
target's.

Context (spec §5.2). For every target position q the taps are the mean over the mHC streams entering the
backbone layers ``dspark_target_layer_ids`` (after that layer's Engram, before its attention); ``main_x[q]
= main_norm(main_proj(concat(taps)))`` and each stage keeps ``FP8(rope(kv_norm(wkv(main_x[q])), q))`` by
position in its own window (``V41Cache.draft``). The target's forward writes these rows for its step.

One block (spec §5.3, the inference convention of vLLM/ATOM; NeMo's training adapter places its anchor the
same way: the anchor token at the position after the last context feature, drafts at the block's own
positions). With p the last target position whose context exists and t the token the target drew there:
block rows are ``embed([t, noise x (B - 1)])`` at positions p + 1 .. p + B, four identical streams and a
one-hot ``pre``; every row attends to the context rows (p - W, p] and to all B rows (non-causal), so all B
rows always run. Then ``U = head(norm(h))`` and the Markov head runs sequentially: row k's logits are
``U_k + W2 W1[x_{k-1}]`` with x_0 = t and x_k the draft picked at row k; its confidence is
``sigmoid(w . [h_k; W1[x_{k-1}]])`` (h_k before the final norm for the released drafter, after it for
drafts trained by NeMo AutoModel: ``dspark_confidence_input``), the chance that draft k is accepted given
that the drafts before it were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.config.v41 import V41Config, V41LayerRole
from deepinfer.model.linear import Embedding, Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.model.v41 import mhc
from deepinfer.model.v41.attention import Attention
from deepinfer.model.v41.cache import LayerCache, write_rows
from deepinfer.model.v41.cache_quant import qdq
from deepinfer.model.v41.moe import MoE
from deepinfer.model.v41.rope import angles
from deepinfer.ops.table import REF, OpTable

_WINDOW_ONLY = V41LayerRole(ratio=0, kv_source=False, index_source=False, candidate_source=False,
                            uses_candidates=False, engram=False)


@dataclass(frozen=True, slots=True, eq=False)
class DraftBlock:
    """One proposed block: draft k (0-based) is the guess for position ``first_position + k + 1``."""

    tokens: torch.Tensor  # [B] int64
    logits: torch.Tensor  # [B, V] fp32: base logits plus the Markov bias of the previous token
    confidence_logits: torch.Tensor  # [B] fp32, uncalibrated
    first_position: int  # position of the block's first input row (the target's last drawn token)

    @property
    def confidence(self) -> torch.Tensor:
        """[B] fp32 in (0, 1): chance of acceptance of each draft given the ones before it."""
        return torch.sigmoid(self.confidence_logits)


class DSparkAttention(Attention):
    """``mtp.S.attn.``: wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink (as a window-only layer)."""

    def __init__(self, cfg: V41Config, stage: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.num_hidden_layers + stage, dtype, role=_WINDOW_ONLY)

    def kv_rows(self, x: torch.Tensor, ang: torch.Tensor, cache_qdq: bool) -> torch.Tensor:
        """[T, H] -> [T, D] window KV rows (rope'd at ``ang``'s positions, FP8-rounded like the window cache)."""
        kv = self.ops.v41_rope(self.kv_norm(self.wkv(x)), ang)
        return qdq(kv, "fp8") if cache_qdq else kv

    def block(self, x: torch.Tensor, ang: torch.Tensor, context: torch.Tensor, cache_qdq: bool) -> torch.Tensor:
        """The block's rows x [B, H] at angles ``ang`` over ``context`` [C, D] and themselves -> [B, H]."""
        q = self.ops.v41_rope(self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.heads, self.head_dim)), ang)
        keys = torch.cat((context.to(x.dtype), self.kv_rows(x, ang, cache_qdq)))
        allowed = torch.ones(x.shape[0], keys.shape[0], dtype=torch.bool, device=x.device)
        return self._output(self._attend(q, keys, allowed), ang)

    def block_lists(self, x: torch.Tensor, ang: torch.Tensor, context: torch.Tensor, key_ids: torch.Tensor,
                    cache_qdq: bool) -> torch.Tensor:
        """``block`` for many blocks at once: their rows x [m B, H] at angles ``ang``, ``context`` [R, D] the
        blocks' context rows, ``key_ids`` [m B, W + B] each row's keys as rows of ``context`` followed by the
        blocks' own KV rows (R + j B + b: block j's row b; -1: none) -> [m B, H]."""
        q = self.ops.v41_rope(self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.heads, self.head_dim)), ang)
        keys = torch.cat((context.to(x.dtype), self.kv_rows(x, ang, cache_qdq)))
        return self._output(self.ops.v41_attend_lists(q, self.attn_sink, keys, key_ids), ang)


class MarkovHead(nn.Module):
    """``markov_head.``: embed [V, r] (W1, the previous token's code), head [V, r] (W2: code -> logit bias)."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = Embedding(vocab, rank, dtype=dtype)
        self.head = Linear(rank, vocab, dtype=dtype)

    def forward(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """previous ids [...] -> (fp32 logit bias [..., V], code [..., r])."""
        code = self.embed(previous)
        return self.head(code).float(), code


class ConfidenceHead(nn.Module):
    """``confidence_head.proj`` [1, H + r], fp32, no bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = Linear(width, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat((hidden.float(), code.float()), dim=-1)).squeeze(-1)


class DSparkStage(nn.Module):
    """``mtp.S.``: attn_norm, ffn_norm, hc_{attn,ffn}_{fn,base,scale}, attn.*, ffn.* (gate.bias_vl included,
    unused: draft rows are text); stage 0: main_proj, main_norm; last stage: norm, markov_head, confidence_head."""

    # The mHC coefficients' op (``ops.v41_mix_finish``): the device build sets the device's table.
    ops: OpTable = REF

    def __init__(self, cfg: V41Config, stage: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.dspark
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps)
        mhc.add_site_parameters(self, "attn", cfg.hc_mult, h)
        mhc.add_site_parameters(self, "ffn", cfg.hc_mult, h)
        self.attn = DSparkAttention(cfg, stage, dtype)
        self.ffn = MoE(cfg, dtype, d.n_routed_experts, d.num_experts_per_tok)
        if stage == 0:
            self.main_proj = Linear(h * len(d.target_layer_ids), h, dtype=dtype)
            self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, d.markov_rank, dtype)
            self.confidence_head = ConfidenceHead(h + d.markov_rank)

    def _mix(self, site: str, streams: torch.Tensor) -> mhc.Mix:
        c = self.cfg
        return mhc.site_mix(self, site, streams, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, self.ops)

    def forward(self, streams: torch.Tensor, pre_in: torch.Tensor, ang: torch.Tensor, context: torch.Tensor,
                cache_qdq: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone's block step (model.Block) with the block attention and no Engram."""
        return self.run(streams, pre_in, lambda h: self.attn.block(h, ang, context, cache_qdq))

    def run(self, streams: torch.Tensor, pre_in: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the attention given as ``attend`` (normed rows [T, H] -> [T, H]): one block's
        (``DSparkAttention.block``) or many blocks' at once (``block_lists``, ``dspark_lists.py``)."""
        attn_mix = self._mix("attn", streams)
        out = attend(self.attn_norm(mhc.collapse(streams, pre_in, self.ops)))
        streams = mhc.expand(out, streams, attn_mix, self.ops)
        ffn_mix = self._mix("ffn", streams)
        text = torch.zeros(streams.shape[0], dtype=torch.bool, device=streams.device)
        out = self.ffn(self.ffn_norm(mhc.collapse(streams, attn_mix.pre, self.ops)), text)
        return mhc.expand(out, streams, ffn_mix, self.ops), ffn_mix.pre


class DSpark(nn.ModuleList):
    """The drafter's stages (a ModuleList, so the model's ``mtp.S.*`` names are the checkpoint's)."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        cfg.check_dspark()
        super().__init__(DSparkStage(cfg, s, dtype) for s in range(cfg.num_nextn_predict_layers))
        self.cfg = cfg

    def write_context(self, taps: torch.Tensor, start: int, windows: list[LayerCache], main_angles: torch.Tensor,
                      cache_qdq: bool) -> None:
        """Store the context KV of positions [start, start + T) from their taps [T, len(target_layer_ids), H]
        (``main_angles``: the main rope table at those positions) in each stage's window."""
        if len(windows) != len(self):
            raise ValueError(f"cache: has {len(windows)} DSpark context windows, the drafter {len(self)} stages "
                             "(make the cache with the model's new_cache())")
        for lc, rows in zip(windows, self.context_rows(taps, main_angles, cache_qdq)):
            lc.window = write_rows(lc.window, start, rows)

    def context_rows(self, taps: torch.Tensor, main_angles: torch.Tensor, cache_qdq: bool) -> list[torch.Tensor]:
        """Each stage's context KV rows [T, D] of T target positions from their taps [T, len(target_layer_ids),
        H] (``main_angles``: the main rope table at those positions). Row-wise: the engine's batched step
        (``paged.py``) computes the rows of many sequences' positions at once and stores them by position."""
        main_x = self[0].main_norm(self[0].main_proj(taps.flatten(1)))
        return [stage.attn.kv_rows(main_x, main_angles, cache_qdq) for stage in self]

    @torch.no_grad()
    def propose(self, embed: Embedding, head: Linear, windows: list[LayerCache], token: int, cache_qdq: bool, *,
                temperature: float | None = None, noise: torch.Tensor | None = None) -> DraftBlock:
        """Draft the block after the last target position p with context in ``windows``; ``token`` is the
        target's draw at p (the token of position p + 1). Drafts are the argmax of each row's logits; with
        ``noise`` [B, V] (e.g. the Gumbel noise the target's seeded draw will use at positions p + 2 ..) they
        are the argmax of logits / temperature + noise instead, the drafter's guess at a sampled draw."""
        if not windows or windows[0].window is None:
            raise ValueError("cache: no DSpark context yet; run the target over the prompt first")
        p = windows[0].window.shape[0] - 1
        first = max(0, p + 1 - self.cfg.sliding_window)
        return self.draft(embed, head, [lc.window[first:p + 1] for lc in windows], p, token, cache_qdq,
                          temperature=temperature, noise=noise)

    @torch.no_grad()
    def draft(self, embed: Embedding, head: Linear, context: list[torch.Tensor], p: int, token: int,
              cache_qdq: bool, *, temperature: float | None = None, noise: torch.Tensor | None = None) -> DraftBlock:
        """``propose`` given each stage's context rows [C, D] of positions (p - C, p] (C = min(p + 1, the
        sliding window)), wherever they are stored: this model's per-sequence cache, or the engine's paged
        pools (``runner/dspark.py``), so both draft with this one function."""
        cfg, d = self.cfg, self.cfg.dspark
        if not 0 <= token < cfg.vocab_size:
            raise ValueError(f"token: must lie in [0, {cfg.vocab_size}), got {token}")
        block = d.block_size
        if noise is not None and (temperature is None or temperature <= 0 or noise.shape != (block, cfg.vocab_size)):
            raise ValueError(f"noise: needs a temperature > 0 and shape ({block}, {cfg.vocab_size}), got "
                             f"{temperature!r} and {tuple(noise.shape)}")
        want = min(p + 1, cfg.sliding_window)
        if len(context) != len(self) or any(c.shape[0] != want for c in context):
            raise ValueError(f"context: expected {len(self)} stages of {want} rows (positions up to {p}), got "
                             f"{[tuple(c.shape) for c in context]}")
        device = context[0].device
        ang = angles(cfg.main_rope, torch.arange(p + 1, p + 1 + block, device=device))
        ids = torch.full((block,), d.noise_token_id, dtype=torch.long, device=device)
        ids[0] = token
        x = embed(ids)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1)
        pre = mhc.one_hot_pre(block, cfg.hc_mult, device)
        for stage, rows in zip(self, context):
            streams, pre = stage(streams, pre, ang, rows, cache_qdq)
        last = self[-1]
        hidden = mhc.collapse(streams, pre)
        normed = last.norm(hidden)
        base = head(normed.float())
        conf_in = hidden if d.confidence_input == "hidden" else normed
        # Sequential only through the Markov head: each row's bias is conditioned on the draft before it.
        tokens = torch.empty(block, dtype=torch.long, device=device)
        logits = torch.empty_like(base)
        conf = torch.empty(block, dtype=torch.float32, device=device)
        previous = ids[:1]
        for k in range(block):
            bias, code = last.markov_head(previous)
            logits[k] = base[k] + bias[0]
            conf[k] = last.confidence_head(conf_in[k:k + 1], code)[0]
            score = logits[k] if noise is None else logits[k].double() / temperature + noise[k].double()
            tokens[k] = score.argmax()
            previous = tokens[k:k + 1]
        return DraftBlock(tokens, logits, conf, p + 1)
