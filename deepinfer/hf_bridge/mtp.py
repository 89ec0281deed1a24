"""The MTP block composed from Hugging Face modules: HF 5.23 implements no MTP (architecture note §2.7)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config.model import ModelConfig
from deepinfer.hf_bridge.config import hf_config
from deepinfer.model.names import to_native


def mtp_rename(name: str, depth: int = 0) -> str:
    """:class:`HFMTP` parameter name -> native ``mtp.{depth}.*`` name (before any expert split)."""
    if name.startswith("layer."):
        return to_native(f"mtp.{depth}." + name[len("layer."):])
    return f"mtp.{depth}." + to_native(name)


class HFMTP(nn.Module):
    """The MTP block composed from Hugging Face modules (HF 5.23 has no MTP): ``z = h_proj(hnorm(X_p)) +
    e_proj(enorm(embed(t_{p+1})))`` (embedding zeroed at position 0), one sliding-window routed-MoE
    ``DeepseekV4DecoderLayer``, then its own ``hc_head`` and ``norm``; the LM head is the main model's. Parameter
    names map to the native ``mtp.0.*`` names with :func:`mtp_rename`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        self.config = hf_config(cfg, extra_sliding_layers=1)
        self.config._experts_implementation = "eager"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = DeepseekV4DecoderLayer(self.config, cfg.num_hidden_layers)
        self.hc_head = DeepseekV4HyperHead(self.config)
        self.norm = DeepseekV4RMSNorm(h, eps)
        self.enorm = DeepseekV4RMSNorm(h, eps)
        self.hnorm = DeepseekV4RMSNorm(h, eps)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Module,
                rotary_emb: nn.Module) -> torch.Tensor:
        """``streams`` [B, S, N, H]: target final streams at positions 0..S-1; ``next_ids`` [B, S]: token p+1.
        Returns the MTP output streams [B, S, N, H]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        b, s = next_ids.shape
        pos = torch.arange(s, device=next_ids.device)[None].expand(b, -1)
        emb = embed(next_ids).masked_fill((pos == 0)[..., None], 0)
        z = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(emb)).unsqueeze(2)
        rope = {k: rotary_emb(emb, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=emb, attention_mask=None,
                                                 past_key_values=None, position_ids=pos)
        return self.layer(z, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=next_ids,
                          past_key_values=None)

    def logits(self, mtp_streams: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(self.norm(self.hc_head(mtp_streams)))
