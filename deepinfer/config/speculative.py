"""Speculative decoding settings: ``speculative_config={"method": "mtp" | "dspark", "num_speculative_tokens": k}``.

The shape is vLLM's (a dict, or its JSON text from ``--speculative-config``). Two methods, one per model
family (``config/engine.py`` checks which the checkpoint has):

  * ``mtp`` (DeepSeek-V4): the checkpoint's multi-token-prediction layer (``mtp.0``), chained ``k`` times
    per step (k <= 4);
  * ``dspark`` (DeepSeek-V4.1): the DSpark block drafter (``mtp.0..2``, ``model/v41/dspark.py``), which
    drafts a whole block in one pass; ``k`` (<= 5, and at most the checkpoint's ``dspark_block_size``) of
    its drafts are verified.

Whether the verify length may vary per request (``DEEPINFER_ENABLE_MTP_VARLEN``) is read from the
environment once, here. The two methods decide it differently: MTP from the request's recent acceptance
rate when the step is planned (``sched/draft_length.py``), DSpark from the drafter's own confidence head
when the block is drafted (``model/v41/speculative.verify_length``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.config.json_object import json_object

MTP, DSPARK = "mtp", "dspark"
METHODS = (MTP, DSPARK)
MAX_SPECULATIVE_TOKENS = {MTP: 4, DSPARK: 5}  # DSpark: the released drafter's block
_FIELDS = ("method", "num_speculative_tokens", "draft_head")
# The head the MTP chain's drafts are picked from (``model/draft_head.py``): "model" (the model's own LM head),
# "fp8" (an FP8 copy of it, made at load: half the bytes each chained pass reads; drafts only decide how many
# positions a step covers, never which tokens are emitted) or "auto" (fp8 on CUDA, where the head's bytes are a
# chain pass's largest read; the model's head on the CPU, where an FP8 GEMM is slower).
DRAFT_HEADS = ("auto", "model", "fp8")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts verified per step (the MTP layer chained k times; k of a DSpark block)
    # Per-request draft length 0..k from its recent acceptance (DEEPINFER_ENABLE_MTP_VARLEN=1); off: always
    # k, so which positions a step covers never depends on the past acceptance of other steps.
    varlen: bool = False
    draft_head: str = "auto"  # one of DRAFT_HEADS (MTP only)

    @classmethod
    def parse(cls, value: Any, varlen: bool = False) -> "SpeculativeConfig | None":
        """A dict, its JSON text, an instance, or None (no speculation). Errors name the field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", _FIELDS, '{"method": "mtp", "num_speculative_tokens": 2}')
        method = value.get("method", "mtp")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: {method!r} is not supported; allowed: {', '.join(METHODS)}")
        k = value.get("num_speculative_tokens")
        most = MAX_SPECULATIVE_TOKENS[method]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer in "
                             f"[1, {most}] for method {method!r}, got {k!r}")
        head = value.get("draft_head", "auto")
        if head not in DRAFT_HEADS:
            raise ValueError(f"speculative_config.draft_head: {head!r} is not supported; allowed: "
                             f"{', '.join(DRAFT_HEADS)}")
        if head != "auto" and method != MTP:
            raise ValueError(f"speculative_config.draft_head: only for method 'mtp' (DSpark drafts with its own "
                             f"head), got {head!r} with method {method!r}")
        return cls(method, k, bool(varlen), head)

    def fp8_draft_head(self, device: str) -> bool:
        """Whether the MTP chain picks its drafts from an FP8 copy of the LM head on ``device``."""
        return self.method == MTP and (self.draft_head == "fp8" or (self.draft_head == "auto" and device == "cuda"))

    @property
    def length_by_rate(self) -> bool:
        """The scheduler picks each request's draft count from its acceptance rate (MTP with varlen). DSpark
        always asks for k drafts: its confidence head shortens the block when it is drafted."""
        return self.varlen and self.method == MTP

    @property
    def writes_past_step(self) -> bool:
        """The drafter writes cache rows past the step's last position (the MTP chain: one per further draft),
        which the scheduler must allocate. DSpark's block rows are never cached: its context rows are the
        target's own positions."""
        return self.method == MTP
