"""The many-program argmax against ``torch.argmax``: the same index for every row (first maximum, NaN largest,
-0.0 == +0.0), for the dtypes logits come in."""

from __future__ import annotations

import pytest
import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _levels(rows: int, vocab: int, levels: int, seed: int) -> torch.Tensor:
    """Few distinct values, so most rows' maximum occurs several times (ties decided by the lowest id)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-levels, levels, (rows, vocab), generator=g).float() / 4


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 100), (3, 4097), (5, 2048), (2, 6000)])
def test_ties_and_special_values_match_torch(device: str, dtype: torch.dtype, rows: int, vocab: int) -> None:
    from deepinfer.ops.triton.argmax import argmax_rows

    x = _levels(rows, vocab, 3, rows * vocab)
    special = x.clone()
    special[0, :] = -0.0
    special[0, vocab // 2] = 0.0  # -0.0 and +0.0 tie: the first one wins
    if rows > 1:
        special[1, :] = float("-inf")
        if vocab > 2:
            special[1, vocab - 2] = float("nan")  # NaN beats every value, +inf included
            special[1, vocab - 1] = float("nan")
            special[1, 0] = float("inf")
    if rows > 2:
        special[2, vocab // 3] = float("inf")
    for case in (x, special, -x):
        t = case.to(dtype).to(device)
        assert torch.equal(argmax_rows(t), torch.argmax(t, dim=-1)), case
    # A strided view (every other column) reads the same values as its copy.
    wide = x.repeat(1, 2).to(dtype).to(device)[:, ::2]
    assert torch.equal(argmax_rows(wide), torch.argmax(wide, dim=-1))


@pytest.mark.parametrize("rows", [1, 4, 7, 128, 300])
def test_model_vocabulary_matches_torch(device: str, rows: int) -> None:
    from deepinfer.ops.triton.argmax import argmax_rows

    vocab = 129280
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, vocab, generator=g)
    top = x.max(dim=-1).values + 1
    x[:, vocab - 7] = top  # the maximum twice, in different slices: the lower id must win
    x[: rows // 2, 11] = top[: rows // 2]
    for dtype in DTYPES:
        t = x.to(dtype).to(device)
        got = argmax_rows(t)
        assert torch.equal(got, torch.argmax(t, dim=-1))
        # Row independence: a row alone gets what it got inside the batch.
        assert int(argmax_rows(t[-1:])) == int(got[-1])


@pytest.mark.interpret_ok
def test_bad_input_names_the_shape(device: str) -> None:
    from deepinfer.ops.triton.argmax import argmax_rows

    with pytest.raises(ValueError, match="argmax_rows: x must be a \\[B, V\\] tensor"):
        argmax_rows(torch.zeros(4, dtype=torch.float32, device=device))
    with pytest.raises(ValueError, match="dtype one of bfloat16, float16, float32"):
        argmax_rows(torch.zeros(2, 3, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="V >= 1"):
        argmax_rows(torch.zeros(2, 0, device=device))
