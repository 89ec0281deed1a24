"""How many blocks each cache pool gets: the bounds a running sequence or a cached boundary needs, and the split
of a byte budget into block counts per pool. Pure Python, like the manager that uses these counts."""

from __future__ import annotations

from deepinfer.config.model import CSA
from deepinfer.kv.spec import HISTORY, POOLS, STATE, WINDOW, CacheLayout

TAIL_POOLS = (WINDOW, STATE)  # pools whose old blocks are released as the sequence grows


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tail_blocks_per_seq(layout: CacheLayout, pool: str, spec_slack: int = 0) -> int:
    """Most blocks of a tail pool one running sequence holds while steps add at most ``block_size`` tokens.

    Between steps it holds [n - tail - slack, n) plus leftovers of the last allocation; a step adds up to
    one block of new positions. A span of tail + slack + bs positions touches at most
    ceil((tail + slack + bs) / bs) + 1 blocks when it does not start on a block boundary.
    """
    bs = layout.block_size
    return cdiv(layout.tail(pool) + spec_slack + bs, bs) + 1


def replay_length(layout: CacheLayout) -> int:
    """Positions a bounded replay recomputes before a block boundary: the largest CSA ratio (0: none needed)."""
    if not any(t.pool == STATE for s in layout.layers for t in s.tensors):
        return 0
    return max((s.ratio for s in layout.layers if s.kind == CSA), default=0)


def tail_blocks_per_boundary(layout: CacheLayout, pool: str) -> int:
    """Blocks of a tail pool that keep a block boundary usable by prefix hits: the window blocks covering the
    window behind a bounded replay (state blocks are then not needed; without a replay, the state tail's)."""
    holds_rows = any(t.pool == pool for s in layout.layers for t in s.tensors)
    if not holds_rows or layout.prefix_replay:  # V4.1's encoder-side replay: a hit needs history blocks only
        return 0
    replay = replay_length(layout)
    if pool == WINDOW:
        return cdiv(layout.tail(WINDOW) + replay, layout.block_size)
    return 0 if replay else cdiv(layout.tail(pool), layout.block_size)


def retained_tail_blocks(layout: CacheLayout, memory_bytes: int, model_dtype_bytes: int) -> dict[str, int]:
    """Extra window/state blocks that keep the tails of ``memory_bytes // (bytes of one boundary's tails)``
    cached block boundaries (prefix caching: a hit needs them besides the history blocks)."""
    per_boundary = sum(tail_blocks_per_boundary(layout, p) * layout.bytes_per_block(p, model_dtype_bytes)
                       for p in TAIL_POOLS)
    boundaries = memory_bytes // per_boundary if per_boundary else 0
    return {p: boundaries * tail_blocks_per_boundary(layout, p) for p in TAIL_POOLS}


def blocks_for_budget(
    layout: CacheLayout,
    memory_bytes: int,
    model_dtype_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    *,
    spec_slack: int = 0,
    max_num_batched_tokens: int | None = None,
    retained_fraction: float = 0.0,
) -> dict[str, int]:
    """Split ``memory_bytes`` of cache storage into block counts per pool.

    ``retained_fraction`` of the budget goes to extra window/state blocks that keep cached boundaries' tails
    (prefix caching; ``retained_tail_blocks``).

    Window and state pools are sized for the worst case, not a fraction of memory, because their need is
    bounded: ``max_num_seqs * tail_blocks_per_seq`` covers every running sequence taking a step of up to
    one block, plus ``ceil(max_num_batched_tokens / bs)`` for the extra blocks of longer (prefill) steps:
    a sequence adding k > bs tokens needs at most ceil(k / bs) - 1 more blocks than one adding bs, and
    the step's k's add up to at most ``max_num_batched_tokens``. ``None`` means unchunked prefill of a
    ``max_model_len`` prompt (safe but large: engines pass their scheduler's token budget).

    Everything left goes to history, whose need grows with every sequence's length; it must hold at
    least one ``max_model_len`` sequence or a ValueError names the shortfall. A pool whose blocks take
    no bytes (e.g. no compressed layers: an empty state pool) costs nothing and gets enough blocks for
    ``max_num_seqs`` sequences of ``max_model_len`` so that it never limits admission.
    """
    step_tokens = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    lows = {"memory_bytes": (memory_bytes, 0), "model_dtype_bytes": (model_dtype_bytes, 1),
            "max_num_seqs": (max_num_seqs, 1), "max_model_len": (max_model_len, 1),
            "spec_slack": (spec_slack, 0), "max_num_batched_tokens": (step_tokens, 0)}
    for name, (v, low) in lows.items():
        if v < low:
            raise ValueError(f"{name}: must be >= {low}, got {v}")
    if not 0.0 <= retained_fraction < 1.0:
        raise ValueError(f"retained_fraction: must be in [0, 1), got {retained_fraction}")
    retained = retained_tail_blocks(layout, int(memory_bytes * retained_fraction), model_dtype_bytes)
    bs = layout.block_size
    full = max_num_seqs * cdiv(max_model_len, bs)  # enough for any mix of running sequences
    counts: dict[str, int] = {}
    spent = 0
    for p in TAIL_POOLS:
        per_block = layout.bytes_per_block(p, model_dtype_bytes)
        need = max_num_seqs * tail_blocks_per_seq(layout, p, spec_slack) + cdiv(step_tokens, bs)
        counts[p] = min(need, full) + retained[p] if per_block else full
        spent += counts[p] * per_block
    per_block = layout.bytes_per_block(HISTORY, model_dtype_bytes)
    min_history = cdiv(max_model_len, bs)
    if per_block == 0:
        counts[HISTORY] = full
    else:
        counts[HISTORY] = max(0, memory_bytes - spent) // per_block
        if counts[HISTORY] < min_history:
            short = spent + min_history * per_block - memory_bytes
            raise ValueError(
                f"memory_bytes: {memory_bytes} B cannot hold the window/state pools ({spent} B for "
                f"{max_num_seqs} sequences) plus one {max_model_len}-token history ({min_history} blocks of "
                f"{per_block} B); {short} B short"
            )
    return {p: counts[p] for p in POOLS}
