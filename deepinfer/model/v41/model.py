"""DeepSeek-V4.1 text model (spec §2): embedding, 4 identical residual streams, Engram injections, blocks with
single-pass mHC around CSA2 attention and MoE, final collapse with the last FFN site's ``pre``, norm, head.

``forward(input_ids, cache)`` runs the next chunk of one sequence (a whole prompt from an empty cache, or
decode steps) and returns fp32 logits for the chunk. Parameter names are the released checkpoint's
(``embed.weight``, ``layers.N.attn.wq_a.weight``, ``layers.N.hc_attn_fn``, ``layers.N.engram.embed.weight``,
``head.weight`` ...). The DSpark drafter (``mtp.*``, dspark.py) is built on request; the vision tower is not
part of this model: image input is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.config.v41 import V41Config
from deepinfer.model.linear import Embedding, Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.model.v41 import mhc
from deepinfer.model.v41.attention import Attention
from deepinfer.model.v41.cache import V41Cache
from deepinfer.model.v41.context import SharedKV, StepContext
from deepinfer.model.v41.dspark import DraftBlock, DSpark
from deepinfer.model.v41.engram import Engram, EngramHasher, compressed_token_map
from deepinfer.model.v41.moe import MoE
from deepinfer.model.v41.replay import DecoderReplay
from deepinfer.model.v41.rope import angles
from deepinfer.ops.table import REF, OpTable


class Block(nn.Module):
    """Names: attn_norm, ffn_norm, hc_{attn,ffn}_{fn,base,scale}, attn.*, ffn.*, engram.* (Engram layers)."""

    # The mHC coefficients' op (``ops.v41_mix_finish``): the device build sets the device's table.
    ops: OpTable = REF

    def __init__(self, cfg: V41Config, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps)
        mhc.add_site_parameters(self, "attn", cfg.hc_mult, h)
        mhc.add_site_parameters(self, "ffn", cfg.hc_mult, h)
        self.attn = Attention(cfg, layer, dtype)
        self.ffn = MoE(cfg, dtype)
        if cfg.role(layer).engram:
            self.engram = Engram(cfg, layer, dtype)

    def _mix(self, site: str, streams: torch.Tensor) -> mhc.Mix:
        c = self.cfg
        return mhc.site_mix(self, site, streams, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, self.ops)

    def forward(self, streams: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext, layer: int,
                shared: SharedKV, engram_rows: torch.Tensor | None, image_mask: torch.Tensor,
                taps: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [T, N, H], carried pre [T, N] fp32) -> the same after this block. Each collapse uses the
        ``pre`` of the site before it; this block's FFN-site ``pre`` is returned for the next block. ``taps``:
        gets the stream mean entering the attention site (after Engram), the DSpark drafter's feature."""
        return self.run(streams, pre_in, lambda h: self.attn(h, ctx, ctx.cache.layers[layer], shared), engram_rows,
                        image_mask, taps)

    def run(self, streams: torch.Tensor, pre_in: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor],
            engram_rows: torch.Tensor | None, image_mask: torch.Tensor, taps: list[torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the attention given as ``attend`` (normed input [T, H] -> output [T, H]): this
        cache's, or the engine's paged step (``paged.py``), around one copy of the block's mHC wiring."""
        if engram_rows is not None:
            streams = self.engram(streams, engram_rows)
        if taps is not None:
            taps.append(streams.mean(dim=1))
        attn_mix = self._mix("attn", streams)
        out = attend(self.attn_norm(mhc.collapse(streams, pre_in, self.ops)))
        streams = mhc.expand(out, streams, attn_mix, self.ops)
        ffn_mix = self._mix("ffn", streams)
        out = self.ffn(self.ffn_norm(mhc.collapse(streams, attn_mix.pre, self.ops)), image_mask)
        return mhc.expand(out, streams, ffn_mix, self.ops), ffn_mix.pre


class DeepseekV41(nn.Module):
    def __init__(self, cfg: V41Config, dtype: torch.dtype = torch.bfloat16, tokenizer=None,
                 cache_qdq: bool = True, *, shapes_only: bool = False, dspark: bool = False) -> None:
        """``tokenizer``: the checkpoint's ``tokenizers.Tokenizer`` (needed when Engram layers are active: its
        normalised vocabulary is part of the hash). ``cache_qdq``: keep the reference's FP8 / MXFP4 / NVFP4
        cache roundings in the forward (off only to compare with an unquantised oracle). ``shapes_only``: a
        model for its parameter names and shapes (e.g. on the meta device), built without the hasher.
        ``dspark``: also build the DSpark drafter (``mtp.*``); every forward then writes its context."""
        super().__init__()
        self.cfg, self.dtype, self.cache_qdq = cfg, dtype, cache_qdq
        h = cfg.hidden_size
        self.embed = Embedding(cfg.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = Linear(h, cfg.vocab_size, dtype=torch.float32)  # logits in fp32
        self.hasher: EngramHasher | None = None
        if cfg.active_engram_layers and not shapes_only:
            if tokenizer is None:
                raise ValueError("tokenizer: the Engram layers hash normalised token ids; pass the checkpoint's "
                                 "tokenizer")
            self.hasher = EngramHasher(cfg, *compressed_token_map(tokenizer))
        self.mtp = DSpark(cfg, dtype) if dspark else None
        self._tap_layers = frozenset(cfg.dspark.target_layer_ids) if dspark else frozenset()

    def new_cache(self) -> V41Cache:
        return V41Cache(self.cfg.num_hidden_layers, len(self.mtp) if self.mtp is not None else 0)

    def _context(self, start: int, count: int, cache: V41Cache, device: torch.device) -> StepContext:
        positions = torch.arange(start, start + count, device=device)
        ang = {"main": angles(self.cfg.main_rope, positions), "compress": angles(self.cfg.compress_rope, positions)}
        if start < cache.replay_end:  # a step of an encoder-side replay (``take_prefix_hit``)
            return StepContext(positions, start, ang, cache, self.cache_qdq, cache.replay_start, cache.replay_end)
        return StepContext(positions, start, ang, cache, self.cache_qdq)

    def take_prefix_hit(self, cache: V41Cache, boundary: int) -> None:
        """Continue ``cache`` as the engine continues a prefix hit at ``boundary`` with ``v41_prefix_replay="v41"``
        (the encoder-side replay of spec §3.2, ``V41Cache.take_prefix_hit``): the next forward must start with the
        tokens of [boundary - sliding_window, boundary). The reference the engine's replay is checked against."""
        cache.take_prefix_hit(boundary, self.cfg.sliding_window, self.cfg.compress_ratios)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int32, torch.int64) or input_ids.numel() == 0:
            raise ValueError(f"input_ids: expected a non-empty 1-D integer tensor, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"input_ids: ids must lie in [0, {self.cfg.vocab_size})")
        if bool((input_ids == self.cfg.image_token_id).any()):
            raise ValueError(f"input_ids: contains image_token_id {self.cfg.image_token_id} (an image span); the "
                             "V4.1 vision encoder is not implemented, only text input is supported")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: V41Cache | None = None, replay: str = "off") -> torch.Tensor:
        """input_ids [Q] (the sequence's next tokens) -> fp32 logits [Q, V]; ``cache`` (default: a new one,
        i.e. the whole sequence) is extended by these positions. ``replay``: the decoder-side bounded replay
        (``replay.py``: off / v41 / exact); a chunk it narrows returns the logits of its last row only [1, V]."""
        self._check_ids(input_ids)
        cache = self.new_cache() if cache is None else cache
        start = cache.append_tokens(input_ids)
        ctx = self._context(start, input_ids.numel(), cache, input_ids.device)
        if self.hasher is None and self.cfg.active_engram_layers:
            raise ValueError("this model was built with shapes_only=True and cannot run the Engram layers")
        rows = self.hasher(cache.tokens, start) if self.hasher is not None else None
        image_mask = torch.zeros_like(input_ids, dtype=torch.bool)  # no image spans (refused above)
        x = self.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1)
        pre = mhc.one_hot_pre(x.shape[0], self.cfg.hc_mult, x.device)
        shared = SharedKV()
        taps: list[torch.Tensor] = []
        narrow = DecoderReplay.of(self.cfg, replay)
        kept = narrow.kept(input_ids.numel())
        narrowed = kept < input_ids.numel()
        for i, block in enumerate(self.layers):
            if narrowed and i == narrow.first_layer:
                # The decoder layers run on the last ``kept`` rows, their window bounded at the first of them.
                first = ctx.end - kept
                cache.skip_window_rows(range(i, len(self.layers)), start, first, x.new_zeros(self.cfg.head_dim))
                ctx = StepContext(ctx.positions[-kept:], first, {k: a[-kept:] for k, a in ctx.angles.items()}, cache,
                                  ctx.cache_qdq, window_from=first, emit_from=ctx.emit_from)
                streams, pre, image_mask = streams[-kept:], pre[-kept:], image_mask[-kept:]
                shared, taps = shared.narrowed(kept), [t[-kept:] for t in taps]
                rows = rows[-kept:] if rows is not None else None
            engram_rows = rows[:, block.engram.table_index] if hasattr(block, "engram") else None
            streams, pre = block(streams, pre, ctx, i, shared, engram_rows, image_mask,
                                 taps if i in self._tap_layers else None)
        if self.mtp is not None:
            self.mtp.write_context(torch.stack(taps, dim=1), ctx.start, cache.draft, ctx.angles["main"], self.cache_qdq)
        hidden = mhc.collapse(streams, pre)
        return self.logits(hidden[-1:] if narrowed else hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final collapsed residual [T, H] -> fp32 logits [T, V] (final norm, then the fp32 head)."""
        return self.head(self.norm(hidden).float())

    def propose(self, token: int, cache: V41Cache, *, temperature: float | None = None,
                noise: torch.Tensor | None = None) -> DraftBlock:
        """The DSpark block after the cache's last position, whose drawn token is ``token`` (dspark.py)."""
        if self.mtp is None:
            raise ValueError("dspark: this model was built without the DSpark drafter (DeepseekV41(..., "
                             "dspark=True), load_v41_model(..., dspark=True))")
        if cache.draft and cache.draft[0].window is not None and cache.draft[0].window.shape[0] != cache.length:
            raise ValueError(f"cache: DSpark context covers {cache.draft[0].window.shape[0]} positions, the "
                             f"target {cache.length}")
        return self.mtp.propose(self.embed, self.head, cache.draft, token, self.cache_qdq, temperature=temperature,
                                noise=noise)

    @torch.no_grad()
    def greedy(self, prompt: torch.Tensor, max_new_tokens: int, replay: str = "off") -> list[int]:
        """Greedy decoding with the cache: one prefill (``replay``: its decoder replay mode), then one position
        per step."""
        cache = self.new_cache()
        logits = self(prompt, cache, replay)
        out: list[int] = []
        for _ in range(max_new_tokens):
            out.append(int(logits[-1].argmax()))
            if len(out) == max_new_tokens:
                break
            logits = self(torch.tensor([out[-1]], device=prompt.device), cache)
        return out
