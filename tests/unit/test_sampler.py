"""Sampler + counter-based RNG: hand-computed masks and penalties, seeded batch invariance, distributions."""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch

from deepinfer.sampling import (
    SALT_DRAFT,
    SALT_TARGET,
    Sampler,
    SamplingParams,
    SamplingRow,
    child_seed,
    derive_seed,
    gumbel_argmax,
    process_logits,
    prompt_logprobs,
    resolve_seed,
    sample,
)
from deepinfer.sampling.logprobs import topn_stable
from deepinfer.sampling.rng import random_bits, uniform_noise


def row(params: SamplingParams | None = None, *, seed: int = 1, prompt=(7,), output=(), eos=(), position=None) -> SamplingRow:
    return SamplingRow.build(
        params or SamplingParams(), seed=seed, prompt_token_ids=list(prompt), output_token_ids=list(output),
        eos_token_ids=eos, position=position,
    )


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().to(torch.float32)


def kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    out = process_logits(logits, [row(params)])
    return {i for i, v in enumerate(out[0].tolist()) if math.isfinite(v)}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ------------------------------------------------------------------------------------------------ RNG
def _murmur3_32_py(data: bytes, seed: int) -> int:
    mask, c1, c2 = 0xFFFFFFFF, 0xCC9E2D51, 0x1B873593

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    h = seed
    assert len(data) % 4 == 0
    for i in range(0, len(data), 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = rotl((k * c1) & mask, 15) * c2 & mask
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def test_python_murmur_reference_vector() -> None:
    assert _murmur3_32_py(b"test", 0) == 0xBA6BD213  # published MurmurHash3_x86_32 test vector


def test_hash_matches_reference_bit_for_bit() -> None:
    seeds = torch.tensor([0, 5, 2**63 - 1, 123456789012345], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2**32 - 1, 99], dtype=torch.int64)
    for salt in (SALT_TARGET, SALT_DRAFT, 0xFFFFFFFF):
        bits = random_bits(seeds, positions, 12, salt)
        for b in range(4):
            s = int(seeds[b])
            for v in range(12):
                key = struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, int(positions[b]), v)
                assert int(bits[b, v]) == _murmur3_32_py(key, salt)


def test_noise_is_a_function_of_its_coordinates_only() -> None:
    seeds = torch.tensor([11, 22, 33], dtype=torch.int64)
    positions = torch.tensor([5, 5, 6], dtype=torch.int64)
    full = uniform_noise(seeds, positions, 50)
    for b in range(3):
        alone = uniform_noise(seeds[b : b + 1], positions[b : b + 1], 50)
        assert torch.equal(alone[0], full[b])
    perm = torch.tensor([2, 0, 1])
    assert torch.equal(uniform_noise(seeds[perm], positions[perm], 50), full[perm])
    assert not torch.equal(full[0], uniform_noise(seeds[:1], torch.tensor([6]), 50)[0])  # other position
    assert not torch.equal(full[0], uniform_noise(seeds[:1], positions[:1], 50, SALT_DRAFT)[0])  # other salt
    assert bool(((full > 0) & (full < 1)).all())


def test_derive_seed_is_stable_sha256() -> None:
    expected = int.from_bytes(hashlib.sha256(b"req-42").digest()[:8], "little") & (2**63 - 1)
    assert derive_seed("req-42") == expected
    assert derive_seed("req-42") != derive_seed("req-43")
    assert 0 <= derive_seed("") < 2**63
    assert resolve_seed(SamplingParams(seed=9), "req-42") == 9
    assert resolve_seed(SamplingParams(), "req-42") == expected
    assert child_seed(9, 0) == 9 and child_seed(9, 1) != child_seed(9, 2) != 9


def test_gumbel_argmax_matches_softmax_distribution() -> None:
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5], dtype=torch.float64)
    n = 20000
    scores = probs.log().to(torch.float32).expand(n, -1)
    tokens = gumbel_argmax(scores, torch.full((n,), 1234, dtype=torch.int64), torch.arange(n, dtype=torch.int64))
    counts = torch.bincount(tokens, minlength=5).to(torch.float64)
    assert chi_square(counts, probs) < 20.5  # chi2(df=4) p=0.0003; fixed seed, so deterministic
    # Different positions give different draws (not one token repeated).
    assert len(set(tokens[:20].tolist())) > 1


# -------------------------------------------------------------------------------- truncation masks
def test_top_k_keeps_exactly_k_with_lowest_ids_on_ties() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    assert kept(logits, SamplingParams(top_k=1)) == {0}
    assert kept(logits, SamplingParams(top_k=2)) == {0, 2}  # 2, 3 and 5 tie: the lowest id wins
    assert kept(logits, SamplingParams(top_k=3)) == {0, 2, 3}
    assert kept(logits, SamplingParams(top_k=100)) == set(range(6))
    assert kept(logits, SamplingParams(top_k=-1)) == set(range(6))


def test_top_p_keeps_minimal_prefix() -> None:
    logits = logits_of([0.2, 0.4, 0.1, 0.3])
    assert kept(logits, SamplingParams(top_p=0.3)) == {1}
    assert kept(logits, SamplingParams(top_p=0.65)) == {1, 3}
    assert kept(logits, SamplingParams(top_p=0.75)) == {1, 3, 0}
    assert kept(logits, SamplingParams(top_p=0.95)) == {0, 1, 2, 3}
    assert kept(logits, SamplingParams(top_p=1.0)) == {0, 1, 2, 3}
    ties = logits_of([0.3, 0.1, 0.3, 0.3])
    assert kept(ties, SamplingParams(top_p=0.5)) == {0, 2}  # tie at the boundary: lower ids first


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # After top-3: 0.4/0.9, 0.3/0.9, 0.2/0.9 = 0.444, 0.333, 0.222 -> 0.75 needs {0, 1} (0.777).
    assert kept(logits, SamplingParams(top_k=3, top_p=0.75)) == {0, 1}
    assert kept(logits, SamplingParams(top_p=0.75)) == {0, 1, 2}  # without top-k 0.7 < 0.75


def test_min_p_relative_to_max() -> None:
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(logits, SamplingParams(min_p=0.35)) == {0, 1}  # threshold 0.175
    assert kept(logits, SamplingParams(min_p=0.25)) == {0, 1, 2}  # threshold 0.125
    assert kept(logits, SamplingParams(min_p=1.0)) == {0}


def test_temperature_scales_kept_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    out = process_logits(logits, [row(SamplingParams(temperature=0.5))])
    assert torch.equal(out, logits / 0.5)


# ------------------------------------------------------------------------------------ penalties
def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, [row(params, prompt=(0, 1), output=(1, 3, 3))])
    # repetition on seen {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {1: 1, 3: 2}:
    # id 1: -2 - (0.25*1 + 0.5) = -2.75;  id 3: 1.5 - (0.25*2 + 0.5) = 0.5
    assert out[0].tolist() == [1.0, -2.75, 0.5, 0.5, -2.0]
    assert sample(logits, [row(params, prompt=(0, 1), output=(1, 3, 3))]).tolist() == [0]


def test_prompt_tokens_do_not_count_for_presence() -> None:
    logits = torch.tensor([[1.0, 1.0]])
    out = process_logits(logits, [row(SamplingParams(temperature=0, presence_penalty=1.0), prompt=(0, 0), output=(1,))])
    assert out[0].tolist() == [1.0, 0.0]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])  # eos = 2 is the best, stop id 3 next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert sample(logits, [row(params, output=(0,), eos=(2,))]).tolist() == [1]
    assert sample(logits, [row(params, output=(0, 0), eos=(2,))]).tolist() == [2]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [row(ignore, output=(0,), eos=(2,))]).tolist() == [2]
    seeded = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[3], seed=3)
    toks = {sample(logits, [row(seeded, seed=s, eos=(2,))]).tolist()[0] for s in range(50)}
    assert toks <= {0, 1} and toks == {0, 1}


# --------------------------------------------------------------------------------- greedy / seeds
def test_greedy_ignores_seed_and_breaks_ties_by_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    for seed in (0, 1, 2**62):
        assert sample(logits, [row(SamplingParams(temperature=0), seed=seed)]).tolist() == [1]


def _random_rows(seed_base: int) -> list[SamplingRow]:
    variants = [
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3),
        SamplingParams(temperature=0.9, presence_penalty=-1.0, top_k=50, top_p=0.9, logprobs=0),
    ]
    return [row(p, seed=seed_base + i, prompt=(1, 2, 3), output=(4, 4, 9 + i)) for i, p in enumerate(variants)]


def test_each_row_gets_what_it_would_get_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 300
    rows = _random_rows(100)
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    sampler = Sampler()
    full = sampler(logits, rows)
    for b, r in enumerate(rows):
        alone = sampler(logits[b : b + 1], [r])
        assert alone.tolist() == [full.tolist()[b]]
        assert alone.logprobs[0] == full.logprobs[b]
    perm = [3, 0, 4, 2, 1]
    shuffled = sampler(logits[perm], [rows[i] for i in perm])
    assert shuffled.tolist() == [full.tolist()[i] for i in perm]
    # Other neighbours: extra random rows and a larger batch.
    extra = torch.randn(7, vocab, generator=gen)
    mixed_logits = torch.cat([extra[:3], logits, extra[3:]])
    mixed_rows = _random_rows(5)[:3] + rows + _random_rows(900)[:4]
    assert sampler(mixed_logits, mixed_rows).tolist()[3:8] == full.tolist()


def test_seeded_sequence_is_reproducible_across_batches() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab, steps = 64, 40
    seq_logits = torch.randn(steps, vocab, generator=gen)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77)

    def run(neighbours: int, first: bool) -> list[int]:
        out = []
        for t in range(steps):
            me = row(params, seed=77, prompt=(1, 2), output=tuple(out))
            others = [row(SamplingParams(temperature=1.0), seed=1000 + t + j, prompt=(5,)) for j in range(neighbours)]
            other_logits = torch.randn(neighbours, vocab, generator=gen)
            rows = [me, *others] if first else [*others, me]
            logits = torch.cat([seq_logits[t : t + 1], other_logits]) if first else torch.cat([other_logits, seq_logits[t : t + 1]])
            toks = sample(logits, rows).tolist()
            out.append(toks[0] if first else toks[-1])
        return out

    alone = run(0, True)
    assert run(3, True) == alone
    assert run(5, False) == alone
    other_seed = [sample(seq_logits[t : t + 1], [row(SamplingParams(), seed=78, prompt=(1, 2), output=(0,) * t)]).tolist()[0] for t in range(steps)]
    assert other_seed != alone


def test_sampled_distribution_after_top_k_and_temperature() -> None:
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    logits = probs.log().to(torch.float32)[None]
    params = SamplingParams(temperature=0.5, top_k=3)
    n = 6000
    rows = [row(params, seed=5, position=p) for p in range(n)]
    tokens = sample(logits.expand(n, -1).contiguous(), rows).token_ids
    counts = torch.bincount(tokens, minlength=4).to(torch.float64)
    assert counts[0] == 0  # removed by top-k
    target = probs[1:] ** 2 / (probs[1:] ** 2).sum()  # temperature 0.5 squares the probabilities
    assert chi_square(counts[1:], target) < 16.3  # chi2(df=2) p=0.0003


# ------------------------------------------------------------------------------------------ logprobs
def test_logprobs_are_raw_and_ranked() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]])
    raw = torch.log_softmax(logits, dim=-1)[0]
    params = SamplingParams(temperature=0, repetition_penalty=5.0, logprobs=3)
    out = sample(logits, [row(params, prompt=(1, 2))])  # penalties push 1 and 2 below id 4
    assert out.tolist() == [4]
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 4 and lp.rank == 3
    assert lp.logprob == pytest.approx(float(raw[4]), abs=0)
    assert [t for t, _ in lp.top] == [1, 2, 4]  # tie 1/2 ordered by id
    assert [v for _, v in lp.top] == [float(raw[1]), float(raw[2]), float(raw[4])]
    assert sample(logits, [row(SamplingParams(temperature=0))]).logprobs == (None,)
    zero = sample(logits, [row(SamplingParams(temperature=0, logprobs=0))]).logprobs[0]
    assert zero is not None and zero.top == () and zero.rank == 1


def test_topn_stable_tie_order() -> None:
    values = torch.tensor([[0.0, 5.0, 5.0, -1.0, 5.0, float("-inf")], [-3.0, -2.0, -1.0, -1.0, 0.0, -0.5]])
    vals, ids = topn_stable(values, 4)
    assert ids.tolist() == [[1, 2, 4, 0], [4, 5, 2, 3]]
    assert vals.tolist() == [[5.0, 5.0, 5.0, 0.0], [0.0, -0.5, -1.0, -1.0]]


def test_prompt_logprobs() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 10, generator=gen)
    targets = [3, 1, 4, 1]
    out = prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(out):
        assert lp.token_id == targets[i]
        assert lp.logprob == float(raw[i, targets[i]])
        assert lp.rank == int((raw[i] > raw[i, targets[i]]).sum()) + 1
        assert [t for t, _ in lp.top] == torch.argsort(raw[i], descending=True, stable=True)[:2].tolist()
    # Chunked computation gives the same answer.
    assert prompt_logprobs(logits[:2], targets[:2], 2) + prompt_logprobs(logits[2:], targets[2:], 2) == out


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="float32"):
        sample(torch.zeros(1, 4, dtype=torch.float16), [row()])
    with pytest.raises(ValueError, match="B == len"):
        sample(torch.zeros(2, 4), [row()])
    with pytest.raises(ValueError, match="position"):
        SamplingRow(seed=0, position=2**32)
    with pytest.raises(ValueError, match="outside"):
        sample(torch.zeros(1, 4), [row(SamplingParams(min_tokens=1, stop_token_ids=[9]))])


def test_a_batch_that_draws_on_every_row_equals_the_general_path() -> None:
    """``draw``'s shortcut when no row is greedy (no argmax, no row selection) against the general path,
    reached by adding a greedy row: the drawing rows' tokens are the same (rows are independent)."""
    gen = torch.Generator().manual_seed(3)
    drawing = [row(SamplingParams(temperature=0.8, seed=11), position=9),
               row(SamplingParams(temperature=1.3, top_k=7, top_p=0.9, seed=12), position=4),
               row(SamplingParams(temperature=1.0, min_p=0.05, seed=13, frequency_penalty=2.0),
                   output=tuple(range(0, 50, 2)), position=20)]
    greedy = row(SamplingParams(temperature=0))
    for _ in range(5):
        logits = torch.randn(len(drawing) + 1, 50, generator=gen) * 4
        alone = sample(logits[: len(drawing)], drawing).token_ids
        with_greedy = sample(logits, [*drawing, greedy]).token_ids
        assert torch.equal(alone, with_greedy[: len(drawing)])
        assert with_greedy[-1] == logits[-1].argmax()
