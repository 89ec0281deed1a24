"""What the engine supports for a DeepSeek-V4.1 checkpoint so far, checked before anything is loaded.

The engine runs V4.1 through its CPU reference step (``model/v41/paged.py``) with continuous batching,
chunked prefill, preemption, prefix caching, async scheduling, the cache tiers, DSpark speculative decoding
(``runner/dspark.py``), the decoder-side bounded replay of long prefills (``v41_decoder_replay``) and the
encoder-side replay of prefix hits (``v41_prefix_replay``, which prefix caching needs with the decoder replay
on), ``hf_overrides`` (``config/v41_overrides.apply_v41_overrides``), dummy weights (``model/v41/dummy.py``) and
``DEEPINFER_BATCH_INVARIANT=1`` (every token alone, ``model/v41/invariant.py``; the two replays that compute
differently by design are refused with it). On CUDA (``model/v41/device.py``: FP4 experts through V4's fused
kernel, dense FP8 as ``FP8Dense32``) the step runs eagerly, with DSpark (every block drafted at once from
device values, ``model/v41/dspark_lists.py``), the batch-invariant mode (every token alone, the batch-invariant
Triton table) and a cache sized from ``gpu_memory_utilization`` (the largest step profiled,
``engine/profile_v41.py``); not with CUDA graphs (``check_v41_cuda``). On several ranks of the CPU
(``model/v41/parallel.py``): data- and tensor-parallel attention, expert- or tensor-parallel experts
(``check_v41_parallel``, ``check_v41_ranks``). Not yet: V4.1's own GPU kernels; context parallelism, several
nodes, expert load balancing and DSpark on several ranks.
Each is refused here with the field and what is allowed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer.config.speculative import SpeculativeConfig
    from deepinfer.config.v41 import V41Config


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """``model_dir``'s config.json, or {} when it is missing or unreadable (the V4 parser then says why)."""
    try:
        d = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


# EngineArgs.v41_decoder_replay: the decoder-side bounded replay of long prefill chunks (model/v41/replay.py).
# "off": every layer on every row; "v41": the released model's narrowing (the decoder layers on the chunk's last
# sliding_window rows, their window bounded there: not bit-identical to "off"); "exact": the same with the
# dependency halo kept, equal to "off" up to rounding.
DECODER_REPLAY_MODES = ("off", "v41", "exact")


def check_decoder_replay(mode: object, field: str = "v41_decoder_replay") -> str:
    """``mode`` if it is one of ``DECODER_REPLAY_MODES``, else a ValueError naming ``field``."""
    if mode not in DECODER_REPLAY_MODES:
        raise ValueError(f"{field}: {mode!r} is not a decoder replay mode; allowed: {', '.join(DECODER_REPLAY_MODES)}")
    return mode


# EngineArgs.v41_prefix_replay: how a prefix-cache hit at a block boundary H is taken (spec §3.2; kv/prefix_hits.py,
# model/v41/paged.py). "exact": the boundary keeps its window and Engram tails, the sequence continues at H and
# computes what a cold run computes (bitwise). "v41": the released model's encoder-side replay: the hit keeps only
# the history pool (compressed entries, index keys, token ids) and recomputes [H - W, H), writing window KV and
# compressor pair inputs only, their window attention reading nothing below H - W; not bit-identical to a cold
# run, by design. Hits no longer than the window are not adopted.
PREFIX_REPLAY_MODES = ("exact", "v41")


def check_prefix_replay(mode: object, field: str = "v41_prefix_replay") -> str:
    """``mode`` if it is one of ``PREFIX_REPLAY_MODES``, else a ValueError naming ``field``."""
    if mode not in PREFIX_REPLAY_MODES:
        raise ValueError(f"{field}: {mode!r} is not a prefix replay mode; allowed: {', '.join(PREFIX_REPLAY_MODES)}")
    return mode


V41_WHAT = "DeepSeek-V4.1 (model_type deepseek_v41)"


def check_v41_parallel(*, tensor_parallel_size: int = 1, data_parallel_size: int = 1, context_parallel_size: int = 1,
                       nnodes: int = 1) -> None:
    """Raises a ValueError naming the first field the engine cannot run V4.1 with on several ranks (also what
    ``deepinfer info`` plans). Runs (``model/v41/parallel.py``): data-parallel attention, tensor-parallel
    attention heads, expert parallelism or tensor-parallel experts. Not yet: context parallelism, several
    nodes."""
    del tensor_parallel_size, data_parallel_size  # any the model's shapes allow (ParallelConfig.validate)
    if context_parallel_size != 1:
        raise ValueError(f"context_parallel_size: {V41_WHAT} runs without context parallelism so far; allowed: 1")
    if nnodes != 1:
        raise ValueError(f"nnodes: {V41_WHAT} runs on the ranks of one node so far; allowed: 1")


def check_v41_ranks(args, device: str) -> None:
    """What V4.1 on several ranks (tensor_parallel_size x data_parallel_size > 1) does not do yet, each refused
    with the field and what is allowed there."""
    where = f"{V41_WHAT} on several ranks"
    if device != "cpu":
        raise ValueError(f"device: {where} runs on the CPU so far (its device experts are not split over ranks); "
                         "allowed with several ranks: cpu")
    if args.speculative_config is not None:
        raise ValueError(f"speculative_config: DSpark speculative decoding of {where} is not written yet; allowed "
                         "with several ranks: None")
    if args.enable_eplb:
        raise ValueError(f"enable_eplb: expert load balancing of {where} is not written yet; allowed: False")


V41_DEVICES = ("cpu", "cuda")


def check_v41_cuda(args) -> None:
    """What V4.1 on CUDA does not do yet (``model/v41/device.py`` runs its step eagerly: no CUDA graphs of it),
    refused with the field and what is allowed there."""
    where = f"{V41_WHAT} on cuda"
    if not args.enforce_eager:
        raise ValueError(f"enforce_eager: {where} runs its step eagerly (no CUDA graphs of it yet); allowed: True")


def check_v41_engine_args(args, device: str) -> None:
    """``args``: the ``EngineArgs``; raises ValueError naming the first unsupported field."""
    from deepinfer import env

    what = V41_WHAT
    if device not in V41_DEVICES:
        raise ValueError(f"device: {what} runs on {' or '.join(V41_DEVICES)} so far; allowed: {', '.join(V41_DEVICES)}")
    if device == "cuda":
        check_v41_cuda(args)
    check_v41_parallel(tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                       context_parallel_size=args.context_parallel_size, nnodes=args.nnodes)
    if args.tensor_parallel_size * args.data_parallel_size > 1:
        check_v41_ranks(args, device)
    prefix_replay = check_prefix_replay(args.v41_prefix_replay)
    if check_decoder_replay(args.v41_decoder_replay) != "off" and args.enable_prefix_caching \
            and prefix_replay == "exact":
        # A narrowed chunk leaves the decoder layers' window rows before its kept tail unwritten, and an exact
        # prefix hit at a block boundary there would read them. The encoder-side replay reads no cached window
        # row (it recomputes the window behind the boundary), so the two go together; "exact" is kept to mean
        # exact, hence refused rather than switched silently.
        raise ValueError(f"v41_decoder_replay: {args.v41_decoder_replay!r} leaves window rows that exact prefix-cache "
                         "hits would read unwritten; set v41_prefix_replay='v41' (hits recompute the window behind "
                         "the boundary, spec §3.2), or enable_prefix_caching=False, or v41_decoder_replay='off'")
    if env.batch_invariant():
        # The mode runs every token alone (model/v41/invariant.py); these two compute differently by design.
        if args.v41_decoder_replay != "off":
            raise ValueError(f"v41_decoder_replay: {args.v41_decoder_replay!r} runs a long chunk's decoder layers on "
                             "its tail only, so a token's bits follow how its prompt was cut; allowed with "
                             "DEEPINFER_BATCH_INVARIANT=1: off")
        if args.v41_prefix_replay != "exact" and args.enable_prefix_caching:
            raise ValueError(f"v41_prefix_replay: {args.v41_prefix_replay!r} recomputes the window behind a prefix "
                             "hit, so a token's bits follow whether its prefix was cached; allowed with "
                             "DEEPINFER_BATCH_INVARIANT=1: exact (or enable_prefix_caching=False)")
        if args.enable_expert_parallel and args.tensor_parallel_size * args.data_parallel_size > 1:
            # The mode runs a step's tokens one forward each, so ranks with different token counts would make
            # different numbers of expert exchanges.
            raise ValueError("enable_expert_parallel: DEEPINFER_BATCH_INVARIANT=1 runs every token alone, a forward "
                             f"(an expert exchange per layer) each, which the ranks of {V41_WHAT} cannot pair up yet; "
                             "allowed with it: False (data parallelism alone)")


def check_v41_speculative(spec: "SpeculativeConfig", cfg: "V41Config") -> None:
    """V4.1 speculates with its DSpark drafter only, verifying at most one block per step."""
    if spec.method != "dspark":
        raise ValueError(f"speculative_config.method: {spec.method!r} is DeepSeek-V4's MTP layer; allowed for this "
                         "DeepSeek-V4.1 checkpoint: dspark")
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("speculative_config.method: 'dspark' needs a checkpoint with the DSpark drafter "
                         "(num_nextn_predict_layers >= 1); this model has none")
    block = cfg.dspark.block_size
    if spec.num_speculative_tokens > block:
        raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer in [1, {block}] (the "
                         f"checkpoint's dspark_block_size), got {spec.num_speculative_tokens}")
