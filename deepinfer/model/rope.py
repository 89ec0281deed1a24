"""The model's two RoPE tables: "main" (plain, SWA layers) and "compress" (YaRN, CSA/HCA layers)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config.model import ModelConfig
from deepinfer.ops.ref.rope import apply_rope, cos_sin, inv_freq
from deepinfer.ops.table import REF, OpTable


class RopeTables(nn.Module):
    ops: OpTable = REF  # its ``pointwise`` applies cos/sin (replaced by model/device.py for other tables)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.factors = {"main": cfg.main_rope.attention_factor, "compress": cfg.compress_rope.attention_factor}
        self.register_buffer("main_inv_freq", inv_freq(cfg.main_rope), persistent=False)
        self.register_buffer("compress_inv_freq", inv_freq(cfg.compress_rope), persistent=False)

    def cos_sin(self, table: str, positions: torch.Tensor, dtype: torch.dtype):
        return cos_sin(positions, getattr(self, f"{table}_inv_freq"), self.factors[table], dtype, self.ops.pointwise)

    def rotate(self, table: str, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(table, positions, x.dtype)
        return apply_rope(x, cos, sin)
