"""The MTP block (mtp.0) against an oracle composed from Hugging Face modules.

HF does not implement MTP, but an MTP block is an ordinary sliding-window decoder layer: the oracle runs
HF's DeepseekV4DecoderLayer on z = h_proj(hnorm(X)) + e_proj(enorm(embed(next))) (embedding zeroed at
position 0), then HF's hc_head, final norm and the shared LM head (architecture note §2.7).
The package's own composition (deepinfer.hf_bridge.HFMTP, used by deepinfer eval and the demo trainer) is
checked against the same oracle.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.config import ModelConfig
from deepinfer.hf_bridge import hf_state_to_native
from deepinfer.kv.spec import build_layout
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.runner.sequences import SequenceCache
from tests.oracle.hf import build_hf, tiny_native_config

pytest.importorskip("transformers")

T = 150  # > sliding window: the MTP window cache wraps


def _rms(x, w, eps=1e-6):
    x = x.float()
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.fixture(scope="module")
def setup():
    native = tiny_native_config(num_hidden_layers=1, compress_ratios=[0, 0], num_hash_layers=0)
    hf = build_hf(native, seed=5)
    ours = DeepseekV4(ModelConfig.from_dict(native), dtype=torch.float32)
    state = {}
    for name, t in hf_state_to_native(hf.state_dict()).items():
        if name.startswith("layers.0."):
            state["mtp.0." + name[len("layers.0."):]] = t
        elif name.startswith("hc_head_"):
            state["mtp.0." + name] = t
        elif name == "norm.weight":
            state["mtp.0.norm.weight"] = t
        elif name in ("embed.weight", "head.weight"):
            state[name] = t
    g = torch.Generator().manual_seed(9)
    h = native["hidden_size"]
    for name in ("e_proj.weight", "h_proj.weight"):
        state[f"mtp.0.{name}"] = torch.randn(h, h, generator=g) * 0.2
    for name in ("enorm.weight", "hnorm.weight"):
        state[f"mtp.0.{name}"] = 1 + 0.1 * torch.randn(h, generator=g)
    missing = ours.load_state_dict(state, strict=False).missing_keys
    assert all(not k.startswith("mtp.") for k in missing), missing
    return native, hf, ours, state


def _oracle(hf, state, streams, next_ids):
    from transformers.masking_utils import create_sliding_window_causal_mask

    pos = torch.arange(len(next_ids))
    emb = hf.model.embed_tokens(next_ids).masked_fill((pos == 0)[:, None], 0)
    z = F.linear(_rms(streams, state["mtp.0.hnorm.weight"]), state["mtp.0.h_proj.weight"]) + F.linear(
        _rms(emb, state["mtp.0.enorm.weight"]), state["mtp.0.e_proj.weight"]).unsqueeze(1)
    m = hf.model
    rope = {k: m.rotary_emb(emb[None], position_ids=pos[None], layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=emb[None], attention_mask=None,
                                             past_key_values=None, position_ids=pos[None])
    out = m.layers[0](z[None], position_embeddings=rope, position_ids=pos[None], attention_mask=mask,
                      input_ids=next_ids[None], past_key_values=None)
    return hf.lm_head(m.norm(m.hc_head(out)))[0]


def test_mtp_logits_match_hf_composed_oracle_prefill_and_decode(setup) -> None:
    native, hf, ours, state = setup
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(T, ours.cfg.hc_mult, native["hidden_size"], generator=g)
    next_ids = torch.randint(3, native["vocab_size"], (T,), generator=g)
    with torch.no_grad():
        ref = _oracle(hf, state, streams, next_ids)

    def run(chunks):
        cache = SequenceCache(build_layout(ours.cfg, 128), 4, torch.float32)
        sid, pos, out = cache.new_sequence(), 0, []
        for n in chunks:
            ids, batch = cache.plan({sid: next_ids[pos : pos + n].tolist()})
            out.append(ours.mtp_logits(ours.mtp_forward(streams[pos : pos + n], ids, batch, cache.storage)))
            cache.commit({sid: ids.tolist()})
            pos += n
        return torch.cat(out)

    for chunks in ([T], [37, 1, 90, 22], [1] * T):
        got = run(chunks)
        assert (got - ref).abs().max().item() <= 1e-4
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_hf_bridge_mtp_block_matches_the_composed_oracle(setup) -> None:
    """deepinfer.hf_bridge.HFMTP (what deepinfer eval and the demo trainer use) is the same MTP block."""
    from deepinfer.hf_bridge import HFMTP, mtp_rename, native_to_hf_state

    native, hf, ours, state = setup
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(T, ours.cfg.hc_mult, native["hidden_size"], generator=g)
    next_ids = torch.randint(3, native["vocab_size"], (T,), generator=g)
    block = HFMTP(ours.cfg)
    block.load_state_dict(native_to_hf_state(block, state, mtp_rename), strict=True)
    block = block.float().eval()
    with torch.no_grad():
        ref = _oracle(hf, state, streams, next_ids)
        got = block.logits(block(streams[None], next_ids[None], hf.model.embed_tokens, hf.model.rotary_emb),
                           hf.lm_head)[0]
    assert (got - ref).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
