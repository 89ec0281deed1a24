"""Per-layer sweep of a V4-Flash-shaped model built directly on the device with random weights in the native
quantized formats (FP8 e4m3 + UE8M0 128x128 dense, FP4 e2m1 + per-32 UE8M0 experts); no checkpoint needed:
the engine's ``--load-format dummy`` path (``load_model(..., load_format="dummy")``), so the layers, their
layout and their kernels are those of a loaded checkpoint.

    python bench/layer_sweep.py [--layers 4] [--batches 1 8 32 128] [--contexts 1024 8192] [--prefill 1024 4096]
    python bench/layer_sweep.py --tiny --device cpu      # smoke test of the script on a CPU

Decode: B sequences whose caches hold C random positions (cache contents are random, never zeros), one new
token each; prefill: one sequence, L tokens in 1024-token chunks. Times are medians of CUDA-event timed
steps. Decode on CUDA runs as the engine runs it: a captured CUDA graph per batch, replayed after the host
builds and copies the step's row lists; the per-layer figure is a 43-layer step divided by 43:
(43 x (replay - LM head - preamble) / layers + LM head + preamble + host work per step) / 43, with the LM
head and the preamble (row lists, RoPE tables, embedding: once per step) each timed on its own as a graph.
The N layers are V4-Flash's layers 2..N+1 (--first-layer): CSA and HCA alternating like 41 of its 43
layers, one of them hash-routed. Eager times of the same batched path are kept for comparison. Prefill runs eagerly in
--chunk-token steps. Reported against the weight-byte floor at the measured copy bandwidth.
All 43 layers do not fit one H200: their native-format weights take ~154 GB (~3.6 GB a layer, 3.4 GB of it
the 256 FP4 experts) against its 141 GB, so N layers are timed and the figures extrapolated; an N that does not
fit stops with a message naming --layers.
With --modes default batch-invariant every point is timed with both op tables in turn on the same model
(``DEEPINFER_BATCH_INVARIANT``'s table swapped in with ``use_op_table``), rows tagged with their mode,
and the JSON named ``layer_sweep_modes.json``. With --hf the HF transformers peer (bf16, same shapes, eager
attention) runs where it fits: decode at batch <= 32 after an HF prefill of the smallest context, prefill at
L <= 4096. JSON goes to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.kv.spec import build_layout  # noqa: E402
from deepinfer.model.branches import INLINE  # noqa: E402
from deepinfer.model.deepseek_v4 import DeepseekV4  # noqa: E402
from deepinfer.model.device import use_op_table  # noqa: E402
from deepinfer.model.loader import load_model  # noqa: E402
from deepinfer.ops.table import select  # noqa: E402
from deepinfer.runner.cuda_graphs import DecodeGraphs  # noqa: E402
from deepinfer.runner.sequences import SequenceCache  # noqa: E402

FLASH = {"model_type": "deepseek_v4", "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "num_hash_layers": 3,
         "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                          "original_max_position_embeddings": 65536},
         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                 "scale_fmt": "ue8m0"}, "expert_dtype": "fp4", "num_nextn_predict_layers": 0}
TINY = {**FLASH, "vocab_size": 512, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 128,
        "qk_rope_head_dim": 32, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "index_n_heads": 4, "index_head_dim": 64,
        "index_topk": 8}


# --modes: the op table each mode times (the value: ``select``'s batch_invariant; "batch-invariant-mma": the
# invariant table with the MMA FP8 kernel for every M instead of swap-AB, ``invariant_fp8_swap_ab=False``, CUDA only).
MODES = {"default": False, "batch-invariant": True, "batch-invariant-mma": True}


def mode_table(device: str, mode: str):
    if mode != "batch-invariant-mma":
        return select(device, batch_invariant=MODES[mode])
    from deepinfer.ops.table import triton_ops
    from deepinfer.ops.tuning import KernelTuning

    tuning = dataclasses.replace(KernelTuning.for_device().invariant(), invariant_fp8_swap_ab=False)
    return triton_ops(tuning)


def from_layer(native: dict, first: int) -> dict:
    """The config whose layer 0 is ``native``'s layer ``first`` (its compress ratio and routing kind)."""
    return {**native, "compress_ratios": native["compress_ratios"][first:],
            "num_hash_layers": max(0, native["num_hash_layers"] - first)}


def build(native: dict, layers: int, device: str) -> DeepseekV4:
    """The engine's ``--load-format dummy`` path: FP8/FP4 weights generated on the device straight into the
    Triton layout (model/dummy.py, the same weight loaders as a checkpoint load)."""
    cfg = ModelConfig.from_dict({**native, "num_hidden_layers": layers})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return load_model(None, dtype=dtype, device=device, cfg=cfg, load_format="dummy", seed=0, ops=select(device),
                      progress=False)


def random_cache(model: DeepseekV4, seqs: int, context: int, device: str,
                 capacity: int | None = None) -> tuple[SequenceCache, list[int]]:
    layout = build_layout(model.cfg, 256, include_mtp=False)
    blocks = seqs * (-(-(max(context, capacity or 0) + 1) // 256)) + 2
    cache = SequenceCache(layout, blocks, model.dtype, device)
    for t in cache.storage.tensors.values():
        t.normal_()
    return cache, full_sequences(cache, seqs, context)


def full_sequences(cache: SequenceCache, seqs: int, context: int) -> list[int]:
    """``seqs`` new sequences of ``cache``, each holding ``context`` positions (whatever the pools hold)."""
    sids = []
    for _ in range(seqs):
        sid = cache.new_sequence()
        cache._ensure(sid, context)
        cache._lengths[sid] = context
        sids.append(sid)
    return sids


def timed(fn, device: str, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_tokens(batch: int, vocab: int) -> list[int]:
    """One distinct input token per sequence, as in real decoding. (With one shared id, a hash-routed layer would
    send the whole batch to the same k experts and read a fraction of the expert bytes a real batch reads.)"""
    return [3 + (7919 * i + 11) % (vocab - 3) for i in range(batch)]


def decode_ms(model, batch: int, context: int, device: str, max_model_len: int) -> dict[str, float]:
    """Median ms of one decode step: eager (batched path launched from Python) and, on CUDA, the engine's
    CUDA-graph step (host index build + copies + replay) and the bare replay."""
    cache, sids = random_cache(model, batch, context, device)

    toks = decode_tokens(batch, model.cfg.vocab_size)

    def plan():
        for sid in sids:
            cache.truncate(sid, context)  # same position every repetition
        return cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})

    def eager():
        ids, fb = plan()
        model.logits(model(ids.to(device), fb, cache.storage))

    out = {"eager_ms": timed(eager, device)}
    if device == "cuda":
        out["head_ms"] = head_ms(model, batch)
        graphs = DecodeGraphs(model, cache.storage, max_model_len, [batch])
        out["preamble_ms"] = preamble_ms(model, graphs, batch)
        graphs.capture()

        def graph_step():
            ids, fb = plan()
            graphs.run(ids.tolist(), fb)

        out["graph_ms"] = timed(graph_step, device, reps=20)
        out["replay_ms"] = timed(graphs._graphs[batch].graph.replay, device, reps=20)
        del graphs
    return out


def head_ms(model, batch: int) -> float:
    """The LM head (hc_head + norm + vocab projection) alone, replayed as a CUDA graph like the step: it runs
    once per step whatever the depth, so the 43-layer figure counts it once."""
    streams = torch.randn(batch, model.cfg.hc_mult, model.cfg.hidden_size, device="cuda", dtype=model.dtype)
    model.logits(streams)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.logits(streams)
    return timed(graph.replay, "cuda", reps=20)


def preamble_ms(model, graphs: DecodeGraphs, batch: int) -> float:
    """The step's work before its first layer (row lists from the block tables, RoPE tables, embedding),
    replayed as a CUDA graph: once per step whatever the depth, like the head."""
    ids = torch.zeros(batch, dtype=torch.long, device="cuda")
    index = graphs._padding_index(batch).to("cuda")

    def pre() -> None:
        model.context(ids, None, graphs.storage, index)
        model.embed(ids)

    pre()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pre()
    return timed(graph.replay, "cuda", reps=20)


def set_branches(model, branches):
    """Point every module's layer branches (model/branches.py) at ``branches``; returns the previous ones."""
    prev = next(m.branches for m in model.modules() if hasattr(m, "branches"))
    for m in model.modules():
        if hasattr(m, "branches"):
            m.branches = branches
    return prev


def per_layer_ms(replay_ms: float, head: float, host_ms: float, layers: int, pre: float = 0.0) -> float:
    """A 43-layer decode step / 43: 43 layers of (replay - head - preamble) / layers, plus the head, the
    preamble and the host work once."""
    return (max(replay_ms - head - pre, 0.0) / layers * 43 + head + pre + host_ms) / 43


def prefill_ms(model, length: int, device: str, chunk: int) -> float:
    cache, (sid,) = random_cache(model, 1, 0, device, capacity=length)

    def run():
        cache.truncate(sid, 0)
        for start in range(0, length, chunk):
            toks = [3 + (start + i) % (model.cfg.vocab_size - 3) for i in range(min(chunk, length - start))]
            ids, fb = cache.plan({sid: toks})
            model(ids.to(device), fb, cache.storage)
            cache.commit({sid: toks})
        return None

    return timed(run, device, reps=3)


def hf_peer(native: dict, layers: int, batches: list[int], context: int, prefill: list[int]) -> list[dict]:
    """HF transformers DeepseekV4ForCausalLM, bf16, same shapes, random weights: decode after an HF prefill of
    ``context`` tokens, and prefill of each length (batch 1). Per-layer ms = step / layers."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

    hf_cfg = {k: v for k, v in native.items() if k not in ("quantization_config", "expert_dtype")}
    cfg = DeepseekV4Config(**{**hf_cfg, "num_hidden_layers": layers})
    cfg._attn_implementation = "eager"
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg).to(torch.bfloat16).eval()
    rows = []
    with torch.no_grad():
        for b in batches:
            try:
                ids = torch.randint(3, cfg.vocab_size, (b, context), device="cuda")
                cache = DynamicCache(config=cfg)
                model(ids, past_key_values=cache, use_cache=True)
                nxt = torch.tensor(decode_tokens(b, cfg.vocab_size), device="cuda")[:, None]
                ms = timed(lambda: model(nxt, past_key_values=cache, use_cache=True), "cuda") / layers
                rows.append({"kind": "hf_decode", "context": context, "batch": b, "ms_per_layer": ms})
            except torch.OutOfMemoryError:
                rows.append({"kind": "hf_decode", "context": context, "batch": b, "ms_per_layer": None, "oom": True})
            torch.cuda.empty_cache()
            print(rows[-1], flush=True)
        for length in prefill:
            ids = torch.randint(3, cfg.vocab_size, (1, length), device="cuda")
            ms = timed(lambda: model(ids, use_cache=False), "cuda", reps=3) / layers
            rows.append({"kind": "hf_prefill", "tokens": length, "ms_per_layer": ms})
            print(rows[-1], flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def decode_bytes_per_layer(model: DeepseekV4, batch: int, context: int) -> float:
    """Bytes one decode step must read per layer (a model, not a measurement): the dense weights, the routed
    experts that B tokens hit (uniform routing: E * (1 - (1 - k/E)^B), random weights route about
    uniformly), and per sequence the attention's cache reads averaged over the CSA/HCA layer mix: 128 window
    rows, the 512 selected CSA entries plus all C/4 index keys, all C/128 HCA entries."""
    cfg = model.cfg
    dense = weight_bytes_per_layer(model, 0)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = e * (1 - (1 - k / e) ** batch)
    row, irow = cfg.head_dim * 2, cfg.index_head_dim * 2
    csa = cfg.sliding_window * row + min(cfg.index_topk, context // 4) * row + context // 4 * irow
    hca = cfg.sliding_window * row + context // 128 * row
    return dense + hit * (weight_bytes_per_layer(model, 1) - dense) + batch * (csa + hca) / 2


def weight_bytes_per_layer(model: DeepseekV4, active_experts: int) -> float:
    """Bytes a batch-1 decode step reads per layer: dense FP8 weights + scales (the shared expert included),
    ``active_experts`` routed FP4 experts with their scales, and the bf16/fp32 rest."""
    total = 0
    for layer in model.layers:
        # Each storage once: stacked projections (model/fused.py) leave the original modules holding views.
        seen: set[int] = set()
        for name, t in list(layer.named_buffers()) + list(layer.named_parameters()):
            storage = t.untyped_storage()
            if ".routed." in f".{name}" or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        fused = layer.ffn.routed  # FusedFP4Experts (the device transform's stacked experts)
        per_expert = sum(getattr(fused, n)[0].numel() * getattr(fused, n).element_size() for n in ("w13", "w2"))
        per_expert += sum(getattr(fused, n)[0].numel() * getattr(fused, n).element_size() for n in ("s13", "s2"))
        total += per_expert * active_experts
    return total / len(model.layers)


def rerun_hf(native: dict, src: Path, out: Path) -> None:
    import transformers

    data = json.loads(src.read_text())
    rows = [r for r in data["rows"] if not r["kind"].startswith("hf_")]
    old = [r for r in data["rows"] if r["kind"].startswith("hf_")]
    # The HF shapes of the JSON's earlier peer rows, else the ones --hf would have run (see main).
    src_rows = old or [{**r, "kind": "hf_" + r["kind"]} for r in rows
                       if (r["kind"] == "decode" and r["batch"] <= 32) or (r["kind"] == "prefill" and r["tokens"] <= 4096)]
    batches = sorted({r["batch"] for r in src_rows if r["kind"] == "hf_decode"})
    contexts = {r["context"] for r in src_rows if r["kind"] == "hf_decode"}
    prefill = sorted({r["tokens"] for r in src_rows if r["kind"] == "hf_prefill"})
    rows += hf_peer(native, data["meta"]["layers"], batches, min(contexts), prefill)
    data["meta"]["hf_transformers"] = transformers.__version__
    out.mkdir(parents=True, exist_ok=True)
    (out / src.name).write_text(json.dumps({"meta": data["meta"], "rows": rows}, indent=2))
    print(json.dumps(data["meta"]))


def prefill_flops(cfg, length: int) -> float:
    """Matmul FLOPs of one layer prefilling ``length`` tokens from an empty cache (2 per multiply-add): dense
    projections, active experts (routed top-k + shared), attention over <= window + compressed keys (CSA
    counts its top-k; HCA and the indexer all visible entries), averaged over the CSA/HCA layer mix."""
    h, d, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    dense = h * cfg.q_lora_rank + cfg.q_lora_rank * nh * d + h * d + nh * d * cfg.o_lora_rank + \
        cfg.o_groups * cfg.o_lora_rank * h
    experts = (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * h * cfg.moe_intermediate_size
    per_token = 2 * (dense + experts)
    keys_csa = min(cfg.sliding_window, length) + min(cfg.index_topk, length // 8)
    keys_hca = min(cfg.sliding_window, length) + length // 256
    attn = 2 * 2 * nh * d * (keys_csa + keys_hca) / 2  # q·k and p·v, mean of the two layer kinds
    indexer = 2 * cfg.index_n_heads * cfg.index_head_dim * (length / 8) / 2  # CSA layers only (half)
    return length * (per_token + attn + indexer)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--layers", type=int, default=4)
    a.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    a.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    a.add_argument("--prefill", type=int, nargs="+", default=[1024, 4096])
    a.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens per step)")
    a.add_argument("--device", default="cuda")
    a.add_argument("--commit", default=None, help="commit to record (default: git HEAD of the checkout)")
    a.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    a.add_argument("--hf", action="store_true", help="also time HF transformers (CUDA only)")
    a.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a.add_argument("--first-layer", type=int, default=2, help="bench V4-Flash's layers from this one on")
    a.add_argument("--ab-overlap", action="store_true",
                   help="also time each decode point with the layer branches on one stream (model/branches.py)")
    a.add_argument("--modes", nargs="+", choices=list(MODES), default=["default"],
                   help="op tables to time at every point, in turn (default: the default table only)")
    a.add_argument("--hf-only", metavar="JSON", default=None,
                   help="re-time only the HF peer (same shapes as JSON's rows) and write JSON with them replaced")
    args = a.parse_args()
    native = from_layer(TINY if args.tiny else FLASH, args.first_layer)
    if args.hf_only:
        return rerun_hf(native, Path(args.hf_only), Path(args.out))
    try:
        model = build(native, args.layers, args.device)
    except torch.cuda.OutOfMemoryError as e:
        total = torch.cuda.mem_get_info()[1]
        raise SystemExit(f"--layers {args.layers}: the weights do not fit in the device's {total / 2**30:.1f} GiB; "
                         "pass fewer layers (per-layer figures are extrapolated to 43 layers)") from e
    n = args.layers
    bw = gemm = None
    if args.device == "cuda":
        from bench.kernels.ceilings import bf16_gemm_rate, copy_bandwidth

        bw, gemm = copy_bandwidth(), bf16_gemm_rate()
    floor_bytes = weight_bytes_per_layer(model, model.cfg.num_experts_per_tok)
    rows = []
    max_len = max(args.contexts) + 256
    tables = {mode: mode_table(args.device, mode) for mode in args.modes}
    for c, b, mode in ((c, b, mode) for c in args.contexts for b in args.batches for mode in args.modes):
        use_op_table(model, tables[mode])
        times = decode_ms(model, b, c, args.device, max_len)
        if "replay_ms" in times:
            # 43-layer step = 43 layers of replay + the host's once-per-step work (index build, copies).
            host_ms = max(times["graph_ms"] - times["replay_ms"], 0.0)
            ms = per_layer_ms(times["replay_ms"], times["head_ms"], host_ms, n, times["preamble_ms"])
        else:
            host_ms, ms = None, times["eager_ms"] / n
        serial = {}
        if args.ab_overlap and "replay_ms" in times:  # the same point, every branch inline, same process
            on = set_branches(model, INLINE)
            t1 = decode_ms(model, b, c, args.device, max_len)
            set_branches(model, on)
            serial = {"serial_ms_per_layer": per_layer_ms(t1["replay_ms"], t1["head_ms"],
                                                          max(t1["graph_ms"] - t1["replay_ms"], 0.0), n,
                                                          t1["preamble_ms"]),
                      "serial_replay_ms_per_layer": t1["replay_ms"] / n}
        rows.append({"kind": "decode", "mode": mode, "context": c, "batch": b, "ms_per_layer": ms, **serial,
                     "step_ms": times.get("graph_ms"), "host_ms_per_step": host_ms,
                     "head_ms_per_step": times.get("head_ms"),
                     "preamble_ms_per_step": times.get("preamble_ms"),
                     "eager_ms_per_layer": times["eager_ms"] / n,
                     "replay_ms_per_layer": times["replay_ms"] / n if "replay_ms" in times else None,
                     "tok_s_43_layers": b / (ms * 43 / 1e3), "tpot_43_layers_ms": ms * 43,
                     "bytes_per_layer": decode_bytes_per_layer(model, b, c),
                     "floor_ms_b1": floor_bytes / bw * 1e3 if bw else None})
        print(rows[-1], flush=True)
    for length, mode in ((length, mode) for length in args.prefill for mode in args.modes):
        use_op_table(model, tables[mode])
        ms = prefill_ms(model, length, args.device, args.chunk) / n
        rows.append({"kind": "prefill", "mode": mode, "tokens": length, "chunk": args.chunk, "ms_per_layer": ms,
                     "ttft_43_layers_ms": ms * 43, "flops_per_layer": prefill_flops(model.cfg, length)})
        print(rows[-1], flush=True)
    if args.hf and args.device == "cuda":
        del model
        torch.cuda.empty_cache()
        rows += hf_peer(native, n, [b for b in args.batches if b <= 32], min(args.contexts),
                        [p for p in args.prefill if p <= 4096])
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "layers": n, "first_layer": args.first_layer,
            "tiny": args.tiny,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "copy_bytes_per_s": bw, "bf16_gemm_flops_per_s": gemm,
            "weight_bytes_per_layer_b1": floor_bytes, "torch": torch.__version__}
    if args.hf:
        import transformers

        meta["hf_transformers"] = transformers.__version__
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "layer_sweep_tiny" if args.tiny else "layer_sweep" if args.modes == ["default"] else "layer_sweep_modes"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
