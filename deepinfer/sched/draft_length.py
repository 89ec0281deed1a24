"""Per-request draft length for speculative decoding (``DEEPINFER_ENABLE_MTP_VARLEN=1``).

Draft j of a step is worth verifying only if drafts 1..j are all accepted; with a per-draft acceptance
rate r that happens with probability about r**j, while every verified position costs a row of the
target's forward (and of the MTP chain). A request proposes the drafts whose chance of being reached is at
least ``MIN_REACH``; its rate is a moving average of its own recent steps. A request that stopped drafting
(rate too low) drifts back up by ``RECOVERY`` per step, so it probes again later instead of staying at 0.
"""

from __future__ import annotations

MIN_REACH = 0.3  # propose draft j when rate**j >= this
DECAY = 0.5  # weight of the newest step in the moving average
RECOVERY = 0.05  # rate gained by a step without drafts


def draft_length(rate: float, k: int) -> int:
    """Drafts to propose (0..k) for a request whose drafts are accepted at ``rate``."""
    n = 0
    while n < k and rate ** (n + 1) >= MIN_REACH:
        n += 1
    return n


def update_rate(rate: float, drafted: int, accepted: int) -> float:
    """The moving acceptance rate after a step that verified ``drafted`` drafts and accepted ``accepted``."""
    if drafted == 0:
        return min(1.0, rate + RECOVERY)
    return (1 - DECAY) * rate + DECAY * accepted / drafted
