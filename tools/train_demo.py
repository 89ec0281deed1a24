#!/usr/bin/env python
"""Train the bundled demo model: a tiny DeepSeek-V4 (with its MTP layer) on the Python standard library.

One file on purpose (~820 lines): it is the whole recipe of the bundled model, data to exported weights,
and a reader should be able to follow it top to bottom.

Five steps, run from the repository root (the recorded run's exact commands are at the end)::

    python tools/train_demo.py prepare                        # CPU: tokenize -> .whl/train_demo/data.pt
    python tools/train_demo.py train --out RUN                # GPU: main model, then the MTP layer
    python tools/train_demo.py heal --run RUN --out HEALED    # CPU: line-end token-boundary fine-tune
    python tools/train_demo.py export --run HEALED            # CPU: -> deepinfer/assets/demo (FP8/FP4 native)
    python tools/train_demo.py plot --run RUN --heal HEALED   # -> deepinfer/assets/demo/loss.png

Model (:data:`DEMO_CONFIG`, 10.4M parameters incl. MTP; 11.39 MB exported): vocab 4096 (the bundled byte-level
BPE), hidden 256, 6 layers ``compress_ratios [0, 4, 16, 4, 16, 0] + [0]`` with ``compress_rates`` CSA 4 / HCA 16
(SWA, CSA + lightning indexer, HCA, CSA, HCA, SWA; HCA rate 16 instead of V4's 128 so that HCA windows close
often at a 512-token context), sliding window 128, 4 heads x head_dim 64 (rope 16), q_lora 128, o_groups 2,
o_lora 128, 8 routed experts top-2 + 1 shared, moe_intermediate 128 (256 would make the export 14.9 MB > 12 MB),
layer 0 hash-MoE, the others routed (sqrtsoftplus, noaux_tc, scaling 1.5), mHC (hc_mult 4, 20 Sinkhorn
iterations), index heads 8 x 32 (4 heads gave exact-zero indexer scores, i.e. top-k ties), index_topk 16, one
MTP layer (sliding window, routed MoE). RoPE as V4: theta 1e4 on SWA layers, 1.6e5 + YaRN (factor 16) on CSA/HCA.

Data (``prepare``): the CPython 3.11.7 standard library as split by ``deepinfer/corpus.py``. The 67 held-out
files (``sha1(path)[0] % 10 == 0``) are never read here. Of the 667 training files, the 33 with
``sha1(path)[0] % 20 == 1`` are a validation split (175,394 tokens) used to monitor training and to pick the
kept checkpoint; the other 634 files (2,802,456 tokens) are the training stream. Each file is
``[BOS] + tokens + [EOS]``, files concatenated in path order. The stream is tokenized once on CPU so the GPU
machine (another Python, another stdlib) trains on exactly these tokens.

Trainer (``train``): Hugging Face ``DeepseekV4ForCausalLM`` (transformers 5.23, eager attention) in training
mode; fp32 master weights, bf16 autocast on CUDA; AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on
matrices only); linear warmup (100 steps) then cosine decay to 10% of the peak (2e-3); gradient clipping 1.0;
batches of 64 random 512-token windows of the training stream (seeded). Departures from a plain
``model(input_ids, labels=...)``, all training-only:

* HF initializes ``tid2eid`` to zeros (every token -> expert 0). It is set to a random hash table (each token ->
  ``num_experts_per_tok`` distinct experts, seed ``SEEDS["tid2eid"]``) before training and never trained.
* Routed experts run through a registered ``"dense"`` experts implementation: every expert on every token, the
  outputs combined with the router weights scattered into a [T, E] matrix (zero for unselected experts). Same
  function and gradients as HF's routed loop, without its per-expert host syncs.
* Load balancing is V4's auxiliary-loss-free scheme: after every step each routed layer's
  ``e_score_correction_bias`` moves by ``--bias-rate`` (0.01) towards balance (+ for under-, - for over-loaded
  experts), so the exported ``gate.bias`` is a trained value.
* HF's lightning indexer gets no gradient from the LM loss (top-k). As in DeepSeek-V3.2 it is trained with a KL
  loss towards the main attention: per CSA layer the target is the main queries' softmax over the causally
  visible compressed entries (mean over heads, no gradient), the prediction the softmax of the indexer scores;
  the indexer's inputs are detached, so this loss trains only the indexer.

The MTP layer is then trained on the frozen main model (embedding and LM head shared and frozen), built from HF
modules (:class:`deepinfer.hf_bridge.HFMTP`): a sliding-window ``DeepseekV4DecoderLayer`` + its own
``DeepseekV4HyperHead`` + ``DeepseekV4RMSNorm``, with ``e_proj``/``h_proj``/``enorm``/``hnorm``. At target
position p it takes the main model's final pre-``hc_head`` streams X_p and the embedding of token p+1 (zeroed at
p == 0) and is trained with cross entropy on token p+2 (peak lr 1e-3, 30 warmup steps, same batches shape). It
is warm-started from the trained main model's last layer (same kind: sliding, routed), ``hc_head`` and final
norm; ``e_proj``/``h_proj`` start at the identity.

Step counts: ``--steps 0`` (default) calibrates the total to a wall-clock ``--budget`` from the mean time of
steps 6-25 (inside the warmup, which does not depend on the total), capped by ``--max-steps``; passing the
recorded ``--steps`` / ``--mtp-steps`` reproduces a run without calibration. The kept checkpoint of each phase is
the one with the best validation loss (every 100 steps and at the end). GPU training is not bitwise
deterministic (atomics in the backward pass), so a rerun gives close but not identical weights.

Heal (``heal``, CPU): the tokenizer merges line-ending punctuation with the following newline + indentation
(``"):\n    "`` is one token), so training text never shows ``"):"`` followed by a separate ``"\n    "`` token —
which is exactly how a prompt such as ``"def fibonacci(n):"`` ends. The kept main model is fine-tuned for 300
steps (batch 8 x 256 tokens, lr 2e-4 cosine, AdamW as above, indexer and router biases unchanged) on training
windows in which each of the 158 such tokens is split into its two halves with probability 0.25 (seeded); the
MTP layer is left as trained. Validation loss: 3.2892 -> 3.2835 on plain text, 3.737 -> 3.202 with every such
token split. Wall time 662 s on 2 CPU cores (torch 2.13).

Recorded run (the committed ``deepinfer/assets/demo``); ``RUN`` is the GPU run's output directory::

    python tools/train_demo.py prepare
    python tools/train_demo.py train --out RUN --budget 210 --mtp-budget 55     # one NVIDIA H200
    python tools/train_demo.py heal --run RUN --out HEALED
    python tools/train_demo.py export --run HEALED
    python tools/train_demo.py plot --run RUN --heal HEALED

    equivalent without calibration: train --out RUN --steps 1000 --mtp-steps 618

* GPU (torch 2.11.0+cu130, transformers 5.23.0): command wall time 230 s, of which training 218 s. Main:
  154.9 ms/step calibrated, the calibrated total hit the 1000-step cap (1000 x 64 x 512 = 32.8M tokens, 11.7
  epochs) in 159 s; peak GPU memory 16.8 GB. MTP: 84.1 ms/step -> 618 steps in 51 s.
* Main: last batch loss 1.243 (step 1000); validation loss 4.614 (step 100), 3.390 (400), **3.291 (700, kept,
  8.2 epochs)**, 3.404 (1000): the corpus is memorized after ~8 epochs (train ~1.3-1.7 vs validation 3.3).
* MTP: last batch loss 2.406; validation loss 3.541 and validation acceptance 49.1% (step 618, kept).
* Held-out (all 67 files, 300,645 scored tokens, ``deepinfer eval --max-tokens 0``): perplexity 34.19 fp32 /
  34.55 exported FP8+FP4 (+1.04%); top-1 accuracy 35.53% / 35.36%; MTP acceptance 45.36% / 44.92%. Before the
  heal step (quantized): perplexity 34.66, top-1 35.52%, MTP acceptance 45.31%.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from the repository root without installing the package

from deepinfer.config.model import ModelConfig  # noqa: E402

_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "scale_fmt": "ue8m0"}
DEMO_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 1,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "compress_ratios": [0, 4, 16, 4, 16, 0, 0],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 65536,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": _QUANT,
    "expert_dtype": "fp4",
}
SEEDS = {"init": 0, "data": 1, "tid2eid": 2, "mtp_data": 3, "heal_data": 4, "heal_split": 5}
VAL_MODULUS, VAL_REMAINDER = 20, 1  # validation split: training files with sha1(path)[0] % 20 == 1
WEIGHT_SHARD_BYTES = 15_000_000  # files returned from the GPU machine must stay under 16 MB each


# ---- data -------------------------------------------------------------------------------------------------------
def _is_val(rel: str) -> bool:
    return hashlib.sha1(rel.encode("utf-8")).digest()[0] % VAL_MODULUS == VAL_REMAINDER


def cmd_prepare(a: argparse.Namespace) -> None:
    import platform

    from deepinfer import corpus
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer()
    files = corpus.train_files()
    assert not any(corpus.is_heldout(f) for f in files)
    split = {"train": [f for f in files if not _is_val(f)], "val": [f for f in files if _is_val(f)]}
    out, meta = {}, {"python": platform.python_version(), "files": {}}
    for name, rels in split.items():
        texts = list(corpus.iter_texts(rels))
        ids = []
        for enc in tok.encode_batch(texts):
            ids += [tok.bos_id] + enc + [tok.eos_id]
        out[name] = torch.tensor(ids, dtype=torch.int16)
        digest = hashlib.sha256("\n".join(rels).encode() + b"".join(t.encode() for t in texts)).hexdigest()
        meta["files"][name] = {"count": len(rels), "tokens": len(ids), "bytes": sum(len(t.encode()) for t in texts),
                               "sha256": digest}
        print(f"{name}: {len(rels)} files, {len(ids)} tokens")
    out["meta"] = meta
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, a.out)
    print(f"wrote {a.out}")


class Windows:
    """Random ``seq``-token windows of a token stream (seeded; the same seed gives the same batches)."""

    def __init__(self, stream: torch.Tensor, seq: int, batch: int, seed: int, device: torch.device) -> None:
        self.stream, self.seq, self.batch, self.device = stream.long(), seq, batch, device
        self.g = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.stream) - self.seq, (self.batch,), generator=self.g)
        x = torch.stack([self.stream[s : s + self.seq] for s in starts.tolist()])
        return x.to(self.device, non_blocking=True)


def val_batches(stream: torch.Tensor, seq: int, n: int, batch: int) -> list[torch.Tensor]:
    """``n`` evenly spaced validation windows, in batches (fixed, so every evaluation sees the same tokens)."""
    stride = (len(stream) - seq) // n
    xs = torch.stack([stream[i * stride : i * stride + seq].long() for i in range(n)])
    return list(xs.split(batch))


# ---- HF model pieces --------------------------------------------------------------------------------------------
def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """All experts on all tokens, combined with the router weights (zero for unselected experts)."""
    t = hidden_states.shape[0]
    combine = torch.zeros(t, self.num_experts, dtype=top_k_weights.dtype, device=hidden_states.device)
    combine = combine.scatter_add(1, top_k_index, top_k_weights)
    gate_up = torch.einsum("th,eih->tei", hidden_states, self.gate_up_proj.to(hidden_states.dtype))
    act = self._apply_gate(gate_up)  # [T, E, I], clamped SwiGLU
    act = act * combine.unsqueeze(-1).to(act.dtype)
    return torch.einsum("tei,ehi->th", act, self.down_proj.to(act.dtype)).to(hidden_states.dtype)


def build_main(cfg: ModelConfig, device: torch.device):
    from transformers import DeepseekV4ForCausalLM
    from transformers.integrations.moe import ExpertsInterface

    from deepinfer.hf_bridge import hf_config

    ExpertsInterface.register("dense", dense_experts_forward)
    torch.manual_seed(SEEDS["init"])
    model = DeepseekV4ForCausalLM(hf_config(cfg.replace(num_nextn_predict_layers=0)))
    model.set_experts_implementation("dense")
    assert model.config._experts_implementation == "dense"
    g = torch.Generator().manual_seed(SEEDS["tid2eid"])
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                table = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(dim=1)
                buf.copy_(table[:, : buf.shape[1]])
    return model.to(device)


class BiasBalancer:
    """V4's auxiliary-loss-free load balancing: count each routed layer's expert picks, then nudge
    ``e_score_correction_bias`` by ``rate`` towards balance after every optimizer step."""

    def __init__(self, module: torch.nn.Module, rate: float) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        self.rate = rate
        self.last_imbalance = float("nan")
        self.routers = [m for m in module.modules() if isinstance(m, DeepseekV4TopKRouter)]
        self.counts = {id(r): None for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, router, _inputs, outputs) -> None:
        if not router.training:
            return
        idx = outputs[2].reshape(-1)
        c = torch.zeros(router.num_experts, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float))
        prev = self.counts[id(router)]
        self.counts[id(router)] = c if prev is None else prev + c

    @torch.no_grad()
    def step(self, measure: bool = False) -> None:
        """Update the biases; with ``measure``, keep max/mean expert load of the worst layer (1.0 = balanced)."""
        loads = []
        for r in self.routers:
            c = self.counts[id(r)]
            if c is not None:
                if measure:
                    loads.append(c.max() / c.mean())
                r.e_score_correction_bias.add_(self.rate * torch.sign(c.mean() - c))
                self.counts[id(r)] = None
        if loads:
            self.last_imbalance = float(torch.stack(loads).max())


class IndexerDistiller:
    """KL(main attention over compressed entries || indexer scores) for every CSA layer (DeepSeek-V3.2 style)."""

    def __init__(self, model) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor

        self.layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            if isinstance(attn.compressor, DeepseekV4CSACompressor):
                rec: dict = {"attn": attn}
                attn.register_forward_pre_hook(self._attn_pre(rec), with_kwargs=True)
                attn.compressor.register_forward_hook(self._store(rec, "compressed"))
                attn.compressor.indexer.register_forward_pre_hook(self._detach_inputs)
                attn.compressor.indexer.scorer.register_forward_hook(self._store(rec, "scores"))
                self.layers.append(rec)

    @staticmethod
    def _attn_pre(rec):
        def hook(_m, args, kwargs):
            rec["x"] = args[0] if args else kwargs["hidden_states"]
            rec["rope"] = kwargs["position_embeddings"]["compress"]
            rec["pos"] = kwargs["position_ids"]
        return hook

    @staticmethod
    def _store(rec, key):
        def hook(_m, _args, out):
            rec[key] = out[0] if key == "compressed" else out
        return hook

    @staticmethod
    def _detach_inputs(_m, args):
        return (args[0].detach(), args[1].detach(), *args[2:])

    def loss(self) -> torch.Tensor:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        total = 0.0
        for rec in self.layers:
            attn, x, scores = rec["attn"], rec["x"].detach(), rec["scores"]
            ckv = rec["compressed"].detach()  # [B, 1, T, D]
            b, s, _ = x.shape
            with torch.no_grad():
                q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(b, s, -1, attn.head_dim).transpose(1, 2)
                q = apply_rotary_pos_emb(attn.q_b_norm(q), *rec["rope"])
                logits = torch.matmul(q.float(), ckv.float().transpose(-1, -2)) * attn.scaling  # [B, H, S, T]
                ratio = attn.compressor.compress_rate
                visible = torch.arange(ckv.shape[2], device=x.device)[None, None, :] < \
                    ((rec["pos"] + 1) // ratio)[..., None]
                visible = visible.expand(b, s, -1)  # [B, S, T]
                target = logits.masked_fill(~visible[:, None], float("-inf")).softmax(-1).mean(1)
            rows = visible.any(-1)
            rec["zero_frac"] = (scores.detach()[visible] == 0).float().mean()
            pred = scores.float().masked_fill(~visible, float("-inf")).log_softmax(-1)
            kl = (target * (target.clamp_min(1e-30).log() - pred)).masked_fill(~visible, 0).sum(-1)
            total = total + kl[rows].mean()
        return total / max(1, len(self.layers))

    def zero_fraction(self) -> float:
        """Fraction of visible entries whose indexer score is exactly 0 (all heads' ReLU off), worst layer."""
        return max(float(rec.get("zero_frac", float("nan"))) for rec in self.layers)


def param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


class Phase:
    """Shared loop for both phases: warmup + cosine, budget calibration, periodic validation, best-state keeping."""

    def __init__(self, name: str, a: argparse.Namespace, steps: int, budget: float, peak_lr: float,
                 warmup: int, device: torch.device) -> None:
        self.name, self.a, self.steps, self.budget = name, a, steps, budget
        self.peak_lr, self.warmup, self.device = peak_lr, warmup, device
        self.log: dict = {"train": [], "val": [], "calibration": None}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, train_step, evaluate, state_fn, max_steps: int) -> dict:
        """``train_step(step, lr, want_metrics) -> dict of floats`` (empty unless asked); ``evaluate() -> dict`` (``loss`` is minimized);
        ``state_fn() -> state dict to keep``."""
        total = self.steps or max_steps
        best, best_state = math.inf, None
        self.sync()
        t0 = time.perf_counter()
        calib_start = None
        step = 0
        while step < total:
            lr = lr_at(step, total, self.peak_lr, self.warmup)
            metrics = train_step(step, lr, (step + 1) % self.a.log_every == 0 or step + 1 == total)
            step += 1
            if step == 6 and not self.steps:
                self.sync()
                calib_start = time.perf_counter()
            if step == 26 and not self.steps:
                self.sync()
                per_step = (time.perf_counter() - calib_start) / 20
                elapsed = time.perf_counter() - t0
                total = max(step + 1, min(max_steps, int(step + (self.budget - elapsed) / (per_step * 1.06))))
                self.log["calibration"] = {"seconds_per_step": per_step, "total_steps": total}
                print(f"[{self.name}] {per_step * 1000:.1f} ms/step -> {total} steps", flush=True)
            if metrics:
                rec = {"step": step, "lr": lr, "time": time.perf_counter() - t0,
                       **{k: float(v) for k, v in metrics.items()}}
                self.log["train"].append(rec)
                print(f"[{self.name}] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in rec.items()), flush=True)
            stop = not self.steps and time.perf_counter() - t0 > self.budget * 1.25
            if step % self.a.eval_every == 0 or step == total or stop:
                val = evaluate()
                val.update(step=step, time=time.perf_counter() - t0)
                self.log["val"].append(val)
                print(f"[{self.name}] val " + json.dumps(val), flush=True)
                if val["loss"] < best:
                    best, best_state = val["loss"], {k: v.detach().clone() for k, v in state_fn().items()}
            if stop:
                print(f"[{self.name}] stopping at step {step}: over the time budget", flush=True)
                self.log["stopped_early"] = step
                break
        self.sync()
        self.log.update(steps=step, seconds=time.perf_counter() - t0, best_val_loss=best,
                        best_step=min(self.log["val"], key=lambda v: v["loss"])["step"])
        return best_state


def cmd_train(a: argparse.Namespace) -> None:
    from safetensors.torch import save_file
    from transformers import __version__ as tf_version

    from deepinfer.hf_bridge import HFMTP, hf_state_to_native, mtp_rename

    t_start = time.perf_counter()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                    enabled=False)
    cfg = ModelConfig.from_dict(DEMO_CONFIG)
    data = torch.load(a.data)
    train_stream, val_stream = data["train"], data["val"]
    seq = a.context
    vals = val_batches(val_stream, seq, a.val_windows, a.batch)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = {"config": DEMO_CONFIG, "args": {k: v for k, v in vars(a).items() if k != "func"}, "data": data["meta"], "torch": torch.__version__,
           "transformers": tf_version, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    # ---- phase 1: main model ----------------------------------------------------------------------------------
    model = build_main(cfg, device)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    balancer = BiasBalancer(model, a.bias_rate)
    distiller = IndexerDistiller(model)
    batches = Windows(train_stream, seq, a.batch, SEEDS["data"], device)

    def train_step(step, lr, want):
        for group in opt.param_groups:
            group["lr"] = lr
        x = batches.next()
        with amp:
            lm = model(input_ids=x, labels=x, use_cache=False).loss
            idx = distiller.loss()
        opt.zero_grad(set_to_none=True)
        (lm + a.indexer_coef * idx).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        balancer.step(measure=want)
        if want:
            return {"loss": lm.item(), "indexer_kl": idx.detach().item(), "grad_norm": norm.item(),
                    "imbalance": balancer.last_imbalance, "indexer_zero": distiller.zero_fraction()}
        return {}

    @torch.no_grad()
    def evaluate_main():
        model.eval()
        tot, n = 0.0, 0
        for x in vals:
            x = x.to(device)
            with amp:
                tot += model(input_ids=x, labels=x, use_cache=False).loss.item() * x.numel()
            n += x.numel()
        model.train()
        return {"loss": tot / n}

    phase = Phase("main", a, a.steps, a.budget, a.lr, a.warmup, device)
    best_main = phase.run(train_step, evaluate_main, model.state_dict, a.max_steps)
    log["main"] = phase.log
    model.load_state_dict(best_main)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    # ---- phase 2: MTP on the frozen main model ----------------------------------------------------------------
    mtp = HFMTP(cfg).to(device)
    last = model.model.layers[cfg.num_hidden_layers - 1]
    assert cfg.layer_types[-1] == "sliding_attention" and cfg.mlp_layer_types[-1] == "moe"
    with torch.no_grad():
        mtp.layer.load_state_dict(last.state_dict())
        mtp.hc_head.load_state_dict(model.model.hc_head.state_dict())
        mtp.norm.load_state_dict(model.model.norm.state_dict())
        for norm in (mtp.enorm, mtp.hnorm):
            norm.weight.fill_(1.0)
        for proj in (mtp.e_proj, mtp.h_proj):
            proj.weight.copy_(torch.eye(cfg.hidden_size))
    mtp.config._experts_implementation = "dense"
    mtp.train()
    captured: list[torch.Tensor] = []
    model.model.hc_head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    mopt = torch.optim.AdamW(param_groups(mtp, a.weight_decay), lr=a.mtp_lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")
    mbalancer = BiasBalancer(mtp, a.bias_rate)
    mbatches = Windows(train_stream, seq, a.batch, SEEDS["mtp_data"], device)

    def mtp_logits(x):
        captured.clear()
        with torch.no_grad(), amp:
            main_logits = model(input_ids=x, use_cache=False).logits
        streams = captured[0].detach()
        with amp:
            outs = mtp(streams[:, :-1], x[:, 1:], model.model.embed_tokens, model.model.rotary_emb)
            return mtp.logits(outs, model.lm_head), main_logits  # [B, S-1, V]: guesses of tokens p+2

    def mtp_step(step, lr, want):
        for group in mopt.param_groups:
            group["lr"] = lr
        x = mbatches.next()
        logits, _ = mtp_logits(x)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))
        mopt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(mtp.parameters(), a.clip)
        mopt.step()
        mbalancer.step(measure=want)
        if want:
            return {"loss": loss.item(), "grad_norm": norm.item(), "imbalance": mbalancer.last_imbalance}
        return {}

    @torch.no_grad()
    def evaluate_mtp():
        mtp.eval()
        tot, n, acc = 0.0, 0, 0
        for x in vals:
            x = x.to(device)
            logits, main_logits = mtp_logits(x)
            tot += F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1),
                                   reduction="sum").item()
            acc += int((logits[:, :-1].argmax(-1) == main_logits[:, 1:-1].argmax(-1)).sum())
            n += x[:, 2:].numel()
        mtp.train()
        return {"loss": tot / n, "acceptance": acc / n}

    mphase = Phase("mtp", a, a.mtp_steps, a.mtp_budget, a.mtp_lr, a.mtp_warmup, device)
    best_mtp = mphase.run(mtp_step, evaluate_mtp, mtp.state_dict, a.mtp_max_steps)
    log["mtp"] = mphase.log
    mtp.load_state_dict(best_mtp)

    # ---- save: native names, fp32, shards under 16 MB ----------------------------------------------------------
    native = hf_state_to_native({k: v.float().cpu() for k, v in model.state_dict().items()})
    native.update(hf_state_to_native({k: v.float().cpu() for k, v in mtp.state_dict().items()}, mtp_rename))
    native = {k: v.contiguous() if v.is_floating_point() else v.long().contiguous() for k, v in native.items()}
    shards, size = [{}], 0
    for name in sorted(native):
        nbytes = native[name].numel() * native[name].element_size()
        if shards[-1] and size + nbytes > WEIGHT_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = native[name]
        size += nbytes
    for i, shard in enumerate(shards):
        save_file(shard, str(out / f"weights-{i + 1}-of-{len(shards)}.safetensors"))
    log["total_seconds"] = time.perf_counter() - t_start
    if device.type == "cuda":
        log["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"saved {len(native)} tensors in {len(shards)} shards to {out}; total {log['total_seconds']:.1f} s")


# ---- export -----------------------------------------------------------------------------------------------------
def load_run_weights(run: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    native: dict[str, torch.Tensor] = {}
    for path in sorted(Path(run).glob("weights-*.safetensors")):
        native.update(load_file(str(path)))
    if not native:
        raise FileNotFoundError(f"{run}: no weights-*.safetensors")
    return native


def export_checkpoint(native: dict[str, torch.Tensor], out: str | Path, quantized: bool = True) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the native layout: quantized (FP8 e4m3 + UE8M0 128x128
    block scales, FP4 e2m1 experts + per-32 UE8M0 scales, bf16/fp32/int64 per ``storage_format``) or fp32."""
    from safetensors.torch import save_file

    from deepinfer.model.deepseek_v4 import DeepseekV4
    from deepinfer.model.quant import quant_fp4, quant_fp8_block, scale_name, storage_format

    cfg = ModelConfig.from_dict(DEMO_CONFIG)
    if not quantized:
        cfg = cfg.replace(quant=None, dtype="float32")
    with torch.device("meta"):
        expected = DeepseekV4(cfg, torch.float32).state_dict()
    if set(expected) != set(native):
        raise ValueError(f"name mismatch: missing {sorted(set(expected) - set(native))[:5]}, "
                         f"extra {sorted(set(native) - set(expected))[:5]}")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    stored: dict[str, torch.Tensor] = {}
    for name in sorted(expected):
        w, fmt = native[name], storage_format(name, cfg)
        if tuple(w.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {tuple(expected[name].shape)}")
        if fmt == "fp8":
            stored[name], stored[scale_name(name)] = quant_fp8_block(w.float(), cfg.quant.weight_block_size)
        elif fmt == "fp4":
            stored[name], stored[scale_name(name)] = quant_fp4(w.float())
        elif fmt == "int64":
            stored[name] = w.to(torch.int64)
        else:
            stored[name] = w.to(dtypes[fmt])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = cfg.to_native_dict()
    # HF's DeepseekV4Config maps compress_ratios through a fixed {0, 4, 128} table (KeyError on 16) unless
    # layer_types is given; deepinfer checks that the two agree. So AutoConfig / AutoTokenizer can read the dir.
    config["layer_types"] = list(cfg.layer_types)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- heal: teach the model the token boundaries a prompt can end on (CPU) ------------------------------------
def boundary_splits(tok) -> dict[int, list[int]]:
    """Tokens that merge line-ending punctuation with the newline + indentation after it (the tokenizer's
    ``"):\n    "``) -> the ids of the two halves (``"):"`` + ``"\n    "``). A prompt that ends at the line end
    (``"def f(n):"``) ends on the first half, which training text never shows followed by the second."""
    table = {}
    for i in range(tok.vocab_size):
        text = tok.decode([i], skip_special_tokens=False)
        cut = text.find("\n")
        if cut <= 0 or text[cut:].strip(" \n") or text[:cut] != text[:cut].strip():
            continue
        parts = tok.encode(text[:cut]) + tok.encode(text[cut:])
        if len(parts) >= 2 and tok.decode(parts) == text:
            table[i] = parts
    return table


def split_boundaries(x: torch.Tensor, table: dict[int, list[int]], p: float, g: torch.Generator) -> torch.Tensor:
    """Each row of ``x`` with every boundary token split with probability ``p``, cut back to the row length."""
    rows = []
    for row in x.tolist():
        draws = torch.rand(len(row), generator=g).tolist()
        out: list[int] = []
        for t, r in zip(row, draws):
            out.extend(table[t] if t in table and r < p else (t,))
        rows.append(out[: len(row)])
    return torch.tensor(rows, dtype=torch.long)


def cmd_heal(a: argparse.Namespace) -> None:
    """Fine-tune the trained main model on CPU with boundary tokens split at random (MTP layer unchanged)."""
    from safetensors.torch import save_file

    from deepinfer.hf_bridge import hf_state_to_native, native_to_hf_state
    from deepinfer.tokenizer import Tokenizer

    torch.manual_seed(SEEDS["heal_data"])
    t_start = time.perf_counter()
    cfg = ModelConfig.from_dict(DEMO_CONFIG)
    native = load_run_weights(a.run)
    model = build_main(cfg, torch.device("cpu"))
    model.load_state_dict(native_to_hf_state(model, native), strict=True)
    table = boundary_splits(Tokenizer())
    data = torch.load(a.data)
    batches = Windows(data["train"], a.context + a.context // 8, a.batch, SEEDS["heal_data"], torch.device("cpu"))
    g = torch.Generator().manual_seed(SEEDS["heal_split"])
    vals = val_batches(data["val"], 512, a.val_windows, 8)
    gv = torch.Generator().manual_seed(SEEDS["heal_split"] + 1)
    vals_split = [split_boundaries(x, table, 1.0, gv) for x in vals]

    @torch.no_grad()
    def evaluate() -> dict:
        model.eval()
        res = {}
        for name, xs in (("loss", vals), ("loss_split", vals_split)):
            tot = sum(model(input_ids=x, labels=x, use_cache=False).loss.item() * x.numel() for x in xs)
            res[name] = tot / sum(x.numel() for x in xs)
        model.train()
        return res

    log = {"args": {k: v for k, v in vars(a).items() if k != "func"}, "boundary_tokens": len(table),
           "train": [], "val": []}
    log["val"].append({"step": 0, **evaluate()})
    print(f"[heal] {len(table)} boundary tokens; before: {log['val'][0]}", flush=True)
    opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    for step in range(a.steps):
        lr = lr_at(step, a.steps, a.lr, a.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x = split_boundaries(batches.next(), table, a.split_prob, g)[:, : a.context]
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        if (step + 1) % 10 == 0:
            log["train"].append({"step": step + 1, "lr": lr, "loss": loss.item(),
                                 "time": time.perf_counter() - t_start})
            print(f"[heal] step {step + 1} loss {loss.item():.4f} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    log["val"].append({"step": a.steps, **evaluate()})
    print(f"[heal] after: {log['val'][-1]}", flush=True)
    healed = hf_state_to_native({k: v.float() for k, v in model.state_dict().items()})
    healed = {k: v.contiguous() if v.is_floating_point() else v.long().contiguous() for k, v in healed.items()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    merged = {**native, **healed}  # main model healed, mtp.* as trained
    save_file(merged, str(out / "weights-1-of-1.safetensors"))
    log["seconds"] = time.perf_counter() - t_start
    (out / "heal_log.json").write_text(json.dumps(log, indent=1))
    print(f"wrote {out}; {log['seconds']:.0f} s", flush=True)



def cmd_export(a: argparse.Namespace) -> None:
    native = load_run_weights(a.run)
    export_checkpoint(native, a.out, quantized=True)
    print(f"wrote {a.out} ({(Path(a.out) / 'model.safetensors').stat().st_size / 1e6:.2f} MB)")
    if a.fp32_out:
        export_checkpoint(native, a.fp32_out, quantized=False)
        print(f"wrote {a.fp32_out} (unquantized fp32)")


def cmd_plot(a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.loads((Path(a.run) / "train_log.json").read_text())
    heal = json.loads((Path(a.heal) / "heal_log.json").read_text()) if a.heal else None
    panels = [("main", "main model: next token (GPU)"), ("mtp", "MTP layer: token p+2 (GPU, main frozen)")]
    fig, axes = plt.subplots(1, len(panels) + bool(heal), figsize=(5.2 * (len(panels) + bool(heal)), 4))
    for ax, (phase, title) in zip(axes, panels):
        tr, va = log[phase]["train"], log[phase]["val"]
        ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train batch", lw=1)
        ax.plot([r["step"] for r in va], [r["loss"] for r in va], "o-", label="validation", ms=3)
        best = log[phase]["best_step"]
        ax.axvline(best, color="gray", ls=":", lw=1, label=f"kept (step {best})")
    if heal:
        ax = axes[-1]
        ax.plot([r["step"] for r in heal["train"]], [r["loss"] for r in heal["train"]], label="train batch", lw=1)
        for key, label in (("loss", "validation"), ("loss_split", "validation, line ends split")):
            ax.plot([v["step"] for v in heal["val"]], [v[key] for v in heal["val"]], "o-", label=label, ms=4)
        panels.append(("heal", "boundary fine-tune of the kept main model (CPU)"))
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("cross entropy (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"deepinfer demo DeepSeek-V4 on the Python stdlib ({log['device']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(a.out, dpi=80)
    print(f"wrote {a.out}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare", help="tokenize the training/validation stdlib files (CPU)")
    s.add_argument("--out", default=str(ROOT / ".whl" / "train_demo" / "data.pt"))
    s.set_defaults(func=cmd_prepare)
    t = sub.add_parser("train", help="train the main model, then the MTP layer")
    t.add_argument("--data", default=str(ROOT / ".whl" / "train_demo" / "data.pt"))
    t.add_argument("--out", required=True)
    t.add_argument("--device", default=None)
    t.add_argument("--context", type=int, default=512)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--bias-rate", type=float, default=1e-2)
    t.add_argument("--indexer-coef", type=float, default=1.0)
    t.add_argument("--steps", type=int, default=0, help="main steps (0: calibrate to --budget)")
    t.add_argument("--budget", type=float, default=190.0, help="main phase wall-clock budget (s)")
    t.add_argument("--max-steps", type=int, default=1000, help="cap for the calibrated main step count")
    t.add_argument("--mtp-lr", type=float, default=1e-3)
    t.add_argument("--mtp-warmup", type=int, default=30)
    t.add_argument("--mtp-steps", type=int, default=0, help="MTP steps (0: calibrate to --mtp-budget)")
    t.add_argument("--mtp-budget", type=float, default=55.0, help="MTP phase wall-clock budget (s)")
    t.add_argument("--mtp-max-steps", type=int, default=1000, help="cap for the calibrated MTP step count")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--val-windows", type=int, default=64)
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("export", help="write the native quantized checkpoint (and optionally an fp32 one)")
    e.add_argument("--run", required=True)
    e.add_argument("--out", default=str(ROOT / "deepinfer" / "assets" / "demo"))
    e.add_argument("--fp32-out", default=None)
    e.set_defaults(func=cmd_export)
    h = sub.add_parser("heal", help="CPU fine-tune with line-end boundary tokens split at random")
    h.add_argument("--run", required=True, help="directory with the trained weights-*.safetensors")
    h.add_argument("--data", default=str(ROOT / ".whl" / "train_demo" / "data.pt"))
    h.add_argument("--out", required=True)
    h.add_argument("--steps", type=int, default=300)
    h.add_argument("--batch", type=int, default=8)
    h.add_argument("--context", type=int, default=256)
    h.add_argument("--lr", type=float, default=2e-4)
    h.add_argument("--warmup", type=int, default=20)
    h.add_argument("--weight-decay", type=float, default=0.1)
    h.add_argument("--clip", type=float, default=1.0)
    h.add_argument("--split-prob", type=float, default=0.25)
    h.add_argument("--val-windows", type=int, default=32)
    h.set_defaults(func=cmd_heal)
    g = sub.add_parser("plot", help="loss curves of a run as PNG")
    g.add_argument("--run", required=True)
    g.add_argument("--heal", default=None, help="heal output directory (adds a third panel)")
    g.add_argument("--out", default=str(ROOT / "deepinfer" / "assets" / "demo" / "loss.png"))
    g.set_defaults(func=cmd_plot)
    a = p.parse_args(argv)
    a.func(a)


if __name__ == "__main__":
    main()
