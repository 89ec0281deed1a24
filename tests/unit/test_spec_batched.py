"""Speculative decoding's device functions against the per-row rules they replace.

* ``verify`` / ``accept_drafts`` (one [sequences, draws] matrix, no loop over rows) equal the per-row rule
  -- keep the draws up to the first one that differs from its draft, plus the target's own token -- on
  random logits and drafts, greedy and seeded-sampled, with sequences whose drafts are all accepted, none,
  some, that have no drafts, or draws before their first draft.
* ``pick_drafts`` equals the per-row draft pick (argmax; for sampled rows argmax of logits / T + the
  target's Gumbel noise at the drafted position), with and without sampled rows in the batch.
* ``chain_step`` fed an index built at the positions of full acceptance and moved back on the device
  (what lets the host build the chain without reading the accepted counts) computes the bits of the
  MTP layer run at the true positions.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deepinfer.kv.spec import POOLS, build_layout
from deepinfer.kv.storage import KVStorage
from deepinfer.model.loader import load_model
from deepinfer.model.step_index import SlotTables, build_slot_index
from deepinfer.runner.mtp_steps import chain_step, rows_and_first_draft
from deepinfer.runner.speculative import verify
from deepinfer.sampling.metadata import SamplingRow
from deepinfer.sampling.params import GREEDY_TEMPERATURE_EPS
from deepinfer.sampling.rng import SALT_TARGET, gumbel_noise
from deepinfer.sampling.sampler import draw
from deepinfer.sampling.speculative import pick_drafts
from deepinfer.sampling.tensors import from_rows
from deepinfer.sched.plan import SeqWork
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint

V = 7  # a small vocabulary: random drafts often equal the draws


def _per_row(tokens: list[int], work: list[SeqWork]) -> list[list[int]]:
    """The per-row rule: each sequence's emitted draws."""
    out, row = [], 0
    for w in work:
        k, d = w.num_samples, w.num_drafts
        draws = tokens[row : row + k]
        drafts = w.token_ids[len(w.token_ids) - d :] if d else ()
        lead = k - 1 - d
        accepted = 0
        while accepted < d and draws[lead + accepted] == drafts[accepted]:
            accepted += 1
        out.append(draws[: lead + accepted + 1])
        row += k
    return out


def _batch(rng: random.Random, sampled: bool) -> tuple[torch.Tensor, list[SeqWork], list[str]]:
    """Random draws of a batch of sequences and their works; the kind of acceptance each was built for."""
    work, kinds, rows = [], [], []
    for s in range(rng.randrange(1, 9)):
        kind = rng.choice(["all", "none", "mixed", "random", "no drafts", "lead"])
        d = 0 if kind == "no drafts" else rng.randrange(1, 5)
        k = d + 1 + (rng.randrange(1, 3) if kind == "lead" else 0)
        rows.append((s, k, d, kind))
    n = sum(k for _, k, _, _ in rows)
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    seeds = [rng.randrange(1 << 40) for _ in rows]
    samp = [SamplingRow(seed=seeds[s], position=10 + j, temperature=0.9 if sampled else 0.0)
            for s, k, _, _ in rows for j in range(k)]
    tokens = draw(logits, from_rows(samp, V, torch.float32, "cpu"))
    row = 0
    for s, k, d, kind in rows:
        draws = tokens[row : row + k].tolist()
        lead = k - 1 - d
        verified = draws[lead : lead + d]
        if kind in ("all", "lead"):
            drafts = verified
        elif kind == "none":
            drafts = [(verified[0] + 1) % V] + [rng.randrange(V) for _ in range(d - 1)]
        elif kind == "mixed":
            cut = rng.randrange(d)
            drafts = verified[:cut] + [(verified[cut] + 1) % V] + [rng.randrange(V) for _ in range(d - cut - 1)]
        else:
            drafts = [rng.randrange(V) for _ in range(d)]
        inputs = tuple(rng.randrange(V) for _ in range(k - d)) + tuple(drafts)
        work.append(SeqWork(f"s{s}", 5, inputs, num_samples=k, num_drafts=d))
        kinds.append(kind)
        row += k
    return tokens, work, kinds


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_acceptance_equals_the_per_row_rule(sampled: bool) -> None:
    rng = random.Random(11 + sampled)
    seen = set()
    for _ in range(60):
        tokens, work, kinds = _batch(rng, sampled)
        want = _per_row(tokens.tolist(), work)
        v = verify(tokens, work, torch.device("cpu"))
        kept = v.kept.tolist()
        emitted = v.emitted.tolist()
        assert [e[:n] for e, n in zip(emitted, kept)] == want
        assert all(t == -1 for e, n in zip(emitted, kept) for t in e[n:])
        assert kept == [len(x) for x in want]
        assert v.accepted.tolist() == [len(x) - 1 - (w.num_samples - 1 - w.num_drafts) for x, w in zip(want, work)]
        keep, last, row = v.keep.tolist(), v.last.tolist(), 0
        for i, (w, x) in enumerate(zip(work, want)):
            assert keep[row : row + w.num_samples] == [j < len(x) for j in range(w.num_samples)]
            assert last[i] == row + len(x) - 1
            row += w.num_samples
        for w, x, kind in zip(work, want, kinds):
            lead = w.num_samples - 1 - w.num_drafts
            if kind in ("all", "lead", "no drafts"):
                assert len(x) == w.num_samples
            elif kind == "none":
                assert len(x) == lead + 1
            seen.add((kind, len(x) - 1 - lead))
    assert {k for k, _ in seen} == {"all", "none", "mixed", "random", "no drafts", "lead"}
    assert len({a for kind, a in seen if kind == "mixed"}) >= 3  # several acceptance lengths in between


def _pick_per_row(logits: torch.Tensor, temps: list[float], seeds: list[int], positions: list[int]) -> list[int]:
    out = []
    for b, t in enumerate(temps):
        if t < GREEDY_TEMPERATURE_EPS:
            out.append(int(torch.argmax(logits[b])))
        else:
            noise = gumbel_noise(torch.tensor([seeds[b]]), torch.tensor([positions[b]]), logits.shape[1], SALT_TARGET)
            out.append(int(torch.argmax(logits[b : b + 1].to(torch.float64) / t + noise, dim=-1)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_pick_equals_the_per_row_pick(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    n, vocab = 12, 300
    logits = (torch.randn(n, vocab, generator=g) * 2).to(dtype)
    temps = [0.0, 0.7, 1.3, 0.0, 0.05, 1.0, 0.0, 2.0, 0.9, 0.0, 1e-6, 0.6]
    seeds = torch.randint(0, 1 << 62, (n,), generator=g).tolist()
    positions = torch.randint(0, 5000, (n,), generator=g).tolist()
    t, s, p = torch.tensor(temps, dtype=torch.float64), torch.tensor(seeds), torch.tensor(positions)
    got = pick_drafts(logits, t, s, p, sampled=True).tolist()
    assert got == _pick_per_row(logits, temps, seeds, positions)
    assert got != torch.argmax(logits, dim=-1).tolist()  # the noise decides some sampled rows
    greedy = torch.zeros(n, dtype=torch.float64)
    assert pick_drafts(logits, greedy, s, p, sampled=False).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert pick_drafts(logits, greedy, s, p, sampled=True).tolist() == torch.argmax(logits, dim=-1).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_chain")
    write_random_checkpoint(path, dict(PRESETS["tiny"], torch_dtype="float32"), seed=5)
    model = load_model(path, dtype=torch.float32, progress=False)
    layout = build_layout(model.cfg, 128)
    storage = KVStorage(layout, {p: 8 for p in POOLS}, torch.float32)
    for t in storage.tensors.values():  # cached rows the MTP layer reads: any content, the same for both runs
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel() % 997)).to(t.dtype))
    tables = SlotTables(4, 4)
    for slot in range(4):
        for pool, arr in tables.arrays.items():
            arr[slot, :2] = [2 * slot, 2 * slot + 1]  # two blocks: positions 0..255
    return model, storage, tables


def test_chain_step_at_shifted_positions_equals_the_true_positions(tiny) -> None:
    model, storage, tables = tiny
    window = model.cfg.sliding_window
    slots = np.array([2, 0, 3], dtype=np.int64)
    true_pos = np.array([130, 7, 200], dtype=np.int64)
    rejected = np.array([2, 0, 3], dtype=np.int64)  # full acceptance would have put the rows further on
    g = torch.Generator().manual_seed(8)
    n = len(slots)
    x = torch.randn(n, model.cfg.hc_mult, model.cfg.hidden_size, generator=g)
    ids = torch.randint(3, model.cfg.vocab_size, (n,), generator=g)
    temps = torch.tensor([0.0, 0.8, 1.1], dtype=torch.float64)
    seeds = torch.tensor([4, 5, 6])
    ones = np.ones(n, dtype=np.int64)

    true_index = build_slot_index(slots, true_pos, ones, tables, storage, window)
    want = model.mtp_forward(x, ids, None, storage, index=true_index)
    want_drafts = pick_drafts(model.mtp_logits(want), temps, seeds, torch.from_numpy(true_pos + 2), sampled=True)

    full_index = build_slot_index(slots, true_pos + rejected, ones, tables, storage, window)
    out, drafts = chain_step(model, storage, x, ids, full_index, torch.from_numpy(-rejected), temps, seeds,
                             sampled=True)
    assert torch.equal(out, want)
    assert torch.equal(drafts, want_drafts)

    # The pass over a step's rows: every row writes the window entry the full pass writes; the FFN half runs at
    # the base rows alone, so their streams equal the full pass's up to the matmuls' row-count rounding, and
    # the head and pick read them.
    rows = build_slot_index(slots, true_pos, ones * 2, tables, storage, window)
    x2 = torch.randn(2 * n, model.cfg.hc_mult, model.cfg.hidden_size, generator=g)
    ids2 = torch.randint(3, model.cfg.vocab_size, (2 * n,), generator=g)
    base = torch.tensor([1, 2, 4])
    before = {k: t.clone() for k, t in storage.tensors.items()}
    full = model.mtp_forward(x2, ids2, None, storage, index=rows)
    written = {k: t.clone() for k, t in storage.tensors.items()}
    assert any(not torch.equal(written[k], before[k]) for k in before)
    for k, t in storage.tensors.items():
        t.copy_(before[k])
    xb, db = rows_and_first_draft(model, storage, x2, ids2, rows, base, temps, seeds, sampled=True)
    assert all(torch.equal(storage.tensors[k], written[k]) for k in written)
    torch.testing.assert_close(xb, full[base], rtol=1e-5, atol=1e-5)
    assert torch.equal(db, pick_drafts(model.mtp_logits(xb), temps, seeds, rows.positions[base] + 2, True))
    # No proposer (prompt chunks): an empty ``rows`` writes the same window entries and runs no FFN half.
    for k, t in storage.tensors.items():
        t.copy_(before[k])
    ffn_rows = []
    hook = model.mtp[0].ffn.register_forward_hook(lambda mod, args, out: ffn_rows.append(len(args[0])))
    try:
        assert model.mtp_forward(x2, ids2, None, storage, index=rows, rows=base[:0]).shape[0] == 0
        rows_and_first_draft(model, storage, x2, ids2, rows, base, temps, seeds, sampled=True)
    finally:
        hook.remove()
    assert ffn_rows == [len(base)]
    assert all(torch.equal(storage.tensors[k], written[k]) for k in written)
