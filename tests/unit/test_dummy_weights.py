"""``load_format="dummy"`` (random weights in the native formats from config.json alone) and ``hf_overrides``."""

from __future__ import annotations

import shutil

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.cli import _engine_args, build_parser
from deepinfer.config import ModelConfig
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.model.device import FP8Linear, FusedFP4Experts, prepare_for_device
from deepinfer.model.loader import load_model
from deepinfer.ops.table import REF
from tests.unit.test_quantized_first import assert_same_model, logits

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """The demo model's config.json and tokenizer, without its weights."""
    out = tmp_path_factory.mktemp("config_only")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir() / name, out / name)
    return out


def test_dummy_engine_generates_from_a_config_alone(config_only) -> None:
    from deepinfer import LLM, SamplingParams

    assert not list(config_only.glob("*.safetensors"))
    llm = LLM(model=str(config_only), device="cpu", load_progress=False, block_size=128, num_cache_blocks=8,
              load_format="dummy", seed=7)
    outs = llm.generate(["def fibonacci(n):", "import os"], SamplingParams(**GREEDY), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    want = load_model(None, dtype=torch.float32, cfg=llm.engine.model.cfg, load_format="dummy", seed=7, progress=False)
    assert_same_model(llm.engine.model, want)  # the engine's seed picks the weights
    with pytest.raises(Exception, match="safetensors"):  # without dummy weights there is nothing to load
        LLM(model=str(config_only), device="cpu", load_progress=False, block_size=128)


def test_dummy_weights_are_native_formats_and_a_function_of_the_seed() -> None:
    cfg = ModelConfig.from_model_dir(demo_model_dir())
    a = load_model(None, dtype=torch.float32, cfg=cfg, load_format="dummy", seed=3, keep_quantized=True, progress=False)
    b = load_model(None, dtype=torch.float32, cfg=cfg, load_format="dummy", seed=3, progress=False)
    c = load_model(None, dtype=torch.float32, cfg=cfg, load_format="dummy", seed=4, progress=False)
    assert_same_model(b, a)
    assert not torch.equal(a.layers[1].attn.wq_a.weight, c.layers[1].attn.wq_a.weight)
    formats = {(q.format, q.data.dtype, q.scale.dtype) for q in a.quantized.values()}
    assert formats == {("fp8", torch.float8_e4m3fn, torch.float8_e8m0fnu), ("fp4", torch.int8, torch.float8_e8m0fnu)}
    table = a.layers[0].ffn.gate.tid2eid
    assert int(table.min()) >= 0 and int(table.max()) < cfg.n_routed_experts
    assert bool((table[:, 0] != table[:, 1]).all())  # distinct experts per token
    ids = torch.randint(3, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    out = logits(a, ids)
    assert bool(torch.isfinite(out).all()) and float(out.std()) > 0


def test_dummy_transformed_model_is_the_dummy_reference_transformed() -> None:
    """Dummy weights go through the same weight loaders as a checkpoint: built quantized-first with the REF op
    table they equal the dummy reference model's stored weights put through ``prepare_for_device``."""
    cfg = ModelConfig.from_model_dir(demo_model_dir())
    got = load_model(None, dtype=torch.float32, cfg=cfg, load_format="dummy", seed=1, ops=REF, progress=False)
    want = prepare_for_device(load_model(None, dtype=torch.float32, cfg=cfg, load_format="dummy", seed=1,
                                         keep_quantized=True, progress=False), REF)
    assert_same_model(got, want)
    assert {FP8Linear, FusedFP4Experts} <= {type(m) for m in got.modules()}


def test_hf_overrides_truncate_a_real_checkpoint() -> None:
    from deepinfer import LLM

    llm = LLM(device="cpu", load_progress=False, block_size=128, num_cache_blocks=8, hf_overrides={"num_hidden_layers": 4})
    model = llm.engine.model
    full = load_model(demo_model_dir(), dtype=torch.float32, progress=False)
    assert len(model.layers) == 4 and len(model.mtp) == 1
    assert model.cfg.layer_compress_ratios == full.cfg.layer_compress_ratios[:4]
    state, want = model.state_dict(), full.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in state.items())


@pytest.mark.parametrize("overrides, message", [
    ({"num_hiden_layers": 3}, "hf_overrides: 'num_hiden_layers' is neither a field"),
    ({"num_hidden_layers": 0}, "hf_overrides: num_hidden_layers: must be >= 1"),
    ({"compress_ratios": [0, 3]}, "hf_overrides: compress_ratios: has 2 entries"),
    ([("num_hidden_layers", 2)], "hf_overrides: expected a dict"),
])
def test_bad_overrides_name_the_key(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(EngineArgs(device="cpu", hf_overrides=overrides))


def test_load_format_is_checked_and_the_cli_passes_both_flags() -> None:
    with pytest.raises(ValueError, match="load_format: 'safetensors' is not supported; allowed: auto, dummy"):
        EngineConfig.create(EngineArgs(device="cpu", load_format="safetensors"))
    a = build_parser().parse_args(["generate", "--load-format", "dummy", "--hf-overrides", '{"num_hidden_layers": 2}'])
    args = _engine_args(a)
    assert args.load_format == "dummy" and args.hf_overrides == {"num_hidden_layers": 2}
    config = EngineConfig.create(args)
    assert config.load_format == "dummy" and config.model.num_hidden_layers == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--hf-overrides", "[1, 2]"])
