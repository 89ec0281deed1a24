"""MTP speculative decoding's mean acceptance length as the engine measures it: greedy generation with k chained
drafts per verify step, from held-out prompts, read off the engine's counters (``engine/spec_stats.py``: tokens
per verify step = 1 + accepted drafts / verify steps). The teacher-forced one-draft rate of ``scoring.py``
cannot give k > 1: a chained draft reads the MTP block's own previous output and draft token."""

from __future__ import annotations

import os
from collections.abc import Sequence


def acceptance_lengths(model_dir: str | os.PathLike[str], prompts: Sequence[Sequence[int]], ks: Sequence[int],
                       max_tokens: int, device: str = "cpu", tokenizer_dir: str | None = None,
                       draft_head: str = "auto") -> dict[int, float]:
    """{k: mean acceptance length} of greedy generation of ``max_tokens`` tokens (EOS ignored) from each prompt
    (token ids), one engine per k with ``speculative_config={"method": "mtp", "num_speculative_tokens": k,
    "draft_head": draft_head}`` (the engine's default head for the device unless asked)."""
    from deepinfer import LLM, SamplingParams

    if not prompts or max_tokens < 2:
        raise ValueError(f"acceptance_lengths: needs prompts and max_tokens >= 2, got {len(prompts)}, {max_tokens}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[int, float] = {}
    for k in ks:
        llm = LLM(str(model_dir), tokenizer=tokenizer_dir, device=device, load_progress=False,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k, "draft_head": draft_head})
        try:
            llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            length = llm.engine.spec_stats.mean_acceptance_length
        finally:
            llm.close()
        if length is None:
            raise RuntimeError(f"k={k}: the engine ran no verify step")
        out[k] = length
    return out
