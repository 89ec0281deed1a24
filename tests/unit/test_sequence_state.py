"""Position-addressed sequence state: rollback is "set the length", chunking and batching are invisible."""

from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.kv.spec import build_layout
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.runner.sequences import SequenceCache
from tests.oracle.hf import tiny_native_config

NATIVE = tiny_native_config(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1,
                            index_topk=4)


def _model(seed: int = 0) -> DeepseekV4:
    torch.manual_seed(seed)
    model = DeepseekV4(ModelConfig.from_dict(NATIVE), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
            elif name.endswith(("attn_sink", "bias", "_base")):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.cfg.n_routed_experts, b.shape))
    return model


MODEL = _model()


def _cache() -> SequenceCache:
    return SequenceCache(build_layout(MODEL.cfg, 128), 12, torch.float32)


def _feed(cache: SequenceCache, sid: int, toks: list[int]) -> torch.Tensor:
    ids, batch = cache.plan({sid: toks})
    out = MODEL.logits(MODEL(ids, batch, cache.storage))
    cache.commit({sid: toks})
    return out


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, MODEL.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_rollback_equals_never_decoded() -> None:
    """Decode k tokens, truncate to an earlier length, decode others: identical to never having decoded."""
    prompt, wrong, right = _tokens(120, 1), _tokens(20, 2), _tokens(15, 3)
    keep = 3  # roll back into the middle of the speculative run; crosses CSA window ends and HCA's pos 127
    rolled = _cache()
    sid = rolled.new_sequence()
    _feed(rolled, sid, prompt)
    for t in wrong:
        _feed(rolled, sid, [t])
    rolled.truncate(sid, len(prompt) + keep)
    after_rollback = [_feed(rolled, sid, [t]) for t in right]

    clean = _cache()
    sid2 = clean.new_sequence()
    _feed(clean, sid2, prompt)
    for t in wrong[:keep]:
        _feed(clean, sid2, [t])
    never = [_feed(clean, sid2, [t]) for t in right]
    for a, b in zip(after_rollback, never):
        assert torch.equal(a, b)


def test_rollback_of_a_chunk_across_an_hca_window() -> None:
    """A multi-token (verify-like) step that closes the HCA window is rolled back and replaced."""
    prompt = _tokens(124, 4)
    rolled, clean = _cache(), _cache()
    a, b = rolled.new_sequence(), clean.new_sequence()
    _feed(rolled, a, prompt)
    _feed(clean, b, prompt)
    _feed(rolled, a, _tokens(6, 5))  # closes window 0 of the HCA layer (position 127) with wrong tokens
    rolled.truncate(a, len(prompt) + 1)
    _feed(clean, b, _tokens(6, 5)[:1])
    replacement = _tokens(6, 6)
    got, ref = _feed(rolled, a, replacement), _feed(clean, b, replacement)
    # Position 124 was computed inside a 6-token step on one side and alone on the other, so GEMM shapes
    # differ and bits may too; the state itself (entries re-emitted from per-position rows) is exact.
    assert (got - ref).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_batched_sequences_match_each_alone() -> None:
    lengths = [5, 130, 33]
    prompts = [_tokens(n, 10 + i) for i, n in enumerate(lengths)]
    alone = []
    for p in prompts:
        cache = _cache()
        alone.append(_feed(cache, cache.new_sequence(), p))
    cache = SequenceCache(build_layout(MODEL.cfg, 128), 16, torch.float32)
    sids = [cache.new_sequence() for _ in prompts]
    ids, batch = cache.plan(dict(zip(sids, prompts)))
    together = MODEL.logits(MODEL(ids, batch, cache.storage))
    offset = 0
    for ref in alone:
        got = together[offset : offset + len(ref)]
        offset += len(ref)
        assert (got - ref).abs().max().item() <= 1e-5
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_released_window_block_is_an_error_not_garbage() -> None:
    """Reading a window position whose block was released must fail loudly."""
    from deepinfer.kv.storage import rows_for

    layout = build_layout(MODEL.cfg, 128)
    spec = layout.layer("layers.0").tensor("window_kv")
    try:
        rows_for((-1, 4), torch.tensor([3]), layout, spec)
    except IndexError as e:
        assert "released" in str(e)
    else:
        raise AssertionError("expected IndexError")
