"""DSpark speculative decoding on the plain-PyTorch V4.1 model: the verification rule, the verify length, and
a reference greedy loop that the engine's DSpark path is to be checked against.

Verification is the engine's *coupled* rule (``runner/speculative.py``, determinism.md §2.8), unchanged:
the target draws its own token at every verified row exactly as plain decoding would (argmax for greedy
rows, the (seed, position) draw for seeded rows) and a draft is accepted iff it equals that draw. The
emitted tokens are the accepted drafts plus the target's token after them, i.e. the tokens plain decoding
produces; drafts only decide how many positions a step covers. (The spec's ``min(1, p_t / p_d)`` rejection
sampling would also be lossless in distribution, but not token-identical to plain seeded sampling.)

Verify length (spec §5.4): a block always drafts ``dspark_block_size`` tokens (its rows attend to each
other); how many of them a step verifies is ``num_tokens`` when fixed (``DEEPINFER_ENABLE_MTP_VARLEN=0``,
the default: which positions a step covers never depends on past acceptance), else confidence-aware: draft
k is verified while the chance of reaching it, the product of the confidence head's acceptance
probabilities of drafts 1..k (the paper's survival ``a_k``), is at least ``MIN_REACH`` -- the threshold
``sched/draft_length.py`` applies to V4's MTP, where the chance is estimated from the request's own
acceptance rate instead. Not yet: the paper's calibration of the confidences and its batch-level,
hardware-aware choice of the total.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.model.v41.model import DeepseekV41
from deepinfer.runner.speculative import verify
from deepinfer.sched.draft_length import MIN_REACH
from deepinfer.sched.plan import SeqWork


@dataclass(frozen=True, slots=True)
class Acceptance:
    accepted: int  # drafts accepted (0 .. len(drafts))
    tokens: tuple[int, ...]  # emitted: the accepted drafts, then the target's token after them


def accept(drafts: Sequence[int], draws: torch.Tensor) -> Acceptance:
    """``drafts`` d_1..d_l (the verify step's inputs after the last emitted token), ``draws`` [l + 1] the
    target's token at each verified row -> the longest prefix of drafts equal to the draws, plus the draw
    after it. The runner's batched ``verify`` decides, so the engine and this reference cannot drift."""
    n = len(drafts)
    if draws.dim() != 1 or draws.numel() != n + 1:
        raise ValueError(f"draws: expected one token per verified row ({n + 1}), got shape {tuple(draws.shape)}")
    # token_ids: the row before the drafts (any id: verify only reads the drafts), then the drafts.
    work = SeqWork("", 0, (0, *map(int, drafts)), num_samples=n + 1, num_drafts=n)
    accepted = int(verify(draws.long(), [work], draws.device).accepted[0])
    return Acceptance(accepted, tuple(int(t) for t in draws[:accepted + 1]))


def verify_length(confidence: torch.Tensor, num_tokens: int, varlen: bool, min_reach: float = MIN_REACH) -> int:
    """How many of a block's drafts to verify: ``num_tokens`` (1 .. block size), or with ``varlen`` the drafts
    whose survival ``prod(confidence[:k])`` is at least ``min_reach`` (0 .. num_tokens; a prefix, since the
    product never grows)."""
    block = confidence.numel()
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= block:
        raise ValueError(f"num_speculative_tokens: must be an integer in [1, {block}] (the DSpark block size), "
                         f"got {num_tokens!r}")
    if not varlen:
        return num_tokens
    survival = torch.cumprod(confidence[:num_tokens].double(), dim=0)
    return int((survival >= min_reach).sum())


def verify_lengths(confidence: torch.Tensor, num_tokens: torch.Tensor, varlen: bool,
                   min_reach: float = MIN_REACH) -> torch.Tensor:
    """``verify_length`` of many blocks on the device: confidence [m, B], num_tokens [m] int64 (1 .. B) ->
    [m] int64, the same count per block (the survival of its first k drafts, in the same float64 order)."""
    if not varlen:
        return num_tokens
    survival = torch.cumprod(confidence.double(), dim=1)
    cols = torch.arange(confidence.shape[1], device=confidence.device)
    return ((survival >= min_reach) & (cols < num_tokens.unsqueeze(1))).sum(dim=1)


@dataclass(frozen=True, slots=True)
class SpeculativeRun:
    tokens: list[int]
    verified: list[int]  # drafts verified per step
    accepted: list[int]  # drafts accepted per step
    drafts: list[tuple[int, ...]]  # the drafts verified per step


@torch.no_grad()
def speculative_greedy(model: DeepseekV41, prompt: torch.Tensor, max_new_tokens: int, num_tokens: int,
                       varlen: bool = False) -> SpeculativeRun:
    """Greedy decoding with DSpark drafts: prefill, then steps that verify ``[last token, drafts]`` in one
    target forward, keep the accepted prefix plus the target's token and roll the cache back to it. The
    tokens are ``model.greedy``'s (the drafts never decide a token)."""
    if model.mtp is None:
        raise ValueError("model: built without the DSpark drafter (dspark=True)")
    cache = model.new_cache()
    out = [int(model(prompt, cache)[-1].argmax())]
    verified: list[int] = []
    accepted: list[int] = []
    proposed: list[tuple[int, ...]] = []
    while len(out) < max_new_tokens:
        block = model.propose(out[-1], cache)
        n = min(verify_length(block.confidence, num_tokens, varlen), max_new_tokens - len(out))
        drafts = block.tokens[:n].tolist()
        start = cache.length
        logits = model(torch.tensor([out[-1], *drafts], device=prompt.device), cache)
        result = accept(drafts, logits.argmax(dim=-1))
        cache.truncate(start + result.accepted + 1, model.cfg.compress_ratios)
        out.extend(result.tokens)
        verified.append(n)
        accepted.append(result.accepted)
        proposed.append(tuple(drafts))
    return SpeculativeRun(out[:max_new_tokens], verified, accepted, proposed)
