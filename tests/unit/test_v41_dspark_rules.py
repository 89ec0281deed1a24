"""DSpark without the oracle: its config fields and their errors, loading ``mtp.*`` (formats, both spellings,
the loader's checks), the verification rule and verify length (model/v41/speculative.py), the context's
rollback, and greedy speculative decoding giving exactly the plain greedy tokens."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.v41 import V41Config
from deepinfer.model.ckpt_files import CheckpointError
from deepinfer.model.v41.dspark import DraftBlock
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.model.v41.speculative import Acceptance, accept, speculative_greedy, verify_length
from deepinfer.sched.draft_length import MIN_REACH
from deepinfer.testing.v41_checkpoint import write_v41_checkpoint
from tests.oracle.v41 import checkpoint_config, tiny_text_config, tiny_tokenizer

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
         "expert_dtype": "fp4"}
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _text(**kw) -> dict:
    return tiny_text_config(tiny_tokenizer(512), **kw)


# ---- config ------------------------------------------------------------------------------------------------

def test_flash_dspark_defaults():
    d = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": {}}).dspark
    assert (d.block_size, d.noise_token_id, d.target_layer_ids, d.markov_rank) == (5, 128799, (37, 38, 39), 256)
    assert (d.n_routed_experts, d.num_experts_per_tok, d.confidence_input) == (128, 3, "hidden")


@pytest.mark.parametrize("change, field", [
    (dict(dspark_target_layer_ids=[9, 8, 7]), "text_config.dspark_target_layer_ids"),
    (dict(dspark_target_layer_ids=[]), "text_config.dspark_target_layer_ids"),
    (dict(dspark_num_experts_per_tok=5), "text_config.dspark_num_experts_per_tok"),
    (dict(dspark_confidence_input="raw"), "text_config.dspark_confidence_input"),
    (dict(dspark_block_size=0), "text_config.dspark_block_size"),
    (dict(dspark_markov_rank=0), "text_config.dspark_markov_rank"),
])
def test_bad_dspark_fields_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        V41Config.from_dict(checkpoint_config({**_text(), **change}))


@pytest.mark.parametrize("change, field", [
    (dict(num_hidden_layers=8, compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1], kv_source_layer_ids=[1, 3],
          index_source_layer_ids=[1, 3, 5, 7], candidate_source_layer_id=3, engram_layer_ids=[],
          engram_num_embeddings=[]), "dspark_target_layer_ids"),  # a truncated backbone without tap 9
    (dict(dspark_noise_token_id=512), "dspark_noise_token_id"),
    (dict(num_nextn_predict_layers=0), "num_nextn_predict_layers"),
])
def test_a_drafter_the_config_cannot_have_is_refused(change, field):
    cfg = V41Config.from_dict(checkpoint_config({**_text(), **change}))
    DeepseekV41(cfg, torch.float32, tokenizer=tiny_tokenizer(512), shapes_only=True)  # the text model is fine
    with pytest.raises(ValueError, match=f"^{field}"):
        DeepseekV41(cfg, torch.float32, tokenizer=tiny_tokenizer(512), dspark=True)


# ---- a random model with its drafter, through a quantized checkpoint ----------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tok = tiny_tokenizer(512)
    conf = checkpoint_config(tiny_text_config(tok))
    conf["text_config"]["quantization_config"] = QUANT
    shapes = DeepseekV41(V41Config.from_dict(conf), torch.float32, shapes_only=True, dspark=True)
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(v.shape, generator=g) * 0.15 + (1.0 if k.endswith("norm.weight") else 0.0)
               for k, v in shapes.state_dict().items()}
    out = tmp_path_factory.mktemp("small")
    want = write_v41_checkpoint(out, conf, weights, tok)
    model, ignored = load_v41_model(out, torch.float32, dspark=True)
    return dict(conf=conf, weights=weights, tok=tok, want=want, model=model, ignored=ignored, dir=out)


def test_drafter_tensors_round_trip_in_the_released_formats(small, tmp_path):
    model, want = small["model"], small["want"]
    assert small["ignored"] == () and any(k.startswith("mtp.2.markov_head") for k in want)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    from safetensors import safe_open
    with safe_open(str(small["dir"] / "model.safetensors"), "pt") as f:
        assert f.get_tensor("mtp.0.main_proj.weight").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor("mtp.0.main_proj.scale").shape) == (2, 6)  # [64, 192] in 32x32 blocks
        assert f.get_tensor("mtp.1.attn.wkv.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("mtp.2.ffn.experts.3.w2.weight").dtype == torch.int8
        assert f.get_tensor("mtp.2.confidence_head.proj.weight").dtype == torch.float32
    # Without the drafter the same directory loads the text model and lists what it skipped.
    text_only, ignored = load_v41_model(small["dir"], torch.float32)
    assert text_only.mtp is None and ignored and all(n.startswith("mtp.") for n in ignored)
    assert "mtp.0.main_proj.scale" in ignored
    # Hugging Face spelling (NeMo's DSpark names: mtp.S.attn_hc.fn, ...sinks_param.weight, ...gate_proj).
    write_v41_checkpoint(tmp_path, small["conf"], small["weights"], small["tok"], names="hf")
    from_hf, _ = load_v41_model(tmp_path, torch.float32, dspark=True)
    assert all(torch.equal(from_hf.state_dict()[k], v) for k, v in want.items())


def _broken(tmp_path, small, edit):
    write_v41_checkpoint(tmp_path, small["conf"], small["weights"], small["tok"])
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("mtp.2.markov_head.head.weight"), "missing 1 tensor.*mtp.2.markov_head.head.weight"),
    (lambda t: t.pop("mtp.0.main_proj.scale"), "without its scale tensor mtp.0.main_proj.scale"),
    (lambda t: t.update({"mtp.1.ffn.experts.0.w1.weight": torch.zeros(32, 64)}),
     "mtp.1.ffn.experts.0.w1.weight.*dtype torch.float32 not allowed"),
    (lambda t: t.update({"mtp.2.confidence_head.proj.weight": torch.zeros(1, 64)}), "expected shape"),
    (lambda t: t.update({"mtp.0.main_norm.weight": torch.full((64,), float("inf"))}), "NaN or infinite"),
])
def test_loader_checks_the_drafter_tensors(small, tmp_path, edit, message):
    _broken(tmp_path, small, edit)
    load_v41_model(tmp_path, torch.float32)  # skipped, so not checked, without the drafter
    with pytest.raises(CheckpointError, match=message):
        load_v41_model(tmp_path, torch.float32, dspark=True)


def test_propose_needs_the_drafter_and_a_context(small):
    model = small["model"]
    with pytest.raises(ValueError, match="^cache: no DSpark context"):
        model.propose(3, model.new_cache())
    with pytest.raises(ValueError, match="^token"):
        cache = model.new_cache()
        model(torch.tensor([3, 4]), cache)
        model.propose(512, cache)
    text_only = DeepseekV41(model.cfg, torch.float32, tokenizer=small["tok"])
    with pytest.raises(ValueError, match="^dspark: this model was built without"):
        text_only.propose(3, text_only.new_cache())


# ---- verification --------------------------------------------------------------------------------------------

def test_accept_is_the_longest_matching_prefix_plus_the_targets_token():
    assert accept([5, 6, 7], torch.tensor([5, 6, 7, 8])) == Acceptance(3, (5, 6, 7, 8))
    assert accept([5, 6, 7], torch.tensor([5, 9, 7, 8])) == Acceptance(1, (5, 9))
    assert accept([5, 6, 7], torch.tensor([4, 6, 7, 8])) == Acceptance(0, (4,))
    assert accept([], torch.tensor([4])) == Acceptance(0, (4,))
    g = torch.Generator().manual_seed(1)
    for _ in range(200):  # against the rule written out, on a 3-token vocabulary so that prefixes match
        n = int(torch.randint(0, 6, (1,), generator=g))
        drafts, draws = torch.randint(0, 3, (n,), generator=g).tolist(), torch.randint(0, 3, (n + 1,), generator=g)
        a = next((i for i in range(n) if drafts[i] != int(draws[i])), n)
        assert accept(drafts, draws) == Acceptance(a, tuple(draws[:a + 1].tolist()))
    with pytest.raises(ValueError, match="^draws"):
        accept([1, 2], torch.tensor([1, 2]))


def test_verify_length_fixed_and_confidence_aware():
    conf = torch.tensor([0.9, 0.8, 0.5, 0.9, 0.9])  # survival .9 .72 .36 .324 .2916
    assert MIN_REACH == 0.3
    assert [verify_length(conf, k, varlen=False) for k in (1, 3, 5)] == [1, 3, 5]
    assert verify_length(conf, 5, varlen=True) == 4
    assert verify_length(conf, 2, varlen=True) == 2
    assert verify_length(torch.full((5,), 0.2), 5, varlen=True) == 0
    assert verify_length(torch.ones(5), 5, varlen=True) == 5
    for bad in (0, 6, True, 2.0):
        with pytest.raises(ValueError, match="^num_speculative_tokens"):
            verify_length(conf, bad, varlen=False)


# ---- drafting, rollback and the reference loop ----------------------------------------------------------------

def test_sampled_drafts_follow_the_given_noise_through_the_markov_head(small):
    model = small["model"]
    cache = model.new_cache()
    model(torch.arange(3, 30), cache)
    greedy = model.propose(11, cache)
    zero = model.propose(11, cache, temperature=1.0, noise=torch.zeros(5, 512, dtype=torch.float64))
    assert torch.equal(zero.tokens, greedy.tokens) and torch.equal(zero.logits, greedy.logits)
    noise = torch.zeros(5, 512, dtype=torch.float64)
    forced = int(greedy.tokens[1] + 1) % 512
    noise[1, forced] = 1e9
    steered = model.propose(11, cache, temperature=0.7, noise=noise)
    assert int(steered.tokens[1]) == forced and torch.equal(steered.logits[:2], greedy.logits[:2])
    assert not torch.equal(steered.logits[2], greedy.logits[2])  # row 2's Markov bias follows the new draft
    with pytest.raises(ValueError, match="^noise"):
        model.propose(11, cache, noise=noise)


def test_rolled_back_context_drafts_as_a_fresh_prefill(small):
    model, prompt = small["model"], torch.arange(40, 80)
    cache = model.new_cache()
    model(prompt, cache)
    model(torch.tensor([7, 8, 9, 10]), cache)  # a verify step whose drafts are all rejected after the first
    cache.truncate(42, model.cfg.compress_ratios)
    rolled = model.propose(5, cache)
    fresh_cache = model.new_cache()
    model(torch.cat((prompt, torch.tensor([7, 8]))), fresh_cache)
    fresh = model.propose(5, fresh_cache)
    assert torch.equal(rolled.tokens, fresh.tokens)
    assert (rolled.logits - fresh.logits).abs().max().item() <= TOL  # GEMM shapes differ: fp32 rounding only
    assert (rolled.confidence_logits - fresh.confidence_logits).abs().max().item() <= TOL


@pytest.mark.parametrize("varlen", [False, True])
def test_speculative_greedy_is_plain_greedy(small, varlen):
    model, prompt = small["model"], torch.arange(100, 130)
    plain = model.greedy(prompt, 16)
    run = speculative_greedy(model, prompt, 16, 5, varlen)
    assert run.tokens == plain and len(run.verified) == len(run.accepted)
    if not varlen:
        assert all(n == min(5, 16 - done) for n, done in zip(run.verified, _emitted_before(run)))


def _emitted_before(run) -> list[int]:
    done, out = 1, []
    for a in run.accepted:
        out.append(done)
        done += a + 1
    return out


def test_speculative_greedy_with_good_drafts_accepts_and_rolls_back(small, monkeypatch):
    """Drafts from the plain continuation, one of them spoiled in some blocks: whole blocks, partial blocks and
    rejections are all taken, and the tokens stay the plain ones."""
    model, prompt = small["model"], torch.arange(200, 230)
    plain = model.greedy(prompt, 24)
    real = model.propose
    calls = []

    def propose(token, cache, **kw):
        block = real(token, cache, **kw)
        done = cache.length - prompt.numel() + 1  # tokens emitted so far
        good = torch.tensor((plain + [0] * 8)[done:done + 5])
        spoil = (0, None, 2, None, 4)[len(calls) % 5]
        if spoil is not None:
            good[spoil] = (good[spoil] + 1) % 512
        calls.append(spoil)
        return DraftBlock(good, block.logits, block.confidence_logits, block.first_position)

    monkeypatch.setattr(model, "propose", propose)
    run = speculative_greedy(model, prompt, 24, 5)
    assert run.tokens == plain
    assert {0, 2, 5} <= set(run.accepted) and len(run.accepted) < 12
