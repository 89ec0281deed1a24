"""The whole model on the GPU (FP8/FP4 weights as stored, Triton kernels, bf16 activations) against the CPU
reference path (same checkpoint, dequantized, fp32).

Metric: teacher-forced logits over a 300-token sequence (prefill chunks + single-token decode steps, so CSA
and HCA windows close in both modes), compared with the fp32 CPU reference. The bar is the CPU reference's
own bf16 run on the same checkpoint: the GPU path may be no further from fp32 than bf16 itself is
(relative L2 error <= 1.25x the bf16 reference's + 0.01, top-1 agreement >= the bf16 reference's - 0.03).
Why relative to bf16: a random model amplifies bf16 rounding (measured on this checkpoint: the CPU bf16
reference is 0.17 relative L2 from fp32, 87% top-1 agreement), so a fixed absolute bar would either fail on
correct kernels or pass broken ones. Bitwise equality is not expected across devices (determinism.md §0).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv.spec import build_layout
from deepinfer.runner.sequences import SequenceCache
from tests.gpu.conftest import rel_err

NATIVE = {
    "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 32, "q_lora_rank": 128, "o_groups": 2,
    "o_lora_rank": 128, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 128, "num_hash_layers": 1, "compress_ratios": [0, 4, 128, 4, 0],
    "index_n_heads": 4, "index_head_dim": 64, "index_topk": 8, "sliding_window": 128,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "scale_fmt": "ue8m0"},
    "expert_dtype": "fp4",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from deepinfer.testing.make_checkpoint import write_random_checkpoint

    path = tmp_path_factory.mktemp("dev")
    write_random_checkpoint(path, NATIVE, seed=3)
    return path


def _teacher_forced(model, ids: torch.Tensor, dtype, device) -> torch.Tensor:
    cache = SequenceCache(build_layout(model.cfg, 128), 6, dtype, device)
    sid, out, pos = cache.new_sequence(), [], 0
    for n in [100, 57, 120] + [1] * 23:
        toks = ids[pos : pos + n].tolist()
        t, batch = cache.plan({sid: toks})
        out.append(model.logits(model(t.to(device), batch, cache.storage)).float().cpu())
        cache.commit({sid: toks})
        pos += n
    return torch.cat(out)


def test_gpu_model_matches_cpu_reference(ckpt, device) -> None:
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.model.loader import load_model
    from deepinfer.ops.table import triton_ops

    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(1))
    ref = _teacher_forced(load_model(ckpt, dtype=torch.float32, progress=False), ids, torch.float32, "cpu")
    bf16 = _teacher_forced(load_model(ckpt, dtype=torch.bfloat16, progress=False), ids, torch.bfloat16, "cpu")
    gpu = load_model(ckpt, dtype=torch.bfloat16, device="cuda", progress=False, ops=triton_ops())
    got = _teacher_forced(gpu, ids, torch.bfloat16, "cuda")
    assert torch.isfinite(got).all()

    def agree(a, b):
        return (a.argmax(-1) == b.argmax(-1)).float().mean().item()

    err, bar = rel_err(got, ref), rel_err(bf16, ref)
    print(f"vs fp32 CPU reference: GPU rel_err {err:.3e} top-1 {agree(got, ref):.4f}; "
          f"CPU bf16 reference rel_err {bar:.3e} top-1 {agree(bf16, ref):.4f}")
    assert err <= 1.25 * bar + 0.01
    assert agree(got, ref) >= agree(bf16, ref) - 0.03


def test_gpu_engine_generates_like_its_model(ckpt, device) -> None:
    """The engine on CUDA (kernels + paged cache + scheduler) reproduces a direct greedy decode of the model."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer import LLMEngine, SamplingParams
    from deepinfer.assets import demo_model_dir

    engine = LLMEngine.from_engine_args(model=str(ckpt), tokenizer=str(demo_model_dir()), device="cuda",
                                        block_size=128, cache_memory_gb=1.0, load_progress=False)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 140)]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": ids}, p)
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = list(o.outputs[0].token_ids)
    model = engine.model
    for i, ids in enumerate(prompts):
        cache = SequenceCache(build_layout(model.cfg, 128), 4, torch.bfloat16, "cuda")
        sid, seq, toks = cache.new_sequence(), [], list(ids)
        for _ in range(12):
            t, batch = cache.plan({sid: toks})
            nxt = int(model.logits(model(t.cuda(), batch, cache.storage))[-1].argmax())
            cache.commit({sid: toks})
            seq.append(nxt)
            toks = [nxt]
        assert finals[f"g{i}"] == seq


@pytest.mark.parametrize("q", [1, 3])
def test_decode_graphs_replay_the_eager_step_bit_for_bit(ckpt, device, q) -> None:
    """A captured decode step (batch padded to its bucket, entry columns sized for max_model_len) gives the
    same logits bits as the eager batched step on the same cache state, for 1..3 sequences of q tokens
    each (q > 1: what verifying q - 1 drafts runs)."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.model.loader import load_model
    from deepinfer.ops.table import triton_ops
    from deepinfer.runner.cuda_graphs import DecodeGraphs

    model = load_model(ckpt, dtype=torch.bfloat16, device="cuda", progress=False, ops=triton_ops())
    cache = SequenceCache(build_layout(model.cfg, 128), 12, torch.bfloat16, "cuda")
    graphs = DecodeGraphs(model, cache.storage, max_model_len=1024, sizes=[1, 2, 4], tokens_per_seq=q)
    graphs.capture()
    g = torch.Generator().manual_seed(5)
    sids = [cache.new_sequence() for _ in range(3)]
    for sid, n in zip(sids, (140, 5, 251)):
        toks = torch.randint(3, 512, (n,), generator=g).tolist()
        t, batch = cache.plan({sid: toks})
        model(t.cuda(), batch, cache.storage)
        cache.commit({sid: toks})
    for step in range(12):
        live = sids[: 1 + step % 3]
        new = {sid: torch.randint(3, 512, (q,), generator=g).tolist() for sid in live}
        t, batch = cache.plan(new)
        eager = model.logits(model(t.cuda(), batch, cache.storage)).float()
        replay = graphs.run(t.tolist(), batch).float()  # rewrites the same cache rows with the same bits
        assert torch.isfinite(replay).all()
        assert torch.equal(eager, replay), (step, (eager - replay).abs().max())
        cache.commit(new)


def test_cache_sized_from_a_profiling_run(ckpt, device) -> None:
    """Without an explicit budget the cache takes utilization x total minus what is resident and the
    profiled activation peak; the engine then serves with decode graphs from the remaining headroom."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer import LLMEngine, SamplingParams
    from deepinfer.assets import demo_model_dir

    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    engine = LLMEngine.from_engine_args(model=str(ckpt), tokenizer=str(demo_model_dir()), device="cuda",
                                        block_size=128, gpu_memory_utilization=0.25, max_num_seqs=8,
                                        load_progress=False)
    cache_bytes = sum(t.numel() * t.element_size() for t in engine.storage.tensors.values())
    used_before = total - free0
    assert 0.5 * (0.25 * total - used_before) < cache_bytes <= 0.25 * total - used_before
    engine.add_request("r", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs[0].token_ids) == 5
    del engine
    torch.cuda.empty_cache()


def test_overlapped_branches_give_the_serial_bits(ckpt, device) -> None:
    """Each layer's independent chains on two streams (model/branches.py: compressors beside the query path,
    the shared expert beside the routed experts) give exactly the logits of the one-stream order, in prefill
    chunks and in decode steps."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.model.loader import load_model
    from deepinfer.ops.table import triton_ops

    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(2))
    out = {}
    for overlap in (False, True):
        model = load_model(ckpt, dtype=torch.bfloat16, device="cuda", progress=False, ops=triton_ops(),
                           overlap=overlap)
        assert model.layers[1].attn.branches.enabled == overlap and model.layers[1].ffn.branches.enabled == overlap
        out[overlap] = _teacher_forced(model, ids, torch.bfloat16, "cuda")
        del model
    assert torch.isfinite(out[True]).all()
    assert torch.equal(out[True], out[False])


def test_fp8_split_k_on_two_streams_at_once(device) -> None:
    """Split-K FP8 GEMVs running concurrently on two streams (each in its own lane, as model/branches.py sets
    them) keep their tile counters apart: every result equals the one-stream result."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.model.quant import quant_fp8_block, ue8m0_to_float
    from deepinfer.ops import lanes
    from deepinfer.ops.triton.fp8_linear import fp8_linear

    g = torch.Generator().manual_seed(0)
    q, s = quant_fp8_block(torch.randn(2048, 4096, generator=g) * 0.05, (128, 128))
    w, sc = q.cuda(), ue8m0_to_float(s).float().cuda()
    xs = [torch.randn(1, 4096, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
    want = [fp8_linear(x, w, sc) for x in xs]
    side = torch.cuda.Stream()
    for _ in range(50):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), lanes.lane(1):
            got_side = fp8_linear(xs[1], w, sc)
        got_main = fp8_linear(xs[0], w, sc)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got_main, want[0]) and torch.equal(got_side, want[1])


def test_quantized_first_load_equals_load_then_transform(ckpt, device) -> None:
    """The engine's load (empty FP8/FP4 modules in the Triton layout, filled tensor by tensor, each expert laid
    out on its own) holds the same bits as transforming a model loaded with its quantized weights kept."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.model.device import prepare_for_device
    from deepinfer.model.loader import load_model
    from deepinfer.ops.table import triton_ops

    ops = triton_ops()
    old = prepare_for_device(load_model(ckpt, dtype=torch.bfloat16, device="cuda", progress=False,
                                        keep_quantized=True), ops)
    new = load_model(ckpt, dtype=torch.bfloat16, device="cuda", progress=False, ops=ops)
    want = {**dict(old.named_parameters()), **dict(old.named_buffers())}
    got = {**dict(new.named_parameters()), **dict(new.named_buffers())}
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert t.dtype == got[name].dtype and t.shape == got[name].shape, name
        assert torch.equal(t.contiguous().view(torch.uint8), got[name].contiguous().view(torch.uint8)), name
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_teacher_forced(old, ids, torch.bfloat16, "cuda"), _teacher_forced(new, ids, torch.bfloat16, "cuda"))
