"""Hugging Face models holding deepinfer's (native-named) weights."""

from __future__ import annotations

import torch

from deepinfer.config.model import ModelConfig
from deepinfer.hf_bridge.config import hf_config
from deepinfer.hf_bridge.mtp import HFMTP, mtp_rename
from deepinfer.hf_bridge.weights import native_to_hf_state


def load_hf(cfg: ModelConfig, native: dict[str, torch.Tensor], mtp: bool = True):
    """HF ``DeepseekV4ForCausalLM`` (fp32, eval) holding the native-named weights ``native``, plus an
    :class:`HFMTP` holding ``mtp.0.*`` when ``mtp`` and the config has an MTP layer."""
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM(hf_config(cfg.replace(num_nextn_predict_layers=0)))
    hf.load_state_dict(native_to_hf_state(hf, native), strict=True)
    hf = hf.float().eval()
    block = None
    if mtp and cfg.num_nextn_predict_layers > 0:
        block = HFMTP(cfg)
        block.load_state_dict(native_to_hf_state(block, native, mtp_rename), strict=True)
        block = block.float().eval()
    return hf, block
