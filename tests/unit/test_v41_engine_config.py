"""The engine's side of DeepSeek-V4.1 before any weight is read: the ``kv_cache_dtype`` argument (V4 and V4.1),
what the engine refuses for V4.1 so far (each error naming the field and what is allowed), V4.1's cache specs
in the paged pools, the intake's refusal of image ids, and ``deepinfer info`` on a V4.1 checkpoint."""

from __future__ import annotations

import json

import pytest

from deepinfer.cli import main
from deepinfer.config.engine import KV_CACHE_DTYPES, EngineArgs, EngineConfig
from deepinfer.config.model import SWA
from deepinfer.config.v41 import V41Config
from deepinfer.engine.intake import Intake
from deepinfer.kv.block_budget import replay_length, tail_blocks_per_boundary
from deepinfer.kv.spec import HISTORY, STATE, WINDOW
from deepinfer.kv.spec_v41 import CSA2, ENGRAM_KEY, build_v41_layout, dspark_key
from deepinfer.tokenizer import Tokenizer
from deepinfer.assets import demo_model_dir
from tests.oracle.v41 import checkpoint_config, tiny_text_config, tiny_tokenizer


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    """A V4.1 checkpoint directory with its config.json only (enough for everything here)."""
    path = tmp_path_factory.mktemp("v41cfg")
    (path / "config.json").write_text(json.dumps(checkpoint_config(tiny_text_config(tiny_tokenizer(512)))))
    return path


def _config(**kw) -> EngineConfig:
    return EngineConfig.create(EngineArgs(device="cpu", **kw))


def test_kv_cache_dtype_values_for_v4() -> None:
    assert KV_CACHE_DTYPES == ("auto", "bfloat16", "float32")
    assert _config().cache.kv_cache_dtype == "auto" and _config().cache.released_formats
    off = _config(dtype="float32", kv_cache_dtype="float32").cache
    assert off.kv_cache_dtype == "float32" and not off.released_formats


@pytest.mark.parametrize("kw, allowed", [
    ({"kv_cache_dtype": "fp8"}, "allowed: auto, bfloat16, float32"),
    ({"kv_cache_dtype": None}, "allowed: auto, bfloat16, float32"),
    ({"dtype": "float32", "kv_cache_dtype": "bfloat16"}, "allowed with dtype=float32: auto, float32"),
])
def test_bad_kv_cache_dtype_names_the_field_and_allowed_values(kw, allowed) -> None:
    with pytest.raises(ValueError, match=rf"^kv_cache_dtype: .*{allowed}"):
        _config(**kw)


def test_v41_checkpoint_gets_its_config(v41_dir) -> None:
    cfg = _config(model=str(v41_dir), dtype="float32", kv_cache_dtype="float32")
    assert isinstance(cfg.model, V41Config) and not cfg.cache.released_formats
    assert _config(model=str(v41_dir)).cache.released_formats  # auto: the released cache formats


@pytest.mark.parametrize("kw, field", [
    ({"device": "mps"}, "device"),
    ({"device": "cuda"}, "enforce_eager"),
    ({"data_parallel_size": 2, "context_parallel_size": 2}, "context_parallel_size"),
    ({"tensor_parallel_size": 4}, "tensor_parallel_size"),  # the tiny model's o_groups is 2
    ({"data_parallel_size": 2, "nnodes": 2}, "nnodes"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True, "enable_eplb": True}, "enable_eplb"),
    ({"data_parallel_size": 2, "speculative_config": {"method": "dspark", "num_speculative_tokens": 2}},
     "speculative_config"),
    ({"device": "cuda", "enforce_eager": True, "num_cache_blocks": 8, "data_parallel_size": 2}, "device"),
])
def test_what_v41_does_not_support_yet_is_refused(v41_dir, kw, field) -> None:
    args = {"device": "cpu", **kw}
    with pytest.raises(ValueError, match=rf"^{field}: .*(allowed|V4\.1)"):
        EngineConfig.create(EngineArgs(model=str(v41_dir), **args))


def test_v41_on_several_cpu_ranks_is_accepted(v41_dir, monkeypatch) -> None:
    """Data- and tensor-parallel attention, with expert parallelism or without; the batch-invariant mode (a
    forward per token) only without it."""
    for kw in ({"data_parallel_size": 2}, {"data_parallel_size": 2, "enable_expert_parallel": True},
               {"data_parallel_size": 4, "enable_expert_parallel": True}, {"tensor_parallel_size": 2},
               {"tensor_parallel_size": 2, "data_parallel_size": 2, "enable_expert_parallel": True}):
        config = EngineConfig.create(EngineArgs(model=str(v41_dir), device="cpu", **kw))
        assert isinstance(config.model, V41Config) and config.parallel.world_size > 1
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    EngineConfig.create(EngineArgs(model=str(v41_dir), device="cpu", data_parallel_size=2))
    with pytest.raises(ValueError,
                       match=r"^enable_expert_parallel: DEEPINFER_BATCH_INVARIANT=1 .*allowed with it: False"):
        EngineConfig.create(EngineArgs(model=str(v41_dir), device="cpu", data_parallel_size=2,
                                       enable_expert_parallel=True))


def test_v41_on_cuda_refusals_name_what_is_allowed(v41_dir, monkeypatch) -> None:
    """V4.1 on CUDA: eager only (DSpark, the batch-invariant mode and every way of sizing the cache included)."""
    from deepinfer.config.v41_engine import check_v41_engine_args

    ok = EngineArgs(model=str(v41_dir), device="cuda", enforce_eager=True, num_cache_blocks=8)
    check_v41_engine_args(ok, "cuda")  # accepted as it is
    check_v41_engine_args(EngineArgs(model=str(v41_dir), device="cuda", enforce_eager=True, num_cache_blocks=8,
                                     speculative_config={"method": "dspark", "num_speculative_tokens": 3}), "cuda")
    check_v41_engine_args(EngineArgs(model=str(v41_dir), device="cuda", enforce_eager=True, cache_memory_gb=2.0),
                          "cuda")
    # Sized from gpu_memory_utilization: the largest step profiled (engine/profile_v41.py).
    check_v41_engine_args(EngineArgs(model=str(v41_dir), device="cuda", enforce_eager=True), "cuda")
    with pytest.raises(ValueError, match=r"^enforce_eager: .*on cuda.*allowed: True"):
        check_v41_engine_args(EngineArgs(model=str(v41_dir), device="cuda", num_cache_blocks=8), "cuda")
    with pytest.raises(ValueError, match=r"^device: .*allowed: cpu, cuda"):
        check_v41_engine_args(ok, "mps")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    check_v41_engine_args(ok, "cuda")


def test_speculative_config_per_family(v41_dir) -> None:
    """V4.1 speculates with DSpark (k up to its block), V4 with MTP; the other method names the field."""
    spec = _config(model=str(v41_dir), speculative_config={"method": "dspark", "num_speculative_tokens": 5}).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.length_by_rate, spec.writes_past_step) == \
        ("dspark", 5, False, False)
    assert _config(model=str(v41_dir), speculative_config='{"method": "dspark", "num_speculative_tokens": 1}')
    bad = [({"method": "mtp", "num_speculative_tokens": 2}, r"speculative_config\.method: 'mtp' .*allowed for this "
            r"DeepSeek-V4\.1 checkpoint: dspark"),
           ({"method": "dspark", "num_speculative_tokens": 6},
            r"speculative_config\.num_speculative_tokens: .*\[1, 5\]"),
           ({"method": "dspark", "num_speculative_tokens": 0}, r"speculative_config\.num_speculative_tokens"),
           ({"method": "eagle", "num_speculative_tokens": 1}, r"speculative_config\.method: .*allowed: mtp, dspark")]
    for value, message in bad:
        with pytest.raises(ValueError, match=f"^{message}"):
            _config(model=str(v41_dir), speculative_config=value)
    with pytest.raises(ValueError, match="^speculative_config: cannot be combined with async_scheduling"):
        _config(model=str(v41_dir), async_scheduling=True, speculative_config={"method": "dspark",
                                                                               "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"^speculative_config\.method: 'dspark' .*allowed for this DeepSeek-V4 "
                                         "checkpoint: mtp"):
        _config(speculative_config={"method": "dspark", "num_speculative_tokens": 2})


def test_dspark_block_size_bounds_k(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config(tiny_text_config(tiny_tokenizer(512),
                                                                                        dspark_block_size=3))))
    assert _config(model=str(tmp_path), speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"^speculative_config\.num_speculative_tokens: .*\[1, 3\].*dspark_block_size"):
        _config(model=str(tmp_path), speculative_config={"method": "dspark", "num_speculative_tokens": 4})


def test_v41_cache_specs(v41_dir) -> None:
    cfg = V41Config.from_model_dir(v41_dir)
    layout = build_v41_layout(cfg, 128)
    by_key = {s.key: s for s in layout.layers}
    for i in range(cfg.num_hidden_layers):
        spec, role = by_key[f"layers.{i}"], cfg.role(i)
        names = {t.name: t for t in spec.tensors}
        assert spec.kind == (CSA2 if role.ratio else SWA) and names["window_kv"].pool == WINDOW
        assert spec.window_tail == cfg.sliding_window - 1
        if role.kv_source:  # the only layers holding compressed rows: reusing / re-indexing layers read these
            assert names["entries"].pool == names["index_keys"].pool == HISTORY
            assert names["entries"].stride == names["index_keys"].stride == role.ratio
            assert ("compressor_state" in names) == (role.ratio == 2) and spec.state_tail == role.ratio - 1
        else:
            assert set(names) == {"window_kv"} and spec.state_tail == 0
    engram = by_key[ENGRAM_KEY]
    assert [t.name for t in engram.tensors] == ["token_ids"] and engram.window_tail == cfg.engram_max_ngram_size - 1
    # Block boundaries are even: the next position reads no compressor state, so a prefix hit needs the window
    # tail only, without a replay.
    assert layout.tail(STATE) == 1 and replay_length(layout) == 0
    assert tail_blocks_per_boundary(layout, WINDOW) == 1
    # With DSpark: each stage's context rows by position in the window pool, read W positions behind the
    # next token (the block after position p attends (p - W, p]).
    with_dspark = build_v41_layout(cfg, 128, dspark=True)
    assert with_dspark.layers[:len(layout.layers)] == layout.layers
    extra = with_dspark.layers[len(layout.layers):]
    assert [s.key for s in extra] == [dspark_key(i) for i in range(cfg.num_nextn_predict_layers)] == \
        ["mtp.0", "mtp.1", "mtp.2"]
    assert all([t.name for t in s.tensors] == ["window_kv"] and s.tensors[0].pool == WINDOW
               and s.window_tail == cfg.sliding_window for s in extra)


def test_intake_refuses_image_ids() -> None:
    intake = Intake(Tokenizer(demo_model_dir()), 4096, 512, 4096, refused_token_id=4000)
    with pytest.raises(ValueError, match="^prompt: contains image_token_id 4000"):
        intake.build("r", [5, 4000, 6], None)
    assert intake.build("r", [5, 6], None).prompt_token_ids == (5, 6)


def test_info_prints_the_v41_plan(v41_dir, capsys) -> None:
    assert main(["info", "--model", str(v41_dir), "--block-size", "128"]) == 0
    info = json.loads(capsys.readouterr().out)
    cfg = V41Config.from_model_dir(v41_dir)
    assert info["model_type"] == "deepseek_v41" and info["layers"] == cfg.num_hidden_layers
    roles = [r["role"] for r in info["layer_plan"]]
    assert roles == ["window", "window", "ratio-2 source", "reuse", "ratio-2 source", "ratio-1 source", "reuse",
                     "re-index", "reuse", "re-index"]
    assert info["layer_plan"][5]["candidate_source"] and info["layer_plan"][7]["uses_candidates"]
    assert [r["layer"] for r in info["layer_plan"] if r.get("engram")] == [1, 4]
    assert info["parameters"]["total"] > info["parameters"]["active_per_token"] > 0
    assert info["cache_bf16"]["history_bytes_per_token"] > 0 and info["cache_bf16"]["state_bytes_per_token"] > 0


def test_batch_invariant_mode_is_accepted_without_the_replays(v41_dir, monkeypatch) -> None:
    """``DEEPINFER_BATCH_INVARIANT=1`` runs V4.1 token by token (model/v41/invariant.py); the two replays that
    compute differently by design are refused with it, naming the field."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert _config(model=str(v41_dir)).batch_invariant
    assert _config(model=str(v41_dir), v41_prefix_replay="v41", enable_prefix_caching=False).batch_invariant
    with pytest.raises(ValueError, match=r"^v41_decoder_replay: .*allowed with DEEPINFER_BATCH_INVARIANT=1: off"):
        _config(model=str(v41_dir), v41_decoder_replay="exact", enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"^v41_prefix_replay: .*allowed with DEEPINFER_BATCH_INVARIANT=1: exact"):
        _config(model=str(v41_dir), v41_prefix_replay="v41")
