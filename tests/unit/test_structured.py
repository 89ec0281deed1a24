"""Structured-output pieces on their own: the constraint's validation, the token-mask layout, and that a
constrained request under async scheduling gets exactly the synchronous loop's tokens."""

from __future__ import annotations

import pytest
import torch

from deepinfer.structured import StructuredOutputsParams

pytest.importorskip("llguidance")

from deepinfer.structured.backend import apply_masks, words_of  # noqa: E402


def test_apply_masks_follows_the_bit_layout() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    words = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    out = apply_masks(logits, words)
    for b in range(3):
        for t in range(vocab):
            allowed = (int(words[b, t // 32]) >> (t % 32)) & 1
            assert out[b, t].item() == (logits[b, t].item() if allowed else float("-inf"))
    assert words_of(words[0].numpy().tobytes()).tolist() == words[0].tolist()


def test_params_validation_names_the_field() -> None:
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'
    assert StructuredOutputsParams.from_dict({"choice": ["a", "b"]}).choice == ("a", "b")
    with pytest.raises(ValueError, match="set exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match=r"structured_outputs\.json_object"):
        StructuredOutputsParams(json_object="yes")
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        StructuredOutputsParams(regex=3)
    with pytest.raises(ValueError, match=r"structured_outputs\.extra: unknown key"):
        StructuredOutputsParams.from_dict({"extra": 1})


def test_async_scheduling_gives_the_synchronous_tokens() -> None:
    from deepinfer import LLM, SamplingParams

    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24,
                             structured_outputs={"regex": r"[a-z]{3}=[0-9]{1,4};"} if s % 2 else None)
              for s in range(6)]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(device="cpu", load_progress=False, block_size=128, async_scheduling=async_scheduling)
        runs.append([o.outputs[0].token_ids for o in llm.generate(["x = "] * 6, params, use_tqdm=False)])
    assert runs[0] == runs[1]
