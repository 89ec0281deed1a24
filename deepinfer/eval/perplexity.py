"""Held-out perplexity, top-1 next-token accuracy and MTP draft acceptance, by deepinfer and by Hugging Face.

    deepinfer eval [--model DIR] [--max-files N] [--max-tokens N] [--context N] [--chunk N] [--no-hf] [--json PATH]
                   [--spec-ks K ...] [--spec-prompts N] [--spec-prompt-len N] [--spec-max-tokens N]

Data (:mod:`deepinfer.eval.windows`): the held-out files of the Python standard library split
(:mod:`deepinfer.corpus`: files whose ``sha1(relative_path)[0] % 10 == 0``, test suites excluded), sorted by
path; the first ``--max-files`` of them.
Each file is tokenized as ``[BOS] + tokens + [EOS]`` and cut into consecutive, non-overlapping windows of
``--context`` tokens; every window is an independent sequence starting at position 0 (the way the demo model
was trained). A window of L tokens scores L-1 next-token predictions; ``--max-tokens`` caps the total number
of scored predictions (the last window is shortened to fit).

Metrics (:mod:`deepinfer.eval.scoring`), over all scored positions:
  * perplexity ``exp(mean NLL)`` and top-1 accuracy (argmax == the next token);
  * MTP draft acceptance (teacher-forced, one draft): at target position p the MTP block takes the main model's final pre-``hc_head``
    streams X_p and the embedding of the true token p+1 (zeroed at p == 0) and guesses token p+2; the draft is
    accepted when that greedy guess equals the main model's greedy prediction at p+1 (the token greedy decoding
    would emit). Positions p = 0 .. L-3 of each window count. ``mtp_top1`` is the draft's accuracy against the
    true token p+2;
  * mean acceptance length for k = 1, 2, 3 chained drafts (``--spec-ks``), measured by the engine itself:
    greedy generation from held-out prompts with speculative decoding on (:mod:`deepinfer.eval.acceptance`).

Both implementations see the same weights: deepinfer loads the checkpoint (dequantizing FP8/FP4) in fp32 and
runs the windows through ``SequenceCache`` in prefill chunks of ``--chunk`` tokens (several windows per step),
with the MTP pass run on each chunk right after the main pass (same positions, same cache). Hugging Face's
``DeepseekV4ForCausalLM`` is built from the config (fp32, eager attention) and given deepinfer's dequantized
weights mapped to HF names (:mod:`deepinfer.hf_bridge`); it runs each whole window in one forward without a
cache. HF has no MTP, so its MTP numbers come from :class:`~deepinfer.hf_bridge.HFMTP`, the MTP block composed
from HF modules (a sliding-window ``DeepseekV4DecoderLayer`` + ``DeepseekV4HyperHead`` + ``DeepseekV4RMSNorm``;
architecture note §2.7).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepinfer.eval.acceptance import acceptance_lengths
from deepinfer.eval.scoring import run_deepinfer, run_hf
from deepinfer.eval.windows import heldout_sample
from deepinfer.hf_bridge import load_hf


@dataclass
class EvalResult:
    model: str
    files: int
    windows: int
    context: int
    deepinfer: dict[str, Any]
    hf: dict[str, Any] | None = None
    # {k: tokens per verify step} of the engine's greedy generation with k MTP drafts (``acceptance.py``)
    acceptance_length: dict[int, float] | None = None
    acceptance_setup: str = ""
    ppl_rel_diff: float | None = None  # |ppl_deepinfer - ppl_hf| / ppl_hf
    notes: list[str] = field(default_factory=list)


def evaluate(model_dir: str | os.PathLike[str] | None = None, max_files: int | None = None,
             max_tokens: int | None = 32768, context: int = 512, chunk: int = 128, batch: int = 8,
             hf: bool = True, tokenizer_dir: str | None = None, device: str = "cpu",
             stdlib_root: str | None = None, spec_ks: tuple[int, ...] = (1, 2, 3), spec_prompts: int = 8,
             spec_prompt_len: int = 32, spec_max_tokens: int = 48) -> EvalResult:
    """Evaluate ``model_dir`` (default: the bundled demo model) on the held-out stdlib windows, with deepinfer and,
    when ``hf`` and ``transformers`` is importable, with Hugging Face on the same weights. With an MTP layer and
    ``spec_ks``, also the engine's mean acceptance length for each k: greedy generation of ``spec_max_tokens``
    tokens from the first ``spec_prompt_len`` tokens of ``spec_prompts`` windows."""
    from deepinfer.assets import demo_model_dir
    from deepinfer.model.loader import load_model
    from deepinfer.tokenizer import Tokenizer

    model_dir = Path(model_dir) if model_dir is not None else demo_model_dir()
    tok = Tokenizer(tokenizer_dir or model_dir)
    windows, n_files = heldout_sample(tok, context, max_files, max_tokens, stdlib_root)
    model = load_model(model_dir, dtype=torch.float32, device=device, strict_mtp=False, progress=False)
    has_mtp = model.cfg.num_nextn_predict_layers > 0
    ours = run_deepinfer(model, windows, chunk=chunk, batch=batch)
    result = EvalResult(str(model_dir), n_files, len(windows), context, ours.summary())
    cfg = model.cfg
    native = None
    if hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            result.notes.append("transformers is not installed: Hugging Face comparison skipped")
        else:
            native = {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                      for k, v in model.state_dict().items()}
    del model  # the HF model and the acceptance engines load their own copies
    if native is not None:
        hf_model, block = load_hf(cfg, native, mtp=has_mtp)
        del native
        theirs = run_hf(hf_model, block, windows, batch=batch)
        del hf_model, block
        result.hf = theirs.summary()
        result.ppl_rel_diff = abs(ours.ppl - theirs.ppl) / theirs.ppl
    if not has_mtp:
        result.notes.append("no MTP layer in this checkpoint: MTP metrics skipped")
    elif spec_ks:
        prompts = [w[:spec_prompt_len] for w in windows if len(w) >= 2][:spec_prompts]
        result.acceptance_length = acceptance_lengths(model_dir, prompts, spec_ks, spec_max_tokens, device,
                                                      tokenizer_dir)
        result.acceptance_setup = (f"the engine's greedy generation, {len(prompts)} held-out prompts of <= "
                                   f"{spec_prompt_len} tokens x {spec_max_tokens} tokens")
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
    if r.acceptance_length:
        got = "  ".join(f"k={k}: {v:.2f}" for k, v in sorted(r.acceptance_length.items()))
        lines.append(f"mean acceptance length (tokens per verify step, {r.acceptance_setup}): {got}")
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
    e.add_argument("--spec-ks", type=int, nargs="*", default=[1, 2, 3],
                   help="MTP draft counts k whose mean acceptance length the engine measures (greedy generation "
                        "from held-out prompts; default: 1 2 3; none: skip)")
    e.add_argument("--spec-prompts", type=int, default=8, help="held-out prompts for the acceptance run (default: 8)")
    e.add_argument("--spec-prompt-len", type=int, default=32, help="tokens per such prompt (default: 32)")
    e.add_argument("--spec-max-tokens", type=int, default=48, help="tokens generated per prompt (default: 48)")
    e.add_argument("--json", default=None, help="also write the result as JSON to this path")
    e.set_defaults(func=cmd_eval)
    return e


def cmd_eval(a: argparse.Namespace) -> int:
    torch.manual_seed(0)
    r = evaluate(a.model, max_files=a.max_files, max_tokens=a.max_tokens or None, context=a.context,
                 chunk=a.chunk, batch=a.batch, hf=not a.no_hf, tokenizer_dir=a.tokenizer, device=a.device,
                 spec_ks=tuple(a.spec_ks), spec_prompts=a.spec_prompts, spec_prompt_len=a.spec_prompt_len,
                 spec_max_tokens=a.spec_max_tokens)
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
