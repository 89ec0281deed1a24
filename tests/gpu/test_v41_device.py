"""DeepSeek-V4.1 on the device: the engine's greedy tokens equal the plain ``DeepseekV41``'s on the same device.

Tiny random V4.1 checkpoints (``tests/e2e/v41_tiny.py``) built quantized-first on the device
(``model/v41/device.py``: FP4 experts as ``FusedFP4Experts`` run by the op table's ``moe_experts_fp4``, dense FP8 as
``FP8Dense32`` run by its ``fp8_linear_b32``). The plain model is built the same way (the same modules and kernels)
and runs each prompt alone through its own per-sequence cache; the engine runs them batched, prefill chunked
differently per sequence, in a cache too small for all of them (preemption and recomputation), through the paged
step (``model/v41/paged.py``).

  * float32: every sequence's tokens identical, and after a prefix-cache hit.
  * bfloat16 (released cache formats): batching and chunking change the GEMMs' and the attention's shapes
    and hence their roundings, which a random tiny model's near-ties turn into other tokens. Compared against
    the float32 model as the oracle: the engine's tokens score as well as the plain bfloat16 model's own greedy
    tokens (a wrong step scores like random tokens).
  * the step's forward launches without a host sync (``torch.cuda.set_sync_debug_mode("error")``): the step's
    per-sequence layout comes from the runner's host values (``StepIndex.host``), not from the device.
  * the fused experts against the plain per-expert loop on the same FP4 weights (float32, a stated bound).
  * the Engram tables held as their FP8 codes: every row the gather kernel reads equals the plain loader's
    dequantized table row bit for bit, and the hash kernel's rows the plain hasher's.
  * without a cache size the engine sizes its cache from ``gpu_memory_utilization`` (the largest step profiled)
    and generates the plain model's tokens.

With ``TRITON_INTERPRET=1`` the float32 engine test and the experts test run on the CPU (the engine's CPU run
given the device build, with the reference op table), on fewer prompts.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine
from deepinfer.config.v41 import V41Config
from deepinfer.model.v41 import paged
from deepinfer.model.v41.device import load_v41_on_device
from deepinfer.model.v41.loader import load_tokenizer, load_v41_model
from deepinfer.model.v41.moe import MoE
from deepinfer.testing.staggered import drain
from tests.e2e.test_v41_engine import CONFIGS, GREEDY, MAX_TOKENS, _prompts
from tests.e2e.v41_tiny import write_tiny_v41
from tests.gpu.conftest import INTERPRET, rel_err

def _ops(device: str):
    """The device's table; under the interpreter the reference one (the device build and the paged step are
    what is checked there: Triton's interpreter does not run the FP4 expert kernel, as
    tests/gpu/test_moe_kernels.py shows under it)."""
    from deepinfer.ops.table import REF, select

    return select("cuda") if device == "cuda" else REF


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41dev"), seed=len("flash_like"), **CONFIGS["flash_like"])


def _plain(path, device: str, dtype: torch.dtype, cache_qdq: bool = False):
    return load_v41_on_device(path, V41Config.from_model_dir(path), dtype, device, _ops(device),
                              tokenizer=load_tokenizer(path), cache_qdq=cache_qdq)


def _engine(path, device: str, monkeypatch, **kw) -> LLMEngine:
    if device == "cpu":  # the interpreter: the CPU engine given the device build (the engine passes ops on cuda)
        build, ops = paged.load_paged_v41, _ops(device)
        monkeypatch.setattr(paged, "load_paged_v41", lambda *a, **k: build(*a, **{**k, "ops": ops}))
    args = dict(model=str(path), device=device, dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512, num_cache_blocks=16,
                enforce_eager=True, load_progress=False)
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


@pytest.mark.interpret_ok
def test_engine_equals_plain_model_float32(checkpoint, device, monkeypatch) -> None:
    plain = _plain(checkpoint, device, torch.float32)
    # Quantized-first: no dequantized expert, the dense FP8 projections as their codes.
    assert not any(".experts." in n for n in plain.state_dict())
    assert plain.layers[0].ffn.routed.w13.dtype != torch.float32
    assert plain.layers[0].attn.wq_b.weight_fp8.dtype == torch.float8_e4m3fn
    prompts = _prompts(5)
    if INTERPRET:
        prompts = [prompts[i] for i in (1, 4, 8, 10)]  # 3, 30, 128, 150 tokens
    rng = random.Random(7)
    # 4 history blocks of 128 positions for sequences of up to 212: preemption and recomputation (on cuda).
    engine = _engine(checkpoint, device, monkeypatch, max_num_batched_tokens=rng.choice([13, 29, 41]),
                     num_cache_blocks=4)
    where = torch.device(device).type
    assert all(t.device.type == where for t in [*engine.model.parameters(), *engine.model.buffers()])
    assert all(t.device.type == where for t in engine.storage.tensors.values())
    arrivals: dict[int, list] = {}
    for i in rng.sample(range(len(prompts)), len(prompts)):
        arrivals.setdefault(rng.randrange(4), []).append((f"r{i}", prompts[i]))
    got = drain(engine, arrivals, GREEDY, check_integrity=True)
    if not INTERPRET:
        assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    for i, ids in enumerate(prompts):
        want = plain.greedy(torch.tensor(ids, device=device), MAX_TOKENS)
        assert got[f"r{i}"] == want, f"prompt {i} ({len(ids)} tokens)"


@pytest.mark.interpret_ok
def test_prefix_hit_on_device_equals_plain_model(checkpoint, device, monkeypatch) -> None:
    """A prefix-cache hit at a block boundary (exact for V4.1) on the device, float32."""
    plain = _plain(checkpoint, device, torch.float32)
    engine = _engine(checkpoint, device, monkeypatch, enable_prefix_caching=True)
    rng = random.Random(3)
    shared = [rng.randrange(3, 4096) for _ in range(270)]
    prompts = {"a": shared + [rng.randrange(3, 4096) for _ in range(5)],
               "b": shared[:260] + [rng.randrange(3, 4096) for _ in range(9)]}
    outs = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[rid] = out
    assert (outs["a"].num_cached_tokens, outs["b"].num_cached_tokens) == (0, 256)
    for rid, ids in prompts.items():
        want = plain.greedy(torch.tensor(ids, device=device), MAX_TOKENS)
        assert list(outs[rid].outputs[0].token_ids) == want, rid


@pytest.mark.interpret_ok
def test_engine_bfloat16_tokens_fare_as_the_plain_bfloat16_models(checkpoint, device, monkeypatch) -> None:
    """bfloat16 with the released cache formats (``kv_cache_dtype="auto"``), batched, chunked, preempted. Exact
    tokens are not expected: the step's shapes change the GEMMs' and the attention's roundings, and a tiny random
    model's logits are full of near-ties. The oracle is the same model in float32: fed a prompt and a
    continuation, it scores each token by its gap to its best logit (a share of the row's logit spread). The
    engine is the plain bfloat16 model batched, so its tokens must score as well as that model's own greedy
    tokens: a mean gap within 1.25x + 0.01 of theirs and a share of exact-top tokens within 0.1 of theirs (about
    three standard errors at ~140 tokens). A wrong step scores like random tokens (mean gap near 0.5)."""
    oracle = _plain(checkpoint, device, torch.float32, cache_qdq=True)
    plain = _plain(checkpoint, device, torch.bfloat16, cache_qdq=True)
    prompts = _prompts(6)
    if INTERPRET:
        prompts = [prompts[i] for i in (1, 4, 8, 10)]
    rng = random.Random(11)
    engine = _engine(checkpoint, device, monkeypatch, dtype="bfloat16", kv_cache_dtype="auto",
                     max_num_batched_tokens=rng.choice([13, 29, 41]), num_cache_blocks=4)
    arrivals: dict[int, list] = {}
    for i in rng.sample(range(len(prompts)), len(prompts)):
        arrivals.setdefault(rng.randrange(4), []).append((f"r{i}", prompts[i]))
    got = drain(engine, arrivals, GREEDY, check_integrity=True)

    def gaps(ids: list[int], tokens: list[int]) -> list[float]:
        logits = oracle(torch.tensor(ids + tokens[:-1], device=device), oracle.new_cache())[len(ids) - 1:].float()
        best, spread = logits.max(-1).values, logits.max(-1).values - logits.min(-1).values
        return ((best - logits.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]) / spread).tolist()

    engine_gaps, own_gaps = [], []
    for i, ids in enumerate(prompts):
        assert len(got[f"r{i}"]) == MAX_TOKENS
        engine_gaps += gaps(ids, got[f"r{i}"])
        own_gaps += gaps(ids, plain.greedy(torch.tensor(ids, device=device), MAX_TOKENS))

    def mean(g: list[float]) -> float:
        return sum(g) / len(g)

    def top(g: list[float]) -> float:
        return sum(x == 0 for x in g) / len(g)

    assert mean(engine_gaps) <= 1.25 * mean(own_gaps) + 0.01, (mean(engine_gaps), mean(own_gaps))
    assert top(engine_gaps) >= top(own_gaps) - 0.1, (top(engine_gaps), top(own_gaps))


def test_step_forward_has_no_host_sync(checkpoint, device, monkeypatch) -> None:
    """Prefill chunks, decode steps and preemption, every forward under sync-debug mode "error"."""
    if device != "cuda":
        pytest.skip("sync-debug mode is CUDA's")
    forward = paged.PagedV41.forward

    def strict(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(paged.PagedV41, "forward", strict)
    engine = _engine(checkpoint, device, monkeypatch, max_num_batched_tokens=29, num_cache_blocks=4)
    prompts = _prompts(5)
    got = drain(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts[:6])]}, GREEDY)
    assert len(got) == 6


def test_engine_sized_from_gpu_memory_utilization_starts_and_generates(checkpoint, device, monkeypatch) -> None:
    """No num_cache_blocks / cache_memory_gb: the cache is what ``gpu_memory_utilization`` leaves after what is
    resident and the profiled peak of the largest step (``engine/profile_v41.py``); the engine then runs as one
    sized by hand (float32 tokens equal the plain model's). The utilization leaves ~4 GiB above what the device
    holds now, so the test does not take the device."""
    if device != "cuda":
        pytest.skip("the profile reads CUDA's allocator (tests/unit/test_v41_sizing.py runs its step on the CPU)")
    from deepinfer.engine import sizing

    peaks = []
    profile = sizing.profile_activation_bytes

    def recorded(*args):
        peaks.append(profile(*args))
        return peaks[-1]

    monkeypatch.setattr(sizing, "profile_activation_bytes", recorded)
    free, total = torch.cuda.mem_get_info()
    utilization = min(0.9, (total - free + (4 << 30)) / total)
    engine = _engine(checkpoint, device, monkeypatch, num_cache_blocks=None, gpu_memory_utilization=utilization)
    assert len(peaks) == 1 and peaks[0] > 0
    assert engine.facts.num_blocks["history"] >= 8  # every prompt fits at once (no preemption needed)
    prompts = _prompts(5)[:6]
    got = drain(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}, GREEDY)
    plain = _plain(checkpoint, device, torch.float32)
    for i, ids in enumerate(prompts):
        assert got[f"r{i}"] == plain.greedy(torch.tensor(ids, device=device), MAX_TOKENS), f"prompt {i}"


@pytest.mark.interpret_ok
def test_fused_experts_match_the_expert_loop(checkpoint, device, monkeypatch) -> None:
    """The V4.1 MoE with its experts fused (FP4 codes, the op table's kernel) against the plain per-expert loop
    on the same dequantized weights, float32: within 1e-4 relative (summation order, and on CUDA the kernel's
    three-part bf16 split of fp32 activations)."""
    fused = _plain(checkpoint, device, torch.float32)
    loop, _ = load_v41_model(checkpoint, torch.float32, cache_qdq=False)
    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    x = torch.randn(37, fused.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(37, dtype=torch.bool)
    for i, (a, b) in enumerate(zip(fused.layers, loop.layers)):
        assert isinstance(a.ffn, MoE) and a.ffn.routed is not None
        got = a.ffn(x.to(device), mask.to(device)).cpu()
        want = b.ffn.to("cpu")(x, mask)
        assert rel_err(got, want) < 1e-4, f"layer {i}: {rel_err(got, want)}"


@pytest.mark.interpret_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_tables_held_as_codes_give_the_plain_rows(checkpoint, device, dtype) -> None:
    """The device build holds its Engram tables as their FP8 codes (``FP8Table``, gathered by the table's
    ``v41_engram_gather``): every row gathered on the device equals the plain CPU model's dequantized table bit for
    bit, and the device's hash gives the plain hasher's rows."""
    from deepinfer.model.v41.engram_table import FP8Table

    built = _plain(checkpoint, device, dtype)
    plain, _ = load_v41_model(checkpoint, dtype, cache_qdq=False)
    ids = torch.randint(0, plain.hasher.token_map.numel(), (300,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(built.hasher(ids.to(device), 0).cpu(), plain.hasher(ids, 0))
    assert plain.cfg.active_engram_layers
    for layer in plain.cfg.active_engram_layers:
        table = built.layers[layer].engram.embed
        assert isinstance(table, FP8Table) and table.weight_fp8.dtype == torch.float8_e4m3fn
        every = torch.arange(table.weight_fp8.shape[0], device=device).unsqueeze(-1)  # one row a "token"
        assert torch.equal(table.gather(every, dtype).cpu(), plain.layers[layer].engram.embed.weight.data)
