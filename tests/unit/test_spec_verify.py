"""Coupled verification (runner/speculative.py) on the sampler alone: the emitted tokens are the target's
own seeded draws, so speculative output equals plain sequential sampling token for token, and therefore
follows the target distribution (chi-square over many seeds on a tiny vocabulary)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from deepinfer.runner.speculative import verify
from deepinfer.sampling.metadata import SamplingRow
from deepinfer.sampling.sampler import draw, process_random_rows
from deepinfer.sampling.tensors import from_rows
from deepinfer.sched.plan import SeqWork

V, N, K, LENGTH = 5, 6000, 2, 3  # vocabulary, seeds, drafts per step, tokens generated
TEMPERATURE, TOP_K = 0.7, 4

g = torch.Generator().manual_seed(0)
TARGET = torch.randn(V, V, generator=g) * 2  # Markov chain: logits of the next token given the previous one
DRAFT = torch.randn(V, V, generator=g) * 2  # a different chain proposes the drafts


def _draw(prev: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    rows = [SamplingRow(seed=s, position=p, temperature=TEMPERATURE, top_k=TOP_K) for s, p in zip(seeds, positions)]
    return draw(TARGET[prev].contiguous(), from_rows(rows, V, torch.float32, "cpu"))


def _plain(seeds: list[int]) -> torch.Tensor:
    """Sequential sampling, one token per step, from token 0 at position 0."""
    out, prev = [], torch.zeros(len(seeds), dtype=torch.long)
    for p in range(1, LENGTH + 1):
        prev = _draw(prev, seeds, [p] * len(seeds))
        out.append(prev)
    return torch.stack(out, 1)


def _speculative(seeds: list[int]) -> torch.Tensor:
    """One verify step of K drafts from the draft chain, then plain draws for what it did not cover."""
    n = len(seeds)
    dg = torch.Generator().manual_seed(1)
    drafts, prev = [], torch.zeros(n, dtype=torch.long)
    for _ in range(K):
        prev = torch.multinomial(torch.softmax(DRAFT[prev], -1), 1, generator=dg)[:, 0]
        drafts.append(prev)
    drafts = torch.stack(drafts, 1)
    inputs = torch.cat([torch.zeros(n, 1, dtype=torch.long), drafts], 1)  # last token + drafts, per seed
    tokens = _draw(inputs.reshape(-1), [s for s in seeds for _ in range(K + 1)], list(range(1, K + 2)) * n)
    work = [SeqWork(str(i), 0, tuple(inputs[i].tolist()), num_samples=K + 1, num_drafts=K) for i in range(n)]
    v = verify(tokens, work, torch.device("cpu"))
    tokens, accepted = tokens.view(n, K + 1).tolist(), v.accepted.tolist()
    out = [tokens[i][: accepted[i] + 1] for i in range(n)]
    for p in range(2, LENGTH + 1):  # position p for the seeds whose step stopped before it, in one batch
        short = [i for i in range(n) if len(out[i]) == p - 1]
        if short:
            new = _draw(torch.tensor([out[i][-1] for i in short]), [seeds[i] for i in short], [p] * len(short))
            for i, t in zip(short, new.tolist()):
                out[i].append(t)
    out = [o[:LENGTH] for o in out]
    assert 0 < sum(accepted) < K * n  # drafts are sometimes accepted, sometimes not
    return torch.tensor(out)


def test_coupled_verification_equals_plain_sampling_and_follows_the_target() -> None:
    seeds = list(range(1000, 1000 + N))
    spec = _speculative(seeds)
    assert torch.equal(spec, _plain(seeds))
    # The exact law of a generated triple under the processed target (temperature, top-k).
    probs = torch.softmax(process_random_rows(TARGET, [SamplingRow(seed=0, position=1, temperature=TEMPERATURE,
                                                                   top_k=TOP_K)] * V).double(), -1)
    law = probs[0][:, None, None] * probs[:, :, None] * probs[None, :, :]
    cells = (spec[:, 0] * V + spec[:, 1]) * V + spec[:, 2]
    observed = torch.bincount(cells, minlength=V ** 3).double()
    expected = law.reshape(-1) * N
    keep = expected > 5
    assert observed[~keep].sum() <= 0.01 * N  # top-k removed cells stay (nearly) empty: they are impossible
    assert observed[expected == 0].sum() == 0
    obs, exp = observed[keep], expected[keep]
    exp = exp * obs.sum() / exp.sum()
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


def test_placeholder_drafts_verify_as_known_ones() -> None:
    """Drafts the host does not have (async scheduling: a step planned on the drafts of the one in flight)
    are read from the step's input ids on the device: the same verification as with the drafts in the
    plan, in a batch that mixes both, prefill-like draws before the drafts, and sequences without drafts."""
    rng = torch.Generator().manual_seed(3)
    shapes = [(3, 2, 3), (1, 0, 1), (4, 3, 4), (5, 2, 3), (2, 1, 2), (3, 2, 3)]  # (inputs, drafts, draws)
    known, mixed, inputs = [], [], []
    for i, (n, d, k) in enumerate(shapes):
        ids = tuple(torch.randint(0, V, (n,), generator=rng).tolist())
        inputs.extend(ids)
        known.append(SeqWork(str(i), 0, ids, num_samples=k, num_drafts=d))
        # Every other verify work: all of its inputs placeholders (its last emitted token and its drafts).
        placeholder = d and n == d + 1 and i % 2 == 0
        mixed.append(SeqWork(str(i), 0, (), num_placeholders=n, num_samples=k, num_drafts=d) if placeholder
                     else known[-1])
    assert any(w.num_placeholders for w in mixed) and any(w.num_drafts and not w.num_placeholders for w in mixed)
    starts = torch.cumsum(torch.tensor([0] + [n for n, _, _ in shapes[:-1]]), 0).tolist()
    input_ids = torch.tensor(inputs)
    for trial in range(20):  # draws that match the drafts to every depth
        tokens = []
        for w in known:
            drafts = list(w.token_ids[len(w.token_ids) - w.num_drafts :])
            hit = int(torch.randint(0, w.num_drafts + 1, (1,), generator=rng))
            draws = torch.randint(0, V, (w.num_samples,), generator=rng).tolist()
            lead = w.num_samples - 1 - w.num_drafts
            draws[lead : lead + hit] = drafts[:hit]
            tokens.extend(draws)
        tokens = torch.tensor(tokens)
        want = verify(tokens, known, torch.device("cpu"))
        got = verify(tokens, mixed, torch.device("cpu"), input_ids, starts)
        for name in ("accepted", "keep", "last", "emitted", "kept", "shift"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (trial, name)
        assert torch.equal(want.shift, want.accepted - torch.tensor([d for _, d, _ in shapes]))
