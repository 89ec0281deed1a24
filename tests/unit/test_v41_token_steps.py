"""V4.1's batch-invariant mode runs every token of a step alone (``model/v41/invariant.token_steps``). With the
step's host facts (``StepIndex.host``, what the runner hands a device step) each token's are derived on the host:
they must be what the step would otherwise read back from that token's index tensors."""

from __future__ import annotations

import torch

from deepinfer.model.step_index import HostRuns, StepIndex
from deepinfer.model.v41.invariant import token_steps


def _index(host: HostRuns | None) -> StepIndex:
    # Table rows 0 .. 3: row 0 runs positions 5, 6; row 1 nothing (a sequence of the batch without work); row 2
    # positions 0 .. 2; row 3 position 9 (a decode behind a replay boundary).
    table = torch.zeros(4, 1, dtype=torch.int64)
    return StepIndex(token_seq=torch.tensor([0, 0, 2, 2, 2, 3]), positions=torch.tensor([5, 6, 0, 1, 2, 9]),
                     window_table=table, state_table=table, history_table=table,
                     seq_end=torch.tensor([7, 10, 3, 10]), span=16, block_size=16, window=4, kinds=(),
                     spare_window=0, spare_state=0, host=host)


def test_host_facts_of_each_token_are_its_index_tensors() -> None:
    host = HostRuns(lens=(2, 0, 3, 1), ends=(7, 10, 3, 10), emit_from=(0, 0, 0, 8))
    steps = list(token_steps(_index(host)))
    assert [i for i, _ in steps] == list(range(6))
    for _, one in steps:
        lens = torch.bincount(one.token_seq, minlength=one.seq_end.numel()).tolist()
        assert one.host == HostRuns(tuple(lens), tuple(one.seq_end.tolist()), host.emit_from)
    assert [one.host.ends for _, one in steps][:2] == [(6, 10, 3, 10), (7, 10, 3, 10)]


def test_without_host_facts_each_token_reads_its_tensors() -> None:
    assert all(one.host is None for _, one in token_steps(_index(None)))
