"""Write the bundled demo model: a tiny random DeepSeek-V4 in the released native quantized format.

    python tools/make_demo_model.py [--out deepinfer/assets/demo] [--seed 0]

All three attention kinds (SWA, CSA with ratio 4 and the lightning indexer, HCA with ratio 128), one hash-MoE
layer then routed MoE, mHC, one MTP layer; FP8 e4m3 dense weights with UE8M0 128x128 block scales and FP4
e2m1 experts with per-32 UE8M0 scales. The vocabulary is the bundled byte-level BPE tokenizer's (4096).
Random weights: the engine runs end to end, the text means nothing (a trained demo replaces it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.tools.make_checkpoint import write_random_checkpoint  # noqa: E402

DEMO_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 1,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4, 0],
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 65536,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
    "expert_dtype": "fp4",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "deepinfer" / "assets" / "demo"), help="output directory")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    args = p.parse_args()
    weights = write_random_checkpoint(args.out, DEMO_CONFIG, seed=args.seed)
    n = sum(t.numel() for t in weights.values())
    print(f"wrote {args.out}: {n / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
