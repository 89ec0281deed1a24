"""The DeepSeek-V4.1 oracle: NeMo Automodel 0.7.0's plain-PyTorch ``DeepseekV41ForCausalLM``, on tiny random
configs in float32 on the CPU (``deepseek-v41-oracle.md``).

It is installed without its dependencies (``.ci/run``); tests skip with a reason when it is absent. It runs
with eager attention and torch experts, one CPU thread, and without TorchDynamo (its expert SwiGLU is a
``torch.compile``d function: disabling Dynamo gives the same logits without an Inductor C++ build). Every
parameter is re-randomized with a fixed seed (several start as constants). Its cache quantize-dequantize
(``quantize_cache``) can be swapped for the identity: with it on, one rounding flip before a top-k makes
whole-model logits chaotic, so whole-model parity runs with it off and the quantizers are compared alone.
"""

from __future__ import annotations

import contextlib
import os

import torch

ORACLE = "nemo_automodel.components.models.deepseek_v41"
REASON = ("the V4.1 oracle is not installed: pip install --no-deps nemo-automodel==0.7.0 pillow "
          "(as .ci/run does)")


def tiny_tokenizer(vocab_size: int):
    """A WordLevel fast tokenizer whose entries partly collapse under Engram's normalisation (case, accents,
    surrounding spaces): ``w7``, ``W7``, `` w7`` and ``wé7`` map to one compressed id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    forms = ("w{}", "W{}", " w{}", "w\u00e9{}", "x{}y")
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(forms[i % len(forms)].format(i // len(forms)), len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def tiny_text_config(tokenizer=None, **overrides) -> dict:
    """10 layers: window-only 0-1, ratio-2 sources 2 and 4 (3 reuses 2), ratio-1 candidate source 5, reuse 6
    and 8, re-indexing 7 and 9; Engram before layers 1 and 4 (2- and 3-grams); 8 experts top-2 + shared."""
    from deepinfer.model.v41.engram import compressed_token_map

    d = dict(
        vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=10, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2, n_routed_experts=8,
        num_experts_per_tok=2, sliding_window=16, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[2, 4, 5], index_source_layer_ids=[2, 4, 5, 7, 9], index_n_heads=16, index_head_dim=32,
        index_topk=8, candidate_source_layer_id=5, candidate_topk_blocks=3, candidate_block_size=8,
        engram_layer_ids=[1, 4], engram_num_embeddings=[300, 320], engram_max_ngram_size=3, engram_vocab_size=50,
        engram_n_heads=2, engram_head_dim=32, num_nextn_predict_layers=3, dspark_target_layer_ids=[7, 8, 9],
        dspark_block_size=5, dspark_noise_token_id=509, dspark_markov_rank=16, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2, dtype="float32",
    )
    d.update(overrides)
    if "engram_compressed_vocab_size" not in d:
        d["engram_compressed_vocab_size"] = compressed_token_map(tokenizer or tiny_tokenizer(d["vocab_size"]))[1]
    return d


def checkpoint_config(text: dict, nested: bool = True) -> dict:
    """config.json of a V4.1 checkpoint holding ``text`` (nested under text_config, or flattened)."""
    top = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
           "vision_config": {"num_hidden_layers": 0}, "image_token_id": 129264, "bos_token_id": 0,
           "eos_token_id": 1, "dtype": text.get("dtype", "bfloat16")}
    if nested:
        return {**top, "text_config": {"model_type": "deepseek_v41_text", **text}}
    return {**top, **text}


def _quiet_env() -> None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def build_oracle(text: dict, tokenizer, seed: int = 0):
    """The oracle model on ``text`` (a text_config dict), float32, eager, every parameter random."""
    _quiet_env()
    from transformers import PreTrainedTokenizerFast

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    cfg = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype="float32")
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(cfg, backend=backend, tokenizer=fast).eval()
    _randomize(model, torch.Generator().manual_seed(seed + 1))
    return model


def _randomize(model, g: torch.Generator) -> None:
    """Every parameter and routing bias random; norms, mHC scales and sinks around 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "q_weight", "k_weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith((".scale", "sinks_param.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "engram.embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "bias_vl")):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def released_state(model) -> dict[str, torch.Tensor]:
    """The oracle's weights under the released checkpoint names (its own state-dict adapter)."""
    return {k: v.detach().clone() for k, v in model.state_dict_adapter.to_hf(model.state_dict()).items()}


@contextlib.contextmanager
def cache_quantization_off():
    """Swap the oracle's cache quantize-dequantize for the identity (where its attention and DSpark modules
    imported it)."""
    from nemo_automodel.components.models.deepseek_v41 import attention, dspark

    saved = attention.quantize_cache
    attention.quantize_cache = dspark.quantize_cache = lambda values, **_: values
    try:
        yield
    finally:
        attention.quantize_cache = dspark.quantize_cache = saved


@torch.no_grad()
def oracle_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [T] -> fp32 logits [T, V] of one full forward from position 0. Dynamo is off for the call even
    when torch._dynamo was configured before TORCHDYNAMO_DISABLE was set (another test imported it)."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        return model(ids.view(1, -1)).logits[0].float()


# ---- DSpark -----------------------------------------------------------------------------------------------
# The oracle's DSpark module is a training adapter (random anchors, no cache); these helpers run its backbone
# for one fixed anchor, the way its own forward builds the inputs.


def build_dspark_oracle(target, seed: int = 0):
    """NeMo's ``DeepseekV41DSparkModel`` for ``target``'s config, eager, fp32, every parameter random, the
    target's embedding and head copied in."""
    _quiet_env()
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    torch.manual_seed(seed)
    draft = DeepseekV41DSparkModel(target.config.text_config, backend, num_anchors=1,
                                   enable_confidence_head=True).eval()
    _randomize(draft.mtp, torch.Generator().manual_seed(seed + 7))
    draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings())
    return draft


def dspark_released_state(draft) -> dict[str, torch.Tensor]:
    """The drafter's own weights (``mtp.*``) under the released names."""
    return {k: v for k, v in released_state(draft).items() if k.startswith("mtp.")}


@torch.no_grad()
def oracle_taps(target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """ids [T] -> [T, len(layer_ids) * H]: the stream mean entering each tap layer's attention site, captured
    where NeMo's DSpark trainer captures it (the inputs of ``get_dspark_target_feature_modules``)."""
    captured: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: captured.append(args[0].mean(dim=2)))
             for m in target.get_dspark_target_feature_modules(layer_ids)]
    try:
        oracle_logits(target, ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(captured, dim=-1)[0]


@torch.no_grad()
def oracle_draft(draft, taps: torch.Tensor, token: int, previous: list[int]):
    """One block after the last position p of ``taps`` [p + 1, n * H], anchored on ``token`` (the target's token
    at p + 1), with Markov inputs ``[token, *previous]`` (the drafts before each row) -> (draft logits [B, V],
    confidence logits [B] as the oracle computes them (from the normed state), the pre-norm state [B, H])."""
    import torch._dynamo

    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone

    cfg = draft.config
    block, context = cfg.dspark_block_size, taps.shape[0]
    anchor = torch.tensor([[context]])
    ids = torch.full((1, block), cfg.dspark_noise_token_id)
    ids[0, 0] = token
    previous_ids = torch.tensor([[token, *previous]])
    prenorm: list[torch.Tensor] = []
    hook = draft.mtp[-1].norm.register_forward_pre_hook(lambda _m, args: prenorm.append(args[0]))
    try:
        with torch._dynamo.config.patch(disable=True):
            out = DeepseekV41DSparkBackbone.forward(
                draft, draft.embed_tokens(ids), taps.unsqueeze(0),
                position_ids=draft.build_position_ids(anchor, context),
                attention_mask=draft.build_attention_mask(anchor, torch.ones(1, 1, dtype=torch.bool), context,
                                                          taps.dtype),
                previous_token_ids=previous_ids)
    finally:
        hook.remove()
    logits = draft.compute_logits(out.normalized_hidden_states) + out.transition_logits.float()
    return logits[0], out.confidence_pred[0], prenorm[0][0]
