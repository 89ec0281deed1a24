"""Per-layer sweep of DeepSeek-V4.1-Flash-shaped layers on the engine's V4.1 path, with V4-Flash's figures
(``layer_sweep.py``) from the same run.

    python bench/layer_sweep_v41.py [--batches 1 8 32 128] [--context 1024] [--prefill 4096] [--v4-layers 4]
    python bench/layer_sweep_v41.py --tiny --device cpu      # smoke test of the script on a CPU

V4.1: the spec's V4.1-Flash shapes (``deepinfer/assets/shapes/v41-flash``) through the engine's dummy loader on
the device (``model/v41/device.py``: the 384 FP4 experts of a layer fused, dense FP8 with 32x32 scales), one
layer of each role of the 40-layer schedule, with the count of that role in V4.1-Flash:
    window-only (layers 0, 1, 37-39: 5), ratio-2 KV source (2, 8, 14: 3), ratio-2 reuse (15), ratio-1 KV source
    publishing the candidate blocks (20: 1), ratio-1 re-indexing (24, 28, 32, 36: 4), ratio-1 reuse (12).
Each layer is timed on its own inside the step (CUDA events around each block: the step runs eagerly, V4.1 has
no CUDA graphs yet); the 40-layer figure is the count-weighted sum plus the step's once-per-step rest
(embedding, row lists, host layout, head: the step minus its layers). Engram (layers 1 and 14) is left out:
each table holds ~384 M rows of 256 (98 B weights), more than one device holds.

Decode: B sequences whose caches hold C random positions, one new token each, through ``PagedV41.forward`` as
the runner calls it (a ``StepIndex`` with its host facts); prefill: one sequence of L tokens in one chunk.
Times are medians. Floors (decode, per layer): the bytes the step must read at the measured copy bandwidth --
weights as held (dense FP8 with fp32 32x32 scales; the routed experts B tokens hit, uniform routing, in FP4
with their scales), weights as stored (the scales as UE8M0 bytes), and the cache rows
(window rows, the index keys an index source scores, the top-k entries every compressed layer reads).
V4-Flash: ``layer_sweep.py``'s build, decode (CUDA graphs) and prefill on --v4-layers of its layers, at the
same points. JSON to --out (``layer_sweep_v41.json``, ``_tiny`` for --tiny).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import layer_sweep as v4  # noqa: E402
from deepinfer.assets import shapes_dir  # noqa: E402
from deepinfer.config.v41 import V41Config  # noqa: E402
from deepinfer.kv.spec_v41 import build_v41_layout  # noqa: E402
from deepinfer.model.step_index import HostRuns, build_step_index  # noqa: E402
from deepinfer.model.v41.device import dummy_v41_on_device  # noqa: E402
from deepinfer.model.v41.names import storage_format  # noqa: E402
from deepinfer.model.v41.paged import PagedV41  # noqa: E402
from deepinfer.ops.table import select  # noqa: E402
from deepinfer.runner.sequences import SequenceCache  # noqa: E402

# (role, count in V4.1-Flash's 40 layers): the layers of the swept model, in order.
ROLES = (("window", 5), ("r2_source", 3), ("r2_reuse", 15), ("r1_candidate_source", 1), ("r1_reindex", 4),
         ("r1_reuse", 12))
SCHEDULE = dict(num_hidden_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3],
                index_source_layer_ids=[1, 3, 4], candidate_source_layer_id=3, engram_layer_ids=[],
                engram_num_embeddings=[], num_nextn_predict_layers=0, dspark_target_layer_ids=[3, 4, 5])
TINY = dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
            qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2, n_routed_experts=8,
            num_experts_per_tok=2, index_n_heads=4, index_head_dim=32, index_topk=8, candidate_topk_blocks=3,
            dspark_noise_token_id=509)
BLOCK = 256


def v41_config(tiny: bool) -> V41Config:
    d = json.loads((shapes_dir("v41-flash") / "config.json").read_text())
    d["text_config"].update(SCHEDULE)
    if tiny:
        d["text_config"].update(TINY)
    cfg = V41Config.from_dict(d)
    roles = [cfg.role(i) for i in range(cfg.num_hidden_layers)]
    assert [(r.ratio, r.kv_source, r.index_source, r.candidate_source, r.uses_candidates) for r in roles] == [
        (0, False, False, False, False), (2, True, True, False, False), (2, False, False, False, False),
        (1, True, True, True, False), (1, False, True, False, True), (1, False, False, False, False)], ROLES
    return cfg


def build_v41(cfg: V41Config, device: str) -> PagedV41:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return PagedV41(dummy_v41_on_device(cfg, dtype, device, select(device), seed=0), key_lists=True)


def random_cache(model: PagedV41, seqs: int, context: int, capacity: int, device: str):
    cfg = model.cfg
    layout = build_v41_layout(cfg, BLOCK, packed=True)
    cache = SequenceCache(layout, seqs * -(-(capacity + 1) // BLOCK) + 2, model.model.dtype, device)
    for t in cache.storage.tensors.values():
        if t.dtype == torch.uint8:  # packed FP8 / FP4 rows: finite codes and moderate scales
            t.random_(0, 0x70)
        elif t.is_floating_point():
            t.normal_()
        else:
            t.random_(3, cfg.vocab_size)
    return cache, v4.full_sequences(cache, seqs, context)


class LayerClock:
    """Times each block's ``run`` inside the step (events on CUDA, the host clock on a CPU)."""

    def __init__(self, model: PagedV41, device: str) -> None:
        self.cuda, self.marks = device == "cuda", []
        for i, block in enumerate(model.model.layers):
            block.run = self._wrap(i, block.run)

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _wrap(self, i, run):
        def timed_run(*args, **kwargs):
            start = self._now()
            out = run(*args, **kwargs)
            self.marks.append((i, start, self._now()))
            return out
        return timed_run

    def take(self, layers: int, reps: int) -> list[float]:
        """ms per layer of the last ``reps`` steps (their median; the warm-up step before them is dropped),
        then forget every mark."""
        if self.cuda:
            torch.cuda.synchronize()
        per = [[] for _ in range(layers)]
        for i, a, b in self.marks[-reps * layers:]:
            per[i].append(a.elapsed_time(b) if self.cuda else (b - a) * 1e3)
        self.marks = []
        return [statistics.median(p) if p else 0.0 for p in per]


def step(model: PagedV41, cache: SequenceCache, new: dict[int, list[int]], device: str) -> None:
    ids, fb = cache.plan(new)
    index = build_step_index(fb, cache.storage, model.cfg.sliding_window).to(device)
    runs = fb.runs  # the runner's host facts, as the engine's step gets them (no readback of the index)
    index = dataclasses.replace(index, host=HostRuns.of(np.array([r.first_pos for r in runs]),
                                                        np.array([r.length for r in runs]), [0] * len(runs)))
    hidden = model(ids.to(device), None, cache.storage, index)
    ends = torch.tensor([r.start + r.length - 1 for r in runs]).to(device)
    model.logits(hidden[ends])


def decode(model: PagedV41, clock: LayerClock, batch: int, context: int, device: str) -> dict:
    cache, sids = random_cache(model, batch, context, context + 1, device)
    toks = v4.decode_tokens(batch, model.cfg.vocab_size)

    def one():
        for sid in sids:
            cache.truncate(sid, context)
        step(model, cache, {sid: [t] for sid, t in zip(sids, toks)}, device)

    ms = v4.timed(one, device, reps=5)
    return {"step_ms": ms, "layers_ms": clock.take(len(model.model.layers), 5)}


def prefill(model: PagedV41, clock: LayerClock, length: int, device: str) -> dict:
    cache, (sid,) = random_cache(model, 1, 0, length, device)
    toks = [3 + i % (model.cfg.vocab_size - 3) for i in range(length)]

    def one():
        cache.truncate(sid, 0)
        step(model, cache, {sid: toks}, device)

    ms = v4.timed(one, device, reps=3)
    return {"step_ms": ms, "layers_ms": clock.take(len(model.model.layers), 3)}


def weight_bytes(model: PagedV41, layer: int, batch: int) -> tuple[float, float]:
    """(as held, as stored) bytes a decode step of ``batch`` tokens reads from layer ``layer``'s weights."""
    cfg, block = model.cfg, model.model.layers[layer]
    held = stored = 0.0
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        if ".routed." in f".{name}":
            continue
        nbytes = t.numel() * t.element_size()
        held += nbytes
        if name.endswith(".weight_scale"):  # FP8Dense32's fp32 multipliers: UE8M0 bytes as stored
            stored += t.numel()
            continue
        fmt, scale_block = storage_format(f"layers.{layer}.{name}", cfg)  # a dequantized FP8 weight (fp16 runs)
        stored += t.numel() + t.numel() / (scale_block[0] * scale_block[1]) if fmt == "fp8" else nbytes
    routed = block.ffn.routed
    per_expert = sum(getattr(routed, n)[0].numel() * getattr(routed, n).element_size() for n in ("w13", "s13", "w2",
                                                                                              "s2"))
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    experts = e * (1 - (1 - k / e) ** batch) * per_expert
    return held + experts, stored + experts


def cache_bytes(model: PagedV41, storage, layer: int, context: int) -> float:
    """Bytes one sequence's decode token reads from the cache in layer ``layer``."""
    cfg = model.cfg
    role = cfg.role(layer)

    def row(key: str, name: str) -> int:
        t = storage.get(key, name)
        return t.shape[-1] * t.element_size()

    total = min(cfg.sliding_window, context) * row(f"layers.{layer}", "window_kv")
    if role.ratio:
        source = max(i for i in cfg.kv_source_layer_ids if i <= layer and cfg.role(i).ratio == role.ratio)
        entries = context // role.ratio
        total += min(cfg.index_topk, entries) * row(f"layers.{source}", "entries")
        if role.index_source:
            total += entries * row(f"layers.{source}", "index_keys")
    return total


def sweep_v41(args, device: str, bw: float | None) -> tuple[list[dict], dict]:
    cfg = v41_config(args.tiny)
    model = build_v41(cfg, device)
    clock = LayerClock(model, device)
    counts = [c for _, c in ROLES]
    layout_cache, _ = random_cache(model, 1, 0, 1, device)
    rows = []
    for b in args.batches:
        t = decode(model, clock, b, args.context, device)
        rest = max(t["step_ms"] - sum(t["layers_ms"]), 0.0)
        floors = []
        for i, (role, _) in enumerate(ROLES):
            held, stored = weight_bytes(model, i, b)
            kv = b * cache_bytes(model, layout_cache.storage, i, args.context)
            floors.append({"role": role, "ms": t["layers_ms"][i], "bytes_held": held + kv,
                           "bytes_stored": stored + kv,
                           "floor_ms": (held + kv) / bw * 1e3 if bw else None,
                           "floor_stored_ms": (stored + kv) / bw * 1e3 if bw else None})
        total = sum(c * f["ms"] for c, f in zip(counts, floors)) + rest
        rows.append({"model": "v4.1-flash", "kind": "decode", "context": args.context, "batch": b,
                     "layers": floors, "rest_ms_per_step": rest, "step_ms_6_layers": t["step_ms"],
                     "ms_per_layer_40": total / 40, "tpot_40_layers_ms": total, "tok_s_40_layers": b / total * 1e3,
                     "floor_ms_per_layer_40": sum(c * f["floor_ms"] for c, f in zip(counts, floors)) / 40
                     if bw else None})
        print(json.dumps(rows[-1]), flush=True)
    for length in args.prefill:
        t = prefill(model, clock, length, device)
        rest = max(t["step_ms"] - sum(t["layers_ms"]), 0.0)
        total = sum(c * ms for c, ms in zip(counts, t["layers_ms"])) + rest
        rows.append({"model": "v4.1-flash", "kind": "prefill", "tokens": length,
                     "layers": [{"role": r, "ms": ms} for (r, _), ms in zip(ROLES, t["layers_ms"])],
                     "rest_ms_per_step": rest, "ms_per_layer_40": total / 40, "ttft_40_layers_ms": total})
        print(json.dumps(rows[-1]), flush=True)
    meta = {"v41_roles": dict(ROLES), "v41_dense": "FP8 32x32 (fp8_linear_b32)", "v41_experts": "FP4 fused",
            "v41_engram": "left out"}
    del model, clock, layout_cache
    return rows, meta


def sweep_v4(args, device: str, bw: float | None) -> list[dict]:
    native = v4.from_layer(v4.TINY if args.tiny else v4.FLASH, 2)
    model = v4.build(native, args.v4_layers, device)
    n, rows = args.v4_layers, []
    floor = v4.weight_bytes_per_layer(model, model.cfg.num_experts_per_tok)
    for b in args.batches:
        t = v4.decode_ms(model, b, args.context, device, args.context + 256)
        if "replay_ms" in t:
            host = max(t["graph_ms"] - t["replay_ms"], 0.0)
            ms = v4.per_layer_ms(t["replay_ms"], t["head_ms"], host, n, t["preamble_ms"])
        else:
            ms = t["eager_ms"] / n
        nbytes = v4.decode_bytes_per_layer(model, b, args.context)
        rows.append({"model": "v4-flash", "kind": "decode", "context": args.context, "batch": b, "ms_per_layer_43": ms,
                     "eager_ms_per_layer": t["eager_ms"] / n, "bytes_per_layer": nbytes,
                     "floor_ms_per_layer": nbytes / bw * 1e3 if bw else None, "weight_bytes_per_layer_b1": floor})
        print(json.dumps(rows[-1]), flush=True)
    for length in args.prefill:
        ms = v4.prefill_ms(model, length, device, min(length, 4096)) / n
        rows.append({"model": "v4-flash", "kind": "prefill", "tokens": length, "ms_per_layer_43": ms,
                     "ttft_43_layers_ms": ms * 43})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    a.add_argument("--context", type=int, default=1024, help="positions each decode sequence holds")
    a.add_argument("--prefill", type=int, nargs="+", default=[4096])
    a.add_argument("--v4-layers", type=int, default=4, help="V4-Flash layers built for its figures (0: none)")
    a.add_argument("--device", default="cuda")
    a.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    a.add_argument("--commit", default=None, help="commit to record (default: git HEAD of the checkout)")
    a.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = a.parse_args()
    device = args.device
    bw = None
    if device == "cuda":
        from bench.kernels.ceilings import copy_bandwidth

        bw = copy_bandwidth()
    rows, meta = sweep_v41(args, device, bw)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if args.v4_layers:
        rows += sweep_v4(args, device, bw)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    meta.update({"date": time.strftime("%Y-%m-%d"), "commit": commit, "tiny": args.tiny,
                 "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "copy_bytes_per_s": bw,
                 "v4_layers": args.v4_layers, "torch": torch.__version__})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "layer_sweep_v41_tiny" if args.tiny else "layer_sweep_v41"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
