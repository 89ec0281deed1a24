"""The fused seeded Gumbel-max draw against ``sampling.rng.gumbel_argmax``: the same token for every row."""

from __future__ import annotations

import pytest
import torch

from deepinfer.sampling import rng


def _case(device: str, rows: int, vocab: int, seed: int, spread: float):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(rows, vocab, generator=g) * spread).to(device)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g, dtype=torch.int64).to(device)
    positions = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64).to(device)
    return scores, seeds, positions


@pytest.mark.interpret_ok
@pytest.mark.parametrize("rows,vocab", [(1, 100), (3, 4097), (5, 2048)])
def test_small_shapes_match_the_reference(device: str, rows: int, vocab: int) -> None:
    from deepinfer.ops.triton.gumbel_argmax import gumbel_argmax

    for spread in (0.0, 0.5, 3.0):  # 0: the noise alone decides; large: the scores mostly do
        scores, seeds, positions = _case(device, rows, vocab, rows * vocab, spread)
        salts = torch.tensor([rng.SALT_DRAFT if r % 2 else rng.SALT_TARGET for r in range(rows)], device=device)
        for salt in (rng.SALT_TARGET, salts):
            want = rng.gumbel_argmax(scores, seeds, positions, salt)
            assert torch.equal(gumbel_argmax(scores, seeds, positions, salt), want)


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_model_vocab_matches_the_reference(device: str, rows: int) -> None:
    from deepinfer.ops.triton.gumbel_argmax import gumbel_argmax

    vocab = 129280
    scores, seeds, positions = _case(device, rows, vocab, rows, 1.0)
    scores[:, vocab // 3:] = float("-inf")  # masked tokens (top-k / grammar) are never drawn
    want = rng.gumbel_argmax(scores, seeds, positions)
    got = gumbel_argmax(scores, seeds, positions)
    assert torch.equal(got, want)
    assert bool((got < vocab // 3).all())
    # Row independence: a row alone draws what it drew inside the batch.
    assert int(gumbel_argmax(scores[-1:], seeds[-1:], positions[-1:])) == int(want[-1])


@pytest.mark.interpret_ok
def test_one_allowed_token_is_drawn_wherever_it_lies(device: str) -> None:
    from deepinfer.ops.triton.gumbel_argmax import gumbel_argmax

    # Only one finite score per row, at the first id, inside a slice, on a slice boundary and at the last id.
    scores = torch.full((4, 5000), float("-inf"), device=device)
    scores[torch.arange(4), torch.tensor([0, 1999, 2048, 4999])] = 0.0
    seeds = torch.arange(4, dtype=torch.int64, device=device)
    positions = torch.zeros(4, dtype=torch.int64, device=device)
    assert gumbel_argmax(scores, seeds, positions).tolist() == [0, 1999, 2048, 4999]


def _variants(fn, device: str) -> int:
    """Compiled variants of a Triton kernel on ``device`` (Triton >= 3.2 keeps them in ``device_caches``)."""
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    return len(caches[torch.device(device).index or 0][0])


def test_unaligned_inputs_compile_no_second_variant(device: str) -> None:
    """Rows' seeds and positions often arrive as slices of one packed copy; at an odd int64 offset their pointers
    are not 16-byte aligned, which Triton would compile another kernel variant for (mid-serving, ~1 s)."""
    if device != "cuda":
        pytest.skip("counts compiled CUDA variants")
    from deepinfer.ops.triton import gumbel_argmax as ga

    rows, vocab = 4, 4097
    scores, seeds, positions = _case(device, rows, vocab, 11, 1.0)
    want = rng.gumbel_argmax(scores, seeds, positions)
    assert torch.equal(ga.gumbel_argmax(scores, seeds, positions), want)
    before = _variants(ga._slices, device)
    packed = torch.cat([positions[:1], seeds, positions])  # seeds at byte 8, positions at byte 40: both unaligned
    odd_seeds, odd_positions = packed[1 : 1 + rows], packed[1 + rows :]
    assert odd_seeds.data_ptr() % 16 and odd_positions.data_ptr() % 16
    assert torch.equal(ga.gumbel_argmax(scores, odd_seeds, odd_positions), want)
    assert _variants(ga._slices, device) == before
