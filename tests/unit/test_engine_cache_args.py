"""Prefix-caching and cache-tier engine arguments: defaults, the frozen config they become,
errors that name the field, and the request-side cache_salt."""

from __future__ import annotations

import pytest

from deepinfer.config.engine import EngineArgs, EngineConfig, KVTierConfig
from deepinfer.kv.tiers import StoreIdentity, open_store

GIB = 1 << 30


def _config(**kw) -> EngineConfig:
    return EngineConfig.create(EngineArgs(device="cpu", **kw))


def test_defaults_turn_prefix_caching_on_and_no_tiers() -> None:
    cache = _config().cache
    assert cache.enable_prefix_caching is True
    assert cache.tiers == KVTierConfig() and not cache.tiers.enabled
    assert _config(enable_prefix_caching=False).cache.enable_prefix_caching is False


def test_tier_arguments_are_carried_in_bytes(tmp_path) -> None:
    tiers = _config(kv_cache_dir=str(tmp_path / "kv"), kv_disk_cache_gb=2, kv_host_cache_gb=0.5).cache.tiers
    assert tiers == KVTierConfig(host_bytes=GIB // 2, disk_dir=str(tmp_path / "kv"), disk_bytes=2 * GIB)
    assert tiers.enabled and not (tmp_path / "kv").exists()  # nothing is created before the engine starts
    with open_store(tiers, StoreIdentity(b"x" * 32, 256)) as store:
        assert [(t.tier, t.capacity_bytes) for t in store.stats().tiers] == [("host", GIB // 2), ("disk", 2 * GIB)]
    assert open_store(KVTierConfig(), StoreIdentity(b"x" * 32, 256)) is None


@pytest.mark.parametrize("kw, field", [
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"kv_host_cache_gb": -1}, "kv_host_cache_gb"),
    ({"kv_host_cache_gb": float("nan")}, "kv_host_cache_gb"),
    ({"kv_host_cache_gb": True}, "kv_host_cache_gb"),
    ({"kv_cache_dir": ""}, "kv_cache_dir"),
    ({"kv_cache_dir": "FILE", "kv_disk_cache_gb": 1}, "kv_cache_dir"),
    ({"kv_cache_dir": "DIR"}, "kv_disk_cache_gb"),
    ({"kv_disk_cache_gb": 1}, "kv_disk_cache_gb"),
    ({"kv_cache_dir": "DIR", "kv_disk_cache_gb": 0}, "kv_disk_cache_gb"),
    ({"kv_host_cache_gb": 1, "enable_prefix_caching": False}, "kv_host_cache_gb"),
    ({"kv_cache_dir": "DIR", "kv_disk_cache_gb": 1, "enable_prefix_caching": False}, "kv_cache_dir"),
])
def test_bad_values_name_the_field(tmp_path, kw: dict, field: str) -> None:
    (tmp_path / "file").write_text("x")
    paths = {"FILE": str(tmp_path / "file"), "DIR": str(tmp_path / "kv")}
    kw = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(ValueError, match=rf"^{field}:"):
        _config(**kw)


def test_request_cache_salt() -> None:
    pytest.importorskip("fastapi")
    from deepinfer.server.errors import ApiError, parse_body
    from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest

    assert parse_body(CompletionRequest, b'{"prompt": "x", "cache_salt": "tenant-a"}').cache_salt == "tenant-a"
    assert parse_body(CompletionRequest, b'{"prompt": "x"}').cache_salt is None
    chat = parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": "s"}')
    assert chat.cache_salt == "s"
    for bad in (b'""', b"7"):
        with pytest.raises(ApiError) as e:
            parse_body(CompletionRequest, b'{"prompt": "x", "cache_salt": ' + bad + b"}")
        assert e.value.param == "cache_salt" and e.value.status == 400
