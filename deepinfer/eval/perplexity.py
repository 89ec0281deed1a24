"""Held-out perplexity, top-1 next-token accuracy and MTP draft acceptance, by deepinfer and by Hugging Face.

    deepinfer eval [--model DIR] [--max-files N] [--max-tokens N] [--context N] [--chunk N] [--no-hf] [--json PATH]

Data: the held-out files of the Python standard library split (``tools/stdlib_corpus.py``: files whose
``sha1(relative_path)[0] % 10 == 0``, test suites excluded), sorted by path; the first ``--max-files`` of them.
Each file is tokenized as ``[BOS] + tokens + [EOS]`` and cut into consecutive, non-overlapping windows of
``--context`` tokens; every window is an independent sequence starting at position 0 (the way the demo model
was trained). A window of L tokens scores L-1 next-token predictions; ``--max-tokens`` caps the total number
of scored predictions (the last window is shortened to fit).

Metrics, over all scored positions:
  * perplexity ``exp(mean NLL)`` and top-1 accuracy (argmax == the next token);
  * MTP draft acceptance: at target position p the MTP block takes the main model's final pre-``hc_head``
    streams X_p and the embedding of the true token p+1 (zeroed at p == 0) and guesses token p+2; the draft is
    accepted when that greedy guess equals the main model's greedy prediction at p+1 (the token greedy decoding
    would emit). Positions p = 0 .. L-3 of each window count. ``mtp_top1`` is the draft's accuracy against the
    true token p+2.

Both implementations see the same weights: deepinfer loads the checkpoint (dequantizing FP8/FP4) in fp32 and
runs the windows through ``SequenceCache`` in prefill chunks of ``--chunk`` tokens (several windows per step),
with the MTP pass run on each chunk right after the main pass (same positions, same cache). Hugging Face's
``DeepseekV4ForCausalLM`` is built from the config (fp32, eager attention) and given deepinfer's dequantized
weights mapped to HF names; it runs each whole window in one forward without a cache. HF has no MTP, so its
MTP numbers come from :class:`HFMTP`, the MTP block composed from HF modules (a sliding-window
``DeepseekV4DecoderLayer`` + ``DeepseekV4HyperHead`` + ``DeepseekV4RMSNorm``; architecture note §2.7).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from deepinfer.config.model import CSA, DEFAULT_COMPRESS_RATES, HCA, ROUTED_MOE, SWA, ModelConfig, lcm_of_ratios
from deepinfer.model.names import MERGED_EXPERTS, split_merged_experts, to_native

# ---- held-out corpus (the rule of tools/stdlib_corpus.py; tests assert both give the same files) -------------
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _is_heldout(rel: str) -> bool:
    return hashlib.sha1(rel.encode("utf-8")).digest()[0] % 10 == 0


def heldout_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Held-out stdlib files (sorted POSIX paths relative to ``root``, default the running stdlib)."""
    import sysconfig

    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            full = Path(dirpath, name)
            if name.endswith(".py") and full.is_file():
                rel = full.relative_to(base).as_posix()
                if not any(p in _EXCLUDED_DIRS for p in rel.split("/")[:-1]) and _is_heldout(rel):
                    out.append(rel)
    return sorted(out)


def heldout_windows(tokenizer, context: int, max_files: int | None = None, max_tokens: int | None = None,
                    root: str | os.PathLike[str] | None = None) -> list[list[int]]:
    """Token windows of the held-out files: ``[BOS] + file + [EOS]`` cut into ``context``-token pieces; at most
    ``max_tokens`` scored predictions in total (a window of L tokens scores L-1)."""
    return _heldout_windows(tokenizer, context, max_files, max_tokens, root)[0]


def _heldout_windows(tokenizer, context, max_files, max_tokens, root) -> tuple[list[list[int]], int]:
    """(windows, number of files they come from)."""
    if context < 2:
        raise ValueError(f"context: must be >= 2, got {context}")
    import sysconfig

    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = heldout_files(base)[: max_files if max_files is not None else None]
    if not files:
        raise ValueError(f"no held-out files found under {base}")
    windows: list[list[int]] = []
    budget = max_tokens if max_tokens is not None else math.inf
    used = 0
    for rel in files:
        if budget <= 0:
            break
        used += 1
        text = (base / rel).read_bytes().decode("utf-8", errors="replace")
        ids = [tokenizer.bos_id] + tokenizer.encode(text) + [tokenizer.eos_id]
        for start in range(0, len(ids), context):
            w = ids[start : start + context]
            if len(w) < 2 or budget <= 0:
                continue
            w = w[: int(min(len(w), budget + 1))]
            windows.append(w)
            budget -= len(w) - 1
    return windows, used


# ---- scores ---------------------------------------------------------------------------------------------------
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


# ---- deepinfer ------------------------------------------------------------------------------------------------
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


# ---- Hugging Face bridge --------------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig, extra_sliding_layers: int = 0):
    """A ``transformers`` ``DeepseekV4Config`` for ``cfg`` (eager attention). Layer kinds are passed explicitly as
    ``layer_types`` + ``compress_rates`` (HF's own ``compress_ratios`` parser knows only the ratios 0/4/128).
    ``extra_sliding_layers`` appends sliding-window, routed-MoE layers (used to build MTP blocks)."""
    from transformers import DeepseekV4Config

    d = cfg.to_native_dict()
    for key in ("compress_ratios", "num_hash_layers", "compress_rates", "quantization_config", "expert_dtype",
                "torch_dtype", "topk_method", "architectures"):
        d.pop(key, None)
    rates = dict(DEFAULT_COMPRESS_RATES)
    for kind, ratio in zip(cfg.layer_types, cfg.layer_compress_ratios):
        if kind in (CSA, HCA):
            rates[kind] = ratio
    d.update(num_hidden_layers=cfg.num_hidden_layers + extra_sliding_layers,
             layer_types=list(cfg.layer_types) + [SWA] * extra_sliding_layers,
             mlp_layer_types=list(cfg.mlp_layer_types) + [ROUTED_MOE] * extra_sliding_layers,
             compress_rates=rates)
    hc = DeepseekV4Config(**d)
    hc._attn_implementation = "eager"
    return hc


def hf_state_to_native(state: dict[str, torch.Tensor], rename: Callable[[str], str] = to_native) -> dict:
    """HF-named tensors (merged experts) -> native names (per-expert w1/w3/w2)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        native = rename(name)
        if MERGED_EXPERTS.match(native):
            out.update(split_merged_experts(native, t))
        else:
            out[native] = t
    return out


def native_to_hf_state(hf_module: nn.Module, native: dict[str, torch.Tensor],
                       rename: Callable[[str], str] = to_native) -> dict[str, torch.Tensor]:
    """For every tensor of ``hf_module.state_dict()``, the value from ``native`` (experts re-merged)."""
    out: dict[str, torch.Tensor] = {}
    for name, ref in hf_module.state_dict().items():
        nat = rename(name)
        match = MERGED_EXPERTS.match(nat)
        if match is None:
            out[name] = native[nat]
            continue
        prefix, kind = match.groups()
        e_range = range(ref.shape[0])
        if kind == "gate_up_proj":
            out[name] = torch.stack([torch.cat([native[f"{prefix}.ffn.experts.{e}.w1.weight"],
                                                native[f"{prefix}.ffn.experts.{e}.w3.weight"]]) for e in e_range])
        else:
            out[name] = torch.stack([native[f"{prefix}.ffn.experts.{e}.w2.weight"] for e in e_range])
    return out


def mtp_rename(name: str, depth: int = 0) -> str:
    """:class:`HFMTP` parameter name -> native ``mtp.{depth}.*`` name (before any expert split)."""
    if name.startswith("layer."):
        return to_native(f"mtp.{depth}." + name[len("layer."):])
    return f"mtp.{depth}." + to_native(name)


class HFMTP(nn.Module):
    """The MTP block composed from Hugging Face modules (HF 5.23 has no MTP): ``z = h_proj(hnorm(X_p)) +
    e_proj(enorm(embed(t_{p+1})))`` (embedding zeroed at position 0), one sliding-window routed-MoE
    ``DeepseekV4DecoderLayer``, then its own ``hc_head`` and ``norm``; the LM head is the main model's. Parameter
    names map to the native ``mtp.0.*`` names with :func:`mtp_rename`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        self.config = hf_config(cfg, extra_sliding_layers=1)
        self.config._experts_implementation = "eager"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = DeepseekV4DecoderLayer(self.config, cfg.num_hidden_layers)
        self.hc_head = DeepseekV4HyperHead(self.config)
        self.norm = DeepseekV4RMSNorm(h, eps)
        self.enorm = DeepseekV4RMSNorm(h, eps)
        self.hnorm = DeepseekV4RMSNorm(h, eps)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Module,
                rotary_emb: nn.Module) -> torch.Tensor:
        """``streams`` [B, S, N, H]: target final streams at positions 0..S-1; ``next_ids`` [B, S]: token p+1.
        Returns the MTP output streams [B, S, N, H]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        b, s = next_ids.shape
        pos = torch.arange(s, device=next_ids.device)[None].expand(b, -1)
        emb = embed(next_ids).masked_fill((pos == 0)[..., None], 0)
        z = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(emb)).unsqueeze(2)
        rope = {k: rotary_emb(emb, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=emb, attention_mask=None,
                                                 past_key_values=None, position_ids=pos)
        return self.layer(z, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=next_ids,
                          past_key_values=None)

    def logits(self, mtp_streams: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(self.norm(self.hc_head(mtp_streams)))


def load_hf(cfg: ModelConfig, native: dict[str, torch.Tensor], mtp: bool = True):
    """HF ``DeepseekV4ForCausalLM`` (fp32, eval) holding the native-named weights ``native``, plus an
    :class:`HFMTP` holding ``mtp.0.*`` when ``mtp`` and the config has an MTP layer."""
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM(hf_config(cfg.replace(num_nextn_predict_layers=0)))
    hf.load_state_dict(native_to_hf_state(hf, native), strict=True)
    hf = hf.float().eval()
    block = None
    if mtp and cfg.num_nextn_predict_layers > 0:
        block = HFMTP(cfg)
        block.load_state_dict(native_to_hf_state(block, native, mtp_rename), strict=True)
        block = block.float().eval()
    return hf, block


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


# ---- entry point ----------------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    model: str
    files: int
    windows: int
    context: int
    deepinfer: dict[str, Any]
    hf: dict[str, Any] | None = None
    ppl_rel_diff: float | None = None  # |ppl_deepinfer - ppl_hf| / ppl_hf
    notes: list[str] = field(default_factory=list)


def evaluate(model_dir: str | os.PathLike[str] | None = None, max_files: int | None = None,
             max_tokens: int | None = 32768, context: int = 512, chunk: int = 128, batch: int = 8,
             hf: bool = True, tokenizer_dir: str | None = None, device: str = "cpu",
             stdlib_root: str | None = None) -> EvalResult:
    """Evaluate ``model_dir`` (default: the bundled demo model) on the held-out stdlib windows, with deepinfer and,
    when ``hf`` and ``transformers`` is importable, with Hugging Face on the same weights."""
    from deepinfer.assets import demo_model_dir
    from deepinfer.model.loader import load_model
    from deepinfer.tokenizer import Tokenizer

    model_dir = Path(model_dir) if model_dir is not None else demo_model_dir()
    tok = Tokenizer(tokenizer_dir or model_dir)
    windows, n_files = _heldout_windows(tok, context, max_files, max_tokens, stdlib_root)
    model = load_model(model_dir, dtype=torch.float32, device=device, strict_mtp=False, progress=False)
    has_mtp = model.cfg.num_nextn_predict_layers > 0
    ours = run_deepinfer(model, windows, chunk=chunk, batch=batch)
    result = EvalResult(str(model_dir), n_files, len(windows), context, ours.summary())
    if not has_mtp:
        result.notes.append("no MTP layer in this checkpoint: MTP metrics skipped")
    if hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            result.notes.append("transformers is not installed: Hugging Face comparison skipped")
            return result
        cfg = model.cfg
        native = {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                  for k, v in model.state_dict().items()}
        del model
        hf_model, block = load_hf(cfg, native, mtp=has_mtp)
        theirs = run_hf(hf_model, block, windows, batch=batch)
        result.hf = theirs.summary()
        result.ppl_rel_diff = abs(ours.ppl - theirs.ppl) / theirs.ppl
    return result


def format_result(r: EvalResult) -> str:
    def pct(v):
        return "-" if v is None else f"{100 * v:.2f}%"

    rows = [("deepinfer", r.deepinfer)] + ([("transformers", r.hf)] if r.hf else [])
    lines = [f"model: {r.model}",
             f"data: {r.files} held-out stdlib files, {r.windows} windows of <= {r.context} tokens, "
             f"{r.deepinfer['tokens']} scored tokens",
             f"{'':14}{'ppl':>10}{'top1':>10}{'mtp_accept':>12}{'mtp_top1':>10}{'seconds':>9}"]
    for name, s in rows:
        lines.append(f"{name:14}{s['ppl']:10.4f}{pct(s['top1_accuracy']):>10}{pct(s['mtp_acceptance']):>12}"
                     f"{pct(s['mtp_top1']):>10}{s['seconds']:9.1f}")
    if r.ppl_rel_diff is not None:
        lines.append(f"perplexity relative difference deepinfer vs transformers: {r.ppl_rel_diff:.2e}")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def add_eval_parser(sub) -> argparse.ArgumentParser:
    e = sub.add_parser("eval", help="held-out perplexity, top-1 accuracy and MTP acceptance (deepinfer vs HF)")
    e.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    e.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    e.add_argument("--max-files", type=int, default=None, help="use the first N held-out files (default: all)")
    e.add_argument("--max-tokens", type=int, default=32768,
                   help="score at most N next-token predictions (default: 32768; 0 = no limit)")
    e.add_argument("--context", type=int, default=512, help="window length in tokens (default: 512)")
    e.add_argument("--chunk", type=int, default=128, help="deepinfer prefill chunk in tokens (default: 128)")
    e.add_argument("--batch", type=int, default=8, help="windows per forward (default: 8)")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="deepinfer device (default: cpu)")
    e.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers comparison")
    e.add_argument("--json", default=None, help="also write the result as JSON to this path")
    e.set_defaults(func=cmd_eval)
    return e


def cmd_eval(a: argparse.Namespace) -> int:
    torch.manual_seed(0)
    r = evaluate(a.model, max_files=a.max_files, max_tokens=a.max_tokens or None, context=a.context,
                 chunk=a.chunk, batch=a.batch, hf=not a.no_hf, tokenizer_dir=a.tokenizer, device=a.device)
    print(format_result(r))
    if a.json:
        Path(a.json).write_text(json.dumps(asdict(r), indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepinfer.eval.perplexity")
    add_eval_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["eval", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
