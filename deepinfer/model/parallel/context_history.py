"""What a context-parallel (CP) rank keeps of a sequence's history between the sequence's CP chunks, so that
each chunk's broadcast carries only what is new (``model/parallel/context.py``).

The queries of a CP chunk read the sequence's history: the window rows of the 127 positions before the chunk,
and every compressed entry (and CSA index key) up to the chunk's end. Only the owner's cache holds them.
Sending all of it with every chunk costs bytes linear in the position, so a prompt prefilled in C chunks
moves history quadratic in C. Instead every rank of the CP group keeps a ``HistoryReplica`` of the sequence:
  * ``pos``: the history covers positions [0, pos) (the end of the sequence's last CP chunk; 0: none);
  * on a rank that is not the owner, per attention layer, the window rows of positions pos-127 .. pos-1
    (zeros before position 0) and the entries / index keys [0, pos // ratio).
The window rows come free: they are the tail of the last chunk's gathered K=V rows, which every rank of the
group had. The entries the chunk closed are broadcast by the owner after it computed them, and appended.
So a chunk following the sequence's previous CP chunk receives only the entries closed within it. A chunk
after positions that ran outside CP (the sequence's chunk was not the group's pick in some step, or a prefix
hit) also receives the window rows and entries of the positions the replica lacks; a chunk before ``pos``
(cannot happen without the sequence leaving the batch first, but cheap to be safe against) starts over.

Every rank of the group applies the same rules to the same orders, so the owner knows what the other ranks
hold without asking; the owner's replica keeps ``pos`` only (it reads its cache). A rank holds one replica
per DP rank of its group: the group's pick (the longest chunk) moves between its ranks' prompts as their
budgets fill with other work, and each keeps its own. A chunk of another sequence of the same owner replaces
that owner's replica (a DP rank prefills its prompts mostly one after the other), and a replica is dropped
when its sequence leaves its owner's batch (finished, preempted, aborted: the plan's ``left``) or draws (its
prefill ended). So a rank's replica memory is bounded by cp - 1 sequences' history (``engine/cp_plan.py``
counts it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.sched.plan import StepPlan


GROWTH = 1.25  # a replica's buffers grow by a quarter at least: at most 5/4 of its rows held, ~5 copies per row


class GrowingRows:
    """Rows appended chunk by chunk, with one zero row past the last (what the -1 padding columns of the
    attention ops' indices name); capacity grows geometrically (``GROWTH``), so appends copy each row O(1)
    times."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self.count = 0

    def append(self, rows: torch.Tensor) -> None:
        n = self.count + len(rows)
        if self._buf is None or len(self._buf) < n + 1:
            grown = rows.new_empty(max(n + 1, int(GROWTH * (0 if self._buf is None else len(self._buf)))),
                                   *rows.shape[1:])
            if self._buf is not None:
                grown[: self.count] = self._buf[: self.count]
            self._buf = grown
        self._buf[self.count : n] = rows
        self._buf[n] = 0
        self.count = n

    def padded(self, like: torch.Tensor) -> torch.Tensor:
        """The rows and the zero row after them (``like``: a row of the pool, for an empty replica)."""
        return like.new_zeros(1, *like.shape[1:]) if self._buf is None else self._buf[: self.count + 1]

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.nbytes


class HistoryReplica:
    """One sequence's history as the ranks of its CP group hold it (see the module docstring)."""

    def __init__(self, owner: int, seq_id: str) -> None:
        self.owner, self.seq_id = owner, seq_id
        self.pos = 0
        self.window: dict[str, torch.Tensor] = {}  # layer -> rows of positions pos-127 .. pos-1
        self.pools: dict[tuple[str, str], GrowingRows] = {}  # (layer, "entries" | "index_keys") -> [0, pos // m)

    def reset(self) -> None:
        self.pos = 0
        self.window.clear()
        self.pools.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.window.values()) + sum(p.nbytes for p in self.pools.values())


class HistoryReplicas:
    """A rank's replicas, one per DP rank of its CP group at most (the owner of the sequence), and the rules that
    keep them in step with the group's other ranks.

    ``track`` before a step that runs a CP chunk of the rank's group; ``retire`` before and ``finish_step``
    after every step, with the step's plans (every DP rank's: a rank reads its peers' departures there)."""

    def __init__(self) -> None:
        self.replicas: dict[int, HistoryReplica] = {}  # owner DP rank -> its sequence's replica
        self.chunks_from_replica = 0  # CP chunks that started where their replica ended (pos > 0)
        self.catch_ups = 0  # CP chunks that started past it: the positions in between are sent
        self.dropped_on_leave = 0  # replicas dropped as their sequence left the batch mid-prefill

    def track(self, owner: int, seq_id: str, first_pos: int) -> HistoryReplica:
        """The replica for a CP chunk of ``seq_id`` (in DP rank ``owner``'s plan) from ``first_pos`` on."""
        r = self.replicas.get(owner)
        if r is None or r.seq_id != seq_id:  # another sequence of that owner: it replaces the one held
            r = self.replicas[owner] = HistoryReplica(owner, seq_id)
        if first_pos < r.pos:  # positions it holds are being recomputed: start over
            r.reset()
        if first_pos > r.pos:
            self.catch_ups += 1
        elif r.pos:
            self.chunks_from_replica += 1
        return r

    def retire(self, plans: Sequence[StepPlan]) -> None:
        """Before a step: drop the replicas of sequences that left their owner's batch."""
        for owner, r in list(self.replicas.items()):
            if r.seq_id in plans[owner].left:
                del self.replicas[owner]
                self.dropped_on_leave += 1

    def finish_step(self, plans: Sequence[StepPlan]) -> None:
        """After a step: drop the replicas of sequences that drew a token (their prefill is over)."""
        for owner, r in list(self.replicas.items()):
            if any(w.seq_id == r.seq_id and w.num_samples for w in plans[owner].work):
                del self.replicas[owner]

    def held(self, seq_id: str) -> HistoryReplica | None:
        return next((r for r in self.replicas.values() if r.seq_id == seq_id), None)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.replicas.values())

    def __len__(self) -> int:
        return len(self.replicas)
