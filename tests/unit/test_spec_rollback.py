"""Rolling back rejected drafts is exact: a verify step whose rejected tokens closed a CSA window, an HCA
window and an indexer window (and wrote window, compressor-state and MTP rows) is undone by setting the
length (``CacheManager.truncate``). Then the pools' integrity check is clean, nothing past the length is
ever read (poisoning every such row with NaN changes no bit of the next step), and the next token's logits
equal those of a cache rebuilt from scratch from the accepted tokens."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.kv.manager import CacheManager
from deepinfer.kv.spec import POOLS, build_layout
from deepinfer.kv.storage import KVStorage, rows_for
from deepinfer.model.batch import ForwardBatch, SeqRun
from deepinfer.model.loader import load_model
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint

PROMPT, K, ACCEPTED = 125, 4, 1  # the verify step covers positions 125..129; 127 closes CSA and HCA windows


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_rollback")
    write_random_checkpoint(path, dict(PRESETS["tiny"], torch_dtype="float32"), seed=2)
    return load_model(path, dtype=torch.float32, progress=False)


class _Seq:
    """One sequence on a CacheManager + KVStorage, stepping the target and the MTP layer together."""

    def __init__(self, model) -> None:
        self.model = model
        self.layout = build_layout(model.cfg, 128)
        self.cache = CacheManager(self.layout, {p: 4 for p in POOLS}, spec_slack=K)
        self.storage = KVStorage(self.layout, {p: 4 for p in POOLS}, torch.float32)
        self.cache.allocate("s", 0)

    def step(self, tokens: list[int], next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.cache.length("s")
        self.cache.allocate("s", len(tokens))
        batch = ForwardBatch((SeqRun(0, len(tokens), first, self.cache.block_tables("s")),))
        streams = self.model(torch.tensor(tokens), batch, self.storage)
        mtp = self.model.mtp_forward(streams, torch.tensor(next_ids), batch, self.storage)
        self.cache.commit("s", first + len(tokens))
        return self.model.logits(streams), self.model.mtp_logits(mtp)

    def poison_past_length(self) -> int:
        """NaN into every row of every pool at positions (entries) the length does not cover."""
        n, cap, poisoned = self.cache.length("s"), self.cache.capacity("s"), 0
        tables = self.cache.block_tables("s")
        for (key, name), tensor in self.storage.tensors.items():
            spec = self.layout.layer(key).tensor(name)
            lo = n if spec.stride == 1 else n // spec.stride  # entry j is closed by position (j+1)m - 1 < n
            idx = torch.arange(lo, cap // spec.stride)
            tensor[rows_for(tables[spec.pool], idx, self.layout, spec)] = float("nan")
            poisoned += len(idx)
        return poisoned


def test_rollback_is_exact_and_the_pools_stay_consistent(model) -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(3, model.cfg.vocab_size) for _ in range(PROMPT + K + 2)]
    accepted = tokens[: PROMPT + 1 + ACCEPTED]  # prompt, its last token's successor, one accepted draft
    nxt = tokens[PROMPT + 1 + ACCEPTED]  # the token after them (the target's own at the first rejection)
    wrong = [(t + 1) % model.cfg.vocab_size for t in tokens[PROMPT + 2 : PROMPT + 1 + K]]  # rejected drafts

    def speculative(poison: bool):
        s = _Seq(model)
        s.step(tokens[:PROMPT], tokens[1 : PROMPT + 1])
        verify_inputs = tokens[PROMPT : PROMPT + 1 + ACCEPTED] + wrong  # last token + K drafts
        # The MTP layer reads the draw at each row: the accepted draft, then the target's token, then junk.
        draws = tokens[PROMPT + 1 : PROMPT + 1 + ACCEPTED] + [nxt] + [5] * (K - ACCEPTED)
        s.step(verify_inputs, draws)
        s.cache.truncate("s", len(accepted))  # keep the last token and the accepted draft
        s.cache.check_integrity()
        if poison:
            assert s.poison_past_length() > 0
        return s.step([nxt], [tokens[len(accepted) + 1]])

    logits, mtp_logits = speculative(poison=False)
    poisoned = speculative(poison=True)
    assert torch.isfinite(poisoned[0]).all() and torch.isfinite(poisoned[1]).all()
    assert torch.equal(poisoned[0], logits) and torch.equal(poisoned[1], mtp_logits)

    scratch = _Seq(model)
    seq = accepted + [nxt]
    want, want_mtp = scratch.step(seq, seq[1:] + [tokens[len(seq)]])
    assert torch.allclose(logits[-1], want[-1], atol=1e-4, rtol=0)
    assert torch.allclose(mtp_logits[-1], want_mtp[-1], atol=1e-4, rtol=0)
    assert torch.equal(logits[-1].argmax(), want[-1].argmax())
