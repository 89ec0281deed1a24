"""Triton ``token_mask`` (``ops/triton/token_mask.py``) against ``ops/ref/token_mask.py``, bit for bit.

Random words (every bit pattern, negative words included) at V = 129,280 (V4's vocabulary, a multiple of 32),
odd V (the last word's high bits lie past the vocabulary), B in {1, 7, 128}; all rows listed or a scattered
subset (unlisted rows must not change), rows whose words are all ones, spare words past ceil(V/32), float32
and bf16 logits. The kernel only writes -inf, so any difference is a wrong bit or a wrong row.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.ref.token_mask import token_mask as ref_token_mask


def _tri():
    from deepinfer.ops.triton.token_mask import token_mask

    return token_mask


def _case(B: int, V: int, rows: str, spare: int, dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 4).to(dtype)
    if rows == "all":
        idx = list(range(B))
    else:  # every other row, in a shuffled order
        idx = [int(i) for i in torch.randperm(B, generator=g)[: max(1, B // 2)]]
    words = torch.randint(-(2**31), 2**31, (len(idx), (V + 31) // 32 + spare), generator=g,
                          dtype=torch.int64).to(torch.int32)
    if len(idx) > 2:
        words[1] = -1  # constrained but allowing every token
    sparse = torch.rand(words.shape, generator=g) < 0.5  # and rows with few allowed tokens, as grammars have
    words = torch.where(sparse, words & 0x01010101, words)
    return (logits.to(device), words.to(device), torch.tensor(idx, dtype=torch.int32, device=device))


def _check(logits, words, rows) -> None:
    want, got = logits.clone(), logits.clone()
    ref_token_mask(want, words, rows)
    _tri()(got, words, rows)
    bits = torch.int16 if logits.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))
    assert torch.isinf(got).any()


@pytest.mark.parametrize("B", [1, 7, 128])
@pytest.mark.parametrize("V", [129280, 129281, 4096, 100])
@pytest.mark.parametrize("rows", ["all", "subset"])
def test_token_mask_equals_reference(device, B, V, rows) -> None:
    _check(*_case(B, V, rows, 0, torch.float32, device, seed=B * 7 + V))


@pytest.mark.interpret_ok
@pytest.mark.parametrize("V,spare", [(100, 0), (97, 2), (2048, 0), (2111, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_mask_small_shapes(device, V, spare, dtype) -> None:
    _check(*_case(7, V, "subset", spare, dtype, device, seed=V + spare))
    _check(*_case(3, V, "all", spare, dtype, device, seed=V))


@pytest.mark.interpret_ok
def test_token_mask_without_rows_changes_nothing(device) -> None:
    logits = torch.randn(4, 100, device=device)
    out = logits.clone()
    _tri()(out, torch.zeros(0, 4, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int32, device=device))
    assert torch.equal(out, logits)
