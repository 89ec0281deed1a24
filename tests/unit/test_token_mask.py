"""The op table's ``token_mask`` reference (``ops/ref/token_mask.py``) against the bit layout, token by token:
-inf exactly where a listed row's bit is clear, every other logit (unlisted rows, allowed tokens, bits past
the vocabulary) unchanged to the bit; V not a multiple of 32, spare words, all-ones rows, bf16 logits."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.ref.token_mask import token_mask
from deepinfer.ops.table import REF, REF_BATCH_INVARIANT


def _words(rows: int, num_words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (rows, num_words), generator=g, dtype=torch.int64).to(torch.int32)


def _expected(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> torch.Tensor:
    want = logits.clone()
    v = logits.shape[1]
    for r, row in enumerate(rows):
        for t in range(v):
            if not (int(words[r, t // 32]) >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    return want


@pytest.mark.parametrize("vocab,spare", [(100, 0), (96, 0), (97, 1), (33, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_follows_the_bit_layout(vocab, spare, dtype) -> None:
    B = 7
    logits = torch.randn(B, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    rows = [5, 0, 3]  # not in order; rows 1, 2, 4, 6 unconstrained
    words = _words(len(rows), (vocab + 31) // 32 + spare, seed=vocab + spare)
    words[2] = -1  # a constrained row that allows everything
    want = _expected(logits, words, rows)
    out = logits.clone()
    token_mask(out, words, torch.tensor(rows, dtype=torch.int32))
    assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.isinf(out[5]).any() and torch.equal(out[3], logits[3])


def test_no_rows_and_table_routing() -> None:
    logits = torch.randn(2, 64)
    out = logits.clone()
    token_mask(out, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert torch.equal(out, logits)
    assert REF.token_mask is token_mask and REF_BATCH_INVARIANT.token_mask is token_mask
    with pytest.raises(AssertionError):  # fewer words than the vocabulary needs
        token_mask(out, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
