"""Log-probabilities returned to the user (sampled token, its rank, and the top-N alternatives).

Which distribution: the log-softmax of the *raw* model logits, before penalties, min_tokens masks,
temperature and top-k/top-p/min-p -- vLLM's default ``logprobs_mode="raw_logprobs"``. It describes what the
model predicted, is the same for every sampling setting (so responses are comparable across requests), and
needs no second softmax over the processed logits. Consequence: a sampled token may have a rank > top_k, and
a token masked by ``min_tokens`` still shows its model logprob.

Ties in the top-N are broken by the lowest token id (via an exact composite integer key, not
``torch.topk``'s unspecified tie order). Rank is 1 + the number of tokens with a strictly greater logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprob information for one position: the chosen / target token and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token id, logprob), logprob descending, ties by id ascending


def _sortable_key(values: torch.Tensor) -> torch.Tensor:
    # Map float32 to an int64 that orders like the float (IEEE bits: flip the magnitude of negatives).
    # NaN is not expected here (log_softmax of finite logits).
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def topn_stable(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``n`` of each row of a float32 [B, V] tensor, value descending, ties by lowest index.

    Every key ``value_key * 2**32 + (V - 1 - id)`` is unique, so ``torch.topk`` has no tie to break and
    the result is the same on every backend and batch size. Returns (values [B, n], ids [B, n] int64).
    """
    if values.dtype != torch.float32 or values.dim() != 2:
        raise ValueError(f"topn_stable expects a float32 [B, V] tensor, got {values.dtype} {tuple(values.shape)}")
    vocab = values.shape[1]
    n = min(n, vocab)
    ids = torch.arange(vocab, dtype=torch.int64, device=values.device)
    key = _sortable_key(values) * (1 << 32) + (vocab - 1 - ids)
    top_keys = torch.topk(key, n, dim=-1, largest=True, sorted=True).values
    top_ids = (vocab - 1) - (top_keys & 0xFFFFFFFF)
    return torch.gather(values, 1, top_ids), top_ids


@dataclass(frozen=True, slots=True, eq=False)
class LogprobTensors:
    """Logprob results still on the device (computing them needs no host sync; reading them does)."""

    token_ids: torch.Tensor  # [B] int64
    chosen: torch.Tensor  # [B] float32
    ranks: torch.Tensor  # [B] int64
    top_vals: torch.Tensor  # [B, max n] float32
    top_ids: torch.Tensor  # [B, max n] int64

    @classmethod
    def compute(cls, logits: torch.Tensor, token_ids: torch.Tensor, max_n: int) -> "LogprobTensors":
        """Logprob and rank of ``token_ids[b]`` under ``log_softmax(logits[b])`` and the top ``max_n``."""
        lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
        token_ids = token_ids.to(torch.int64)
        chosen = torch.gather(lp, 1, token_ids[:, None])
        ranks = (lp > chosen).sum(dim=-1) + 1
        top_vals, top_ids = topn_stable(lp, max_n) if max_n > 0 else (lp[:, :0], token_ids[:, None][:, :0])
        return cls(token_ids, chosen[:, 0], ranks, top_vals, top_ids)

    def resolve(self, num_logprobs: Sequence[int]) -> tuple[TokenLogprobs, ...]:
        """Plain Python objects (one device->host copy per tensor); row b keeps its top ``num_logprobs[b]``."""
        chosen_l, ranks_l, ids_l = self.chosen.tolist(), self.ranks.tolist(), self.token_ids.tolist()
        top_vals_l, top_ids_l = self.top_vals.tolist(), self.top_ids.tolist()
        out = []
        for b, n in enumerate(num_logprobs):
            top = tuple(zip(top_ids_l[b][:n], top_vals_l[b][:n]))
            out.append(TokenLogprobs(token_id=int(ids_l[b]), logprob=chosen_l[b], rank=int(ranks_l[b]), top=top))
        return tuple(out)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int]
) -> tuple[TokenLogprobs, ...]:
    """Logprob, rank and top-``num_logprobs[b]`` of ``token_ids[b]`` under ``log_softmax(logits[b])``.

    ``logits`` is [B, V] (raw model logits, any float dtype; computed in float32), ``token_ids`` is [B].
    """
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],) or len(num_logprobs) != logits.shape[0]:
        raise ValueError(
            f"need logits [B, V], token_ids [B], num_logprobs of length B; got {tuple(logits.shape)}, "
            f"{tuple(token_ids.shape)}, {len(num_logprobs)}"
        )
    if logits.shape[0] == 0:
        return ()
    return LogprobTensors.compute(logits, token_ids, max(num_logprobs)).resolve(num_logprobs)


def prompt_logprobs(
    logits: torch.Tensor, target_token_ids: Sequence[int] | torch.Tensor, num_logprobs: int
) -> tuple[TokenLogprobs, ...]:
    """Prompt logprobs for a span of prompt positions.

    ``logits[i]`` is the model output at prompt position ``p + i``; it scores ``target_token_ids[i]``, the
    prompt token at position ``p + i + 1``. The caller aligns the span (the first prompt token has no
    logprob; report ``None`` for it) and may call this once per prefill chunk -- each position is
    independent, so chunking does not change the result.
    """
    if isinstance(num_logprobs, bool) or not 0 <= num_logprobs:
        raise ValueError(f"num_logprobs must be an integer >= 0, got {num_logprobs!r}")
    targets = torch.as_tensor(target_token_ids, dtype=torch.int64, device=logits.device)
    return token_logprobs(logits, targets, [num_logprobs] * logits.shape[0])
