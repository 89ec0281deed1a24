"""The command line: generate (args, prompt file, JSONL output), info, and the chat turn streamer."""

from __future__ import annotations

import io
import json

from deepinfer.cli import main
from deepinfer.chat.repl import stream_turn
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.sampling import SamplingParams


def test_generate_writes_jsonl(tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nimport sys\n")
    out = tmp_path / "o.jsonl"
    rc = main(["generate", "class A:", "--prompt-file", str(prompts), "--max-tokens", "4", "--ignore-eos",
               "--output", str(out), "--quiet", "--device", "cpu", "--block-size", "128", "--num-cache-blocks", "8"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["class A:", "def f(x):", "import sys"]
    assert all(len(r["token_ids"]) == 4 and r["finish_reason"] == "length" for r in rows)


def test_generate_bad_flag_value_is_a_clear_error(capsys) -> None:
    rc = main(["generate", "x", "--temperature", "-1", "--quiet", "--device", "cpu"])
    assert rc == 2
    assert "temperature" in capsys.readouterr().err


def test_info_reports_layers_and_cache_bytes(capsys) -> None:
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layers"] >= 3 and info["cache_bf16"]["history_bytes_per_token"] > 0
    assert set(info["layer_kinds"]) == {"sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"}


def test_chat_turn_streams_the_answer() -> None:
    engine = LLMEngine.from_engine_args(device="cpu", block_size=128, num_cache_blocks=8, load_progress=False)
    sink = io.StringIO()
    answer = stream_turn(engine, "t0", [{"role": "user", "content": "hi"}],
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), thinking=False, out=sink)
    assert answer and answer in sink.getvalue()
    assert not engine.has_unfinished_requests() and engine.cache.num_requests == 0


def test_prefix_caching_flag_uses_vllm_spelling() -> None:
    from deepinfer.cli import _engine_args, build_parser

    parser = build_parser()
    assert _engine_args(parser.parse_args(["generate", "x"])).enable_prefix_caching is True
    assert _engine_args(parser.parse_args(["generate", "x", "--no-enable-prefix-caching"])).enable_prefix_caching is False
    args = _engine_args(parser.parse_args(["serve", "--kv-host-cache-gb", "4", "--kv-cache-dir", "/tmp/kv",
                                           "--kv-disk-cache-gb", "100"]))
    assert (args.kv_host_cache_gb, args.kv_cache_dir, args.kv_disk_cache_gb) == (4.0, "/tmp/kv", 100.0)
