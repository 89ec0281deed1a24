"""V4.1's batch-invariant mode (``DEEPINFER_BATCH_INVARIANT=1``): every token of a step runs alone.

V4 gets batch invariance from an op table (``ops/ref/batch_invariant.py``): each op computes a row the same
way whatever the batch. V4.1's reference path does not go through that table; its modules call torch
directly, and nearly every op V4.1 adds reduces over something the step's shape reaches:

  * the dense and expert GEMMs (q / KV / output projections, the shared and routed experts, Engram's ``wkv``,
    the DSpark ``main_proj``, the head) block and thread by the number of rows M (row tiles would fix them);
  * the attention core of a sequence reduces over the keys of its whole chunk (the window of its first token
    to its last) with the rows past a query's own keys masked: the reduction length follows the chunk;
  * CSA2 reuse layers and the two-level indexer score a sequence's entries for all of its chunk's queries at
    once, the candidate blocks' pooled scores likewise; Engram's gate norms and the lagged mHC's pre-norm
    projections and stream mixes run over the whole step; score-only routing runs its sqrt-softplus on the
    step's [T, experts] buffer (element-wise functions round a buffer's tail differently, see
    ``ops/ref/row_tiles.whole_lanes``).

Rather than a second, tiled implementation of each, this mode runs each token of the step as a step of its
own (``token_steps``), in the step's order, and the head on one row at a time (``PagedV41.logits``). A token's
forward then sees shapes that depend on its position alone: one row through every GEMM, norm, gate and
element-wise function; exactly its own visible keys (the window (t - W, t], its KV source's first
(t + 1) // ratio entries); the indexer and candidate choices of its own query. Which other sequences share the
step, in which order, how its own prompt was cut into chunks, whether its prefix came from the cache (exact
hits: those rows were computed the same way) or was recomputed after a preemption, and whether a speculative
step verifies k + 1 tokens or decodes one: none of these reaches its bits. The price is speed (one forward per
token: prefill runs at decode speed), which is what the mode is for: tests, RL rollouts, reproductions.

On CUDA the device build (``device.py``) runs the same way, with the batch-invariant Triton table
(``ops/table.select(device, batch_invariant=True)``, which the engine passes it): its kernels (``FP8Dense32``,
the fused experts, the mHC coefficients) and the torch ops between them then always see one token's rows, whose
shapes follow its position alone, and the drafter's blocks decide nothing (coupled verification).

Two V4.1 options compute different things by design and are refused with the mode
(``config/v41_engine.check_v41_engine_args``): the decoder-side replay (a long chunk's decoder layers on its
tail only) and the encoder-side replay of prefix hits (a hit recomputes the window behind the boundary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from deepinfer.model.step_index import HostRuns, StepIndex


def token_steps(index: StepIndex) -> Iterator[tuple[int, StepIndex]]:
    """(flat row, a StepIndex of that token alone) for each token of ``index``, in the step's order. The
    token's sequence ends at its position + 1 (what it may read: the rows before it are written, by an earlier
    step or an earlier token of this one); the other sequences keep their ends but run no token. With the
    step's host facts (``StepIndex.host``: the runner lays each sequence's tokens out contiguously, in table-row
    order) each token's are derived on the host, so a device step reads nothing back per token."""
    per_token = _host_tokens(index.host) if index.host is not None else None
    for i in range(index.token_seq.numel()):
        seq, pos = index.token_seq[i:i + 1], index.positions[i:i + 1]
        seq_end = index.seq_end.clone()
        seq_end[seq] = pos + 1
        # Without host facts (host=None) the step reads its per-sequence facts from these tensors.
        host = per_token[i] if per_token is not None else None
        yield i, dataclasses.replace(index, token_seq=seq, positions=pos, seq_end=seq_end, last_row_only=None,
                                     host=host)


def _host_tokens(host: HostRuns) -> list[HostRuns]:
    """Per token of the step, the host facts of a step of that token alone: its sequence runs one token and
    ends after it; the others run none."""
    out = []
    for s, (n, end) in enumerate(zip(host.lens, host.ends)):
        lens = tuple(int(j == s) for j in range(len(host.lens)))
        for pos in range(end - n, end):
            out.append(HostRuns(lens, host.ends[:s] + (pos + 1,) + host.ends[s + 1:], host.emit_from))
    return out
