"""Random Hugging Face DeepseekV4ForCausalLM oracles on tiny configs, and deepinfer models holding their weights.

The weight-name mapping itself is the package's (:mod:`deepinfer.hf_bridge`).
"""

from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.hf_bridge import hf_state_to_native
from deepinfer.model.deepseek_v4 import DeepseekV4


def tiny_native_config(**overrides) -> dict:
    d = dict(
        model_type="deepseek_v4", vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, compress_ratios=[0, 4, 128, 0],
        num_hash_layers=1, index_n_heads=16, index_head_dim=16, index_topk=8, sliding_window=128,
        rope_scaling={"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 65536},
        num_nextn_predict_layers=1, torch_dtype="float32",
    )
    d.update(overrides)
    return d


def build_hf(native: dict, seed: int = 0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**native)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).eval().float()
    randomize_zero_inits(model, seed)
    return model


def randomize_zero_inits(model, seed: int) -> None:
    """HF initializes tid2eid, sinks, position biases, router bias and mHC bases to constants: randomize."""
    g = torch.Generator().manual_seed(seed + 1)
    n_exp = model.config.n_routed_experts
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("tid2eid"):
                t.copy_(torch.randint(0, n_exp, t.shape, generator=g))
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def ours_from_hf(hf_model, native: dict, dtype=torch.float32) -> DeepseekV4:
    cfg = ModelConfig.from_dict(native)
    ours = DeepseekV4(cfg, dtype=dtype)
    state = hf_state_to_native(hf_model.state_dict())
    own = ours.state_dict()
    missing = [k for k in own if k not in state and not k.startswith("mtp.")]
    extra = [k for k in state if k not in own]
    assert not missing and not extra, (missing[:5], extra[:5])
    ours.load_state_dict({**own, **state}, strict=True)
    return ours
