"""DeepSeek-V4 as pure math in plain PyTorch: one forward path, the batched step.

Parameter names equal the DeepSeek-native checkpoint names (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``mtp.0.*`` ...), so loading is a name-for-name copy after the
loader has dequantized and renamed whatever it read.

``forward`` takes a flat batch of new tokens from several sequences plus explicit metadata and the cache
storage, and returns the final residual streams (before ``hc_head``); ``logits`` finishes the head. The
MTP block (``mtp``) reuses the same decoder block and shares the embedding and LM head. Every step reads
and writes the cache through row lists built once per step (``model/step_index.py``,
``model/attention_indexed.py``); with the reference op table (the default) this is the CPU reference, with
the Triton table (``model/device.py``) the GPU path. The per-sequence formulation it is checked against
lives with the tests (``tests/oracle/per_sequence.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config.model import SWA, ModelConfig
from deepinfer.kv.storage import KVStorage
from deepinfer.model.attention import Attention
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.context import StepContext
from deepinfer.model.moe import MoE
from deepinfer.model.linear import Embedding, Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.model.rope import RopeTables
from deepinfer.model.step_index import StepIndex, build_step_index
from deepinfer.ops.table import REF, OpTable


def _hc_params(module: nn.Module, prefix: str, rows: int, cols: int, scales: int) -> None:
    """One mHC site's (fn, base, scale), stored flat as ``{prefix}_fn`` etc. like the checkpoint names."""
    setattr(module, f"{prefix}_fn", nn.Parameter(torch.zeros(rows, cols, dtype=torch.float32)))
    setattr(module, f"{prefix}_base", nn.Parameter(torch.zeros(rows, dtype=torch.float32)))
    setattr(module, f"{prefix}_scale", nn.Parameter(torch.ones(scales, dtype=torch.float32)))


class Block(nn.Module):
    """One decoder layer: mHC-wrapped attention and MoE. Names: attn_norm, ffn_norm, hc_attn_*, hc_ffn_*,
    attn.*, ffn.*."""

    ops: OpTable = REF  # replaced by model/device.py for accelerated runs

    def __init__(self, cfg: ModelConfig, layer: int, kind: str, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        n, h = cfg.hc_mult, cfg.hidden_size
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps)
        _hc_params(self, "hc_attn", (2 + n) * n, n * h, 3)
        _hc_params(self, "hc_ffn", (2 + n) * n, n * h, 3)
        self.attn = Attention(cfg, kind, ratio, dtype)
        self.ffn = MoE(cfg, layer, dtype)

    def _pre(self, site: str, streams: torch.Tensor):
        c = self.cfg
        fn, base, scale = (getattr(self, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
        return self.ops.hc_pre(streams, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def forward(self, streams: torch.Tensor, ctx: StepContext, key: str, ropes: RopeTables,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rows`` (None: all): the rows whose output is wanted, returned in that order; the FFN half runs
        at those rows only (rows that only fill the attention cache need the attention half alone)."""
        collapsed, post, comb = self._pre("attn", streams)
        out = self.attn(self.attn_norm(collapsed), ctx, key, ropes)
        streams = self.ops.hc_post(streams, out, post, comb)
        input_ids = ctx.input_ids
        if rows is not None:
            if not len(rows):
                return streams[:0]
            streams, input_ids = streams[rows], input_ids[rows]
        collapsed, post, comb = self._pre("ffn", streams)
        out = self.ffn(self.ffn_norm(collapsed), input_ids)
        return self.ops.hc_post(streams, out, post, comb)


class MTPBlock(Block):
    """The multi-token-prediction layer ``mtp.0``: a sliding-window decoder block fed with the target's
    final streams at position p and the embedding of token p+1; predicts token p+2.
    Extra names: enorm, hnorm, e_proj, h_proj, norm, hc_head_{fn,base,scale}."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.num_hidden_layers, SWA, 0, dtype)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.e_proj = Linear(h, h, bias=False, dtype=dtype)
        self.h_proj = Linear(h, h, bias=False, dtype=dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        _hc_params(self, "hc_head", cfg.hc_mult, cfg.hc_mult * h, 1)


class DeepseekV4(nn.Module):
    ops: OpTable = REF  # replaced by model/device.py for accelerated runs

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        h = cfg.hidden_size
        self.embed = Embedding(cfg.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(
            Block(cfg, i, kind, cfg.layer_compress_ratios[i], dtype) for i, kind in enumerate(cfg.layer_types)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = Linear(h, cfg.vocab_size, bias=False, dtype=dtype)
        self.draft_head: nn.Module | None = None  # the MTP drafts' head, when not ``head`` (model/draft_head.py)
        _hc_params(self, "hc_head", cfg.hc_mult, cfg.hc_mult * h, 1)
        self.mtp = nn.ModuleList(MTPBlock(cfg, dtype) for _ in range(cfg.num_nextn_predict_layers))
        self.ropes = RopeTables(cfg)

    def context(self, input_ids: torch.Tensor, batch: ForwardBatch | None, storage: KVStorage,
                index: StepIndex | None = None, window_only: bool = False) -> StepContext:
        """The step's row lists (from ``index``, or built from ``batch`` on the host) and RoPE tables;
        ``window_only``: the pass runs sliding-window layers alone (the MTP block), so the compressed layers'
        tables are not built (a dozen small launches per chained draft)."""
        if index is None:
            batch.check()
            index = build_step_index(batch, storage, self.cfg.sliding_window).to(input_ids.device)
        if len(input_ids) != len(index.positions):
            raise ValueError(f"input_ids: {len(input_ids)} tokens but the step index has {len(index.positions)}")
        positions = index.positions
        tables = ("main",) if window_only else ("main", "compress")
        rope = {t: self.ropes.cos_sin(t, positions, self.dtype) for t in tables}
        rows = index.rows(self.ops.step_rows)
        emit_rope = {} if window_only else {k: self.ropes.cos_sin("compress", c.emit_pos, self.dtype)
                                            for k, c in rows.compress.items()}
        return StepContext(input_ids, positions, batch, storage, rope, rows, emit_rope)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch | None, storage: KVStorage,
                index: StepIndex | None = None) -> torch.Tensor:
        """New tokens [T] -> final residual streams [T, hc_mult, H] (before hc_head).

        ``index`` (optional): prebuilt row lists of the batched path (CUDA graphs pass static ones; then
        ``batch`` may be None)."""
        return self.run_layers(self.context(input_ids, batch, storage, index))

    def run_layers(self, ctx: StepContext) -> torch.Tensor:
        """The decoder layers over ``ctx.input_ids`` -> final residual streams."""
        x = self.embed(ctx.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            streams = layer(streams, ctx, f"layers.{i}", self.ropes)
        return streams

    def _head(self, streams: torch.Tensor, owner: nn.Module, norm: RMSNorm, head: nn.Module | None = None
              ) -> torch.Tensor:
        c = self.cfg
        x = self.ops.hc_head(streams, owner.hc_head_fn, owner.hc_head_base, owner.hc_head_scale, c.hc_eps,
                             c.rms_norm_eps)
        return (self.head if head is None else head)(norm(x))

    @torch.no_grad()
    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [T, N, H] -> logits [T, V] (in the model dtype, as the reference returns them)."""
        return self._head(streams, self, self.norm)

    @torch.no_grad()
    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch | None,
                    storage: KVStorage, depth: int = 0, index: StepIndex | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
        """Draft pass. ``streams`` [T, N, H]: target final streams at positions p (from ``batch``);
        ``next_ids`` [T]: token p+1. Returns the MTP block's output streams (feed them back for chained
        drafts); ``mtp_logits`` turns them into logits for token p+2. ``rows`` (None: all T): the rows whose
        output is wanted, in that order; every row still writes its window-cache entry, but only these run
        the block's FFN half (a verify step drafts from one row per sequence; an empty ``rows`` only fills
        the window, as for prompt chunks).

        Conventions (as vLLM's V4 MTP): the RoPE/cache position is the target position p, and the token
        embedding is zeroed at p == 0.
        """
        mtp = self.mtp[depth]
        ctx = self.context(next_ids, batch, storage, index, window_only=True)  # the MTP block is SWA
        emb = self.embed(next_ids).masked_fill((ctx.positions == 0).unsqueeze(-1), 0)
        z = mtp.h_proj(mtp.hnorm(streams)) + mtp.e_proj(mtp.enorm(emb)).unsqueeze(1)
        return mtp(z, ctx, f"mtp.{depth}", self.ropes, rows)

    @torch.no_grad()
    def mtp_logits(self, mtp_streams: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """The drafts' logits: through ``draft_head`` when the engine attached one (``model/draft_head.py``: an FP8
        copy of the LM head), else the LM head."""
        mtp = self.mtp[depth]
        return self._head(mtp_streams, mtp, mtp.norm, self.draft_head)
