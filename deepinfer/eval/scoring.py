"""Scoring token windows: next-token NLL, top-1 accuracy and MTP draft acceptance, by deepinfer and by HF.

Both scorers feed :class:`Scores` the main model's logits and the MTP block's greedy drafts of every window, so
the two implementations are compared on exactly the same arithmetic of the metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.config.model import lcm_of_ratios
from deepinfer.hf_bridge import HFMTP


@dataclass
class Scores:
    tokens: int = 0  # scored next-token predictions
    nll: float = 0.0  # summed negative log-likelihood (nats)
    correct: int = 0  # argmax == next token
    mtp_positions: int = 0
    mtp_accepted: int = 0  # MTP guess of p+2 == main greedy prediction at p+1
    mtp_correct: int = 0  # MTP guess of p+2 == true token p+2
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens if self.tokens else float("nan")

    @property
    def mtp_acceptance(self) -> float | None:
        return self.mtp_accepted / self.mtp_positions if self.mtp_positions else None

    @property
    def mtp_top1(self) -> float | None:
        return self.mtp_correct / self.mtp_positions if self.mtp_positions else None

    def add_window(self, ids: list[int], logits: torch.Tensor, draft: torch.Tensor | None) -> None:
        """``logits`` [L, V] of the main model at positions 0..L-1 of window ``ids``; ``draft`` [>= L-2] the MTP's
        greedy guess of token p+2 at positions p (or None)."""
        n = len(ids)
        target = torch.tensor(ids[1:], dtype=torch.long)
        logp = torch.log_softmax(logits[: n - 1].float(), dim=-1)
        self.nll -= float(logp.gather(1, target[:, None]).sum())
        greedy = logits.argmax(-1)
        self.correct += int((greedy[: n - 1] == target).sum())
        self.tokens += n - 1
        if draft is not None and n >= 3:
            d = draft[: n - 2]
            self.mtp_positions += n - 2
            self.mtp_accepted += int((d == greedy[1 : n - 1]).sum())
            self.mtp_correct += int((d == torch.tensor(ids[2:], dtype=torch.long)).sum())

    def summary(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "nll_per_token": self.nll / self.tokens if self.tokens else None,
                "ppl": self.ppl, "top1_accuracy": self.accuracy, "mtp_positions": self.mtp_positions,
                "mtp_acceptance": self.mtp_acceptance, "mtp_top1": self.mtp_top1, "seconds": round(self.seconds, 2)}


def run_deepinfer(model, windows: list[list[int]], chunk: int = 128, batch: int = 8,
                  mtp: bool = True) -> Scores:
    """Score ``windows`` with a loaded deepinfer ``DeepseekV4``: ``batch`` windows per step, each prefilled in
    chunks of ``chunk`` tokens through a ``SequenceCache``; the MTP block runs on every chunk after the main pass."""
    from deepinfer.kv.spec import build_layout
    from deepinfer.runner.sequences import SequenceCache

    if chunk < 1 or batch < 1:
        raise ValueError(f"chunk and batch must be >= 1, got {chunk}, {batch}")
    t0 = time.perf_counter()
    cfg = model.cfg
    mtp = mtp and cfg.num_nextn_predict_layers > 0
    device = next(model.parameters()).device
    block = math.lcm(128, lcm_of_ratios(cfg))
    longest = max(len(w) for w in windows)
    layout = build_layout(cfg, block, include_mtp=cfg.num_nextn_predict_layers > 0)
    cache = SequenceCache(layout, batch * (-(-longest // block)) + 1, model.dtype, device)
    scores = Scores()
    for g in range(0, len(windows), batch):
        group = windows[g : g + batch]
        sids = [cache.new_sequence() for _ in group]
        logits = [[] for _ in group]
        drafts = [[] for _ in group]
        for c in range(0, max(len(w) for w in group), chunk):
            new = {sid: w[c : c + chunk] for sid, w in zip(sids, group) if c < len(w)}
            ids, fb = cache.plan(new)
            ids = ids.to(device)
            streams = model(ids, fb, cache.storage)
            out = model.logits(streams).float().cpu()
            if mtp:
                nxt = [w[p + 1] if p + 1 < len(w) else w[p] for sid, w in zip(sids, group) if sid in new
                       for p in range(c, min(c + chunk, len(w)))]
                draft = model.mtp_logits(model.mtp_forward(streams, torch.tensor(nxt, device=device), fb,
                                                           cache.storage)).argmax(-1).cpu()
            cache.commit(new)
            for run, sid in zip(fb.runs, new):
                k = sids.index(sid)
                logits[k].append(out[run.start : run.start + run.length])
                if mtp:
                    drafts[k].append(draft[run.start : run.start + run.length])
        for k, w in enumerate(group):
            scores.add_window(w, torch.cat(logits[k]), torch.cat(drafts[k]) if mtp else None)
        for sid in sids:
            cache.free(sid)
    scores.seconds = time.perf_counter() - t0
    return scores


@torch.no_grad()
def run_hf(hf, block: HFMTP | None, windows: list[list[int]], batch: int = 8) -> Scores:
    """Score ``windows`` with HF: windows of equal length are batched; one full forward each, no cache."""
    t0 = time.perf_counter()
    device = next(hf.parameters()).device
    captured: list[torch.Tensor] = []
    handle = hf.model.hc_head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    scores = Scores()
    try:
        by_len: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_len.setdefault(len(w), []).append(i)
        for length, idx in by_len.items():
            for g in range(0, len(idx), batch):
                part = idx[g : g + batch]
                x = torch.tensor([windows[i] for i in part], device=device)
                captured.clear()
                logits = hf(input_ids=x, use_cache=False).logits.float()
                draft = None
                if block is not None and length >= 2:
                    out = block(captured[0][:, :-1], x[:, 1:], hf.model.embed_tokens, hf.model.rotary_emb)
                    draft = block.logits(out, hf.lm_head).argmax(-1).cpu()
                for j, i in enumerate(part):  # sums: the order windows are scored in does not matter
                    scores.add_window(windows[i], logits[j].cpu(), None if draft is None else draft[j])
    finally:
        handle.remove()
    scores.seconds = time.perf_counter() - t0
    return scores
