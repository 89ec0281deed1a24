"""The ``deepinfer`` command: ``generate``, ``chat``, ``serve``, ``info``, ``eval``, ``bench serve``, ``router``.

    deepinfer generate "def fibonacci(n):" --max-tokens 64 --temperature 0
    deepinfer chat --thinking
    deepinfer serve --port 8000 --api-key sk-local
    deepinfer info --model /path/to/DeepSeek-V4-Flash
    deepinfer bench serve --base-url http://127.0.0.1:8000 --num-prompts 100 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepinfer.config.engine import KV_CACHE_DTYPES, EngineArgs
from deepinfer.config.v41_engine import DECODER_REPLAY_MODES, PREFIX_REPLAY_MODES


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="device (default: DEEPINFER_ACCELERATOR, else cuda when available, else cpu)")
    g.add_argument("--block-size", type=int, default=256, help="cache block size in tokens (multiple of 128)")
    g.add_argument("--num-cache-blocks", type=int, default=None, help="history-pool blocks (overrides memory)")
    g.add_argument("--cache-memory-gb", type=float, default=None, help="memory budget for the KV cache pools")
    g.add_argument("--max-num-seqs", type=int, default=64, help="max sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens per sequence")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of device memory for weights, activations and the cache")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode without CUDA graphs")
    g.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the kernels' variants at start-up, not during the first requests (default: on CUDA)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 while step N runs (the same tokens; default: on for CUDA without "
                        "speculation, off on the CPU)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cache of earlier requests' common prefixes (the same tokens; default: on)")
    g.add_argument("--kv-host-cache-gb", type=float, default=0.0,
                   help="host-memory tier for prefix-cache blocks evicted from the device (0 = none)")
    g.add_argument("--kv-cache-dir", default=None,
                   help="disk tier directory for prefix-cache blocks (found again after a restart)")
    g.add_argument("--kv-disk-cache-gb", type=float, default=None, help="size limit of --kv-cache-dir")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split attention heads (and, without expert parallelism, experts) over this many devices")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="data-parallel attention: this many groups, each with its own sequences and cache")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="spread the routed experts over all data x tensor parallel devices")
    _context_parallel_flags(g)
    g.add_argument("--enable-eplb", action="store_true",
                   help="expert-parallel load balancing: replicate hot experts and re-place them between steps")
    g.add_argument("--eplb-config", default=None, metavar="JSON",
                   help='EPLB settings, e.g. \'{"num_redundant_experts": 8, "window_size": 1000, '
                        '"step_interval": 3000, "log_balancedness": true}\'')
    _node_flags(p)
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the model's safetensors; dummy: random weights in the native formats from "
                        "config.json alone (no weights needed)")
    g.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help="""config.json fields to change, e.g. '{"num_hidden_layers": 4}' (the first 4 layers)""")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\' (V4, k 1..4; '
                        'V4.1: "dspark", k 1..5)')
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="cache numerics: auto = the model's released cache formats (V4.1: FP8 window KV, MXFP4 "
                        "index keys, NVFP4 compressed KV, stored packed; V4: the activation dtype), bfloat16/float32 "
                        "= no cache quantization (must equal --dtype)")
    g.add_argument("--v41-decoder-replay", default="off", choices=list(DECODER_REPLAY_MODES),
                   help="DeepSeek-V4.1: decoder layers of long prefill chunks on the last rows only; v41 = the "
                        "released model's (not bit-identical), exact = with the dependency halo (with prefix "
                        "caching on, either needs --v41-prefix-replay v41)")
    g.add_argument("--v41-prefix-replay", default="exact", choices=list(PREFIX_REPLAY_MODES),
                   help="DeepSeek-V4.1: how a prefix-cache hit is taken; exact = from the boundary's kept window "
                        "tails (hit == no hit), v41 = the released encoder-side replay: recompute the window behind "
                        "the boundary (not bit-identical to a cold run)")


def _context_parallel_flags(g) -> None:
    """Shared by the engine commands and ``info`` (which plans the same layout)."""
    g.add_argument("--context-parallel-size", "-cp", type=int, default=1,
                   help="split each long prefill chunk over this many data-parallel ranks (zigzag, causally "
                        "balanced); must divide --data-parallel-size")
    g.add_argument("--context-parallel-min-tokens", type=int, default=1024,
                   help="prefill chunks of at least this many tokens use context parallelism")


def _node_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "several nodes", "run the same command on every node, each with its --node-rank; node 0 serves, the "
        "others only run their ranks (alternatively start every rank under torchrun and leave these out)")
    g.add_argument("--nnodes", type=int, default=1,
                   help="nodes the data x tensor parallel ranks are spread over, the same number on each")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, --nnodes)")
    g.add_argument("--master-addr", default=None,
                   help="address of node 0 that every node can reach (the torch.distributed rendezvous; "
                        "required with --nnodes > 1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="a free port on node 0 for the rendezvous (default: 29500 on several nodes, any free "
                        "port on one)")
    g.add_argument("--ranks-share-device", action="store_true",
                   help="one node only: run every rank on the first visible CUDA device, collectives over gloo "
                        "through host memory (rehearses the multi-GPU path on one GPU; slower, not for serving)")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="max tokens to generate per prompt")
    g.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p(best)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty [-2, 2]")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None, help="per-request seed (seq_seed) for reproducible sampling")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")
    g.add_argument("--logprobs", type=int, default=None, help="return top-N logprobs per token")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sentence token")


def _engine_args(a: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=a.model, tokenizer=a.tokenizer, dtype=a.dtype, device=a.device, block_size=a.block_size,
        num_cache_blocks=a.num_cache_blocks, cache_memory_gb=a.cache_memory_gb, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager, warm_up=a.warm_up,
        async_scheduling=a.async_scheduling, enable_prefix_caching=a.enable_prefix_caching,
        kv_host_cache_gb=a.kv_host_cache_gb, kv_cache_dir=a.kv_cache_dir, kv_disk_cache_gb=a.kv_disk_cache_gb,
        tensor_parallel_size=a.tensor_parallel_size,
        data_parallel_size=a.data_parallel_size, enable_expert_parallel=a.enable_expert_parallel,
        context_parallel_size=a.context_parallel_size, context_parallel_min_tokens=a.context_parallel_min_tokens,
        enable_eplb=a.enable_eplb, eplb_config=a.eplb_config,
        nnodes=a.nnodes, node_rank=a.node_rank, master_addr=a.master_addr, master_port=a.master_port,
        ranks_share_device=a.ranks_share_device, load_format=a.load_format, hf_overrides=a.hf_overrides, speculative_config=a.speculative_config,
        kv_cache_dtype=a.kv_cache_dtype, v41_decoder_replay=a.v41_decoder_replay,
        v41_prefix_replay=a.v41_prefix_replay,
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text}")
    return value


def _sampling_params(a: argparse.Namespace):
    from deepinfer.sampling import SamplingParams

    return SamplingParams(
        n=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, max_tokens=a.max_tokens, min_tokens=a.min_tokens, stop=a.stop,
        seq_seed=a.seed, logprobs=a.logprobs, ignore_eos=a.ignore_eos,
    )


def _read_prompts(a: argparse.Namespace) -> list[str]:
    prompts = list(a.prompts)
    if a.prompt_file:
        with open(a.prompt_file, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line:
                    continue
                prompts.append(json.loads(line)["prompt"] if a.prompt_file.endswith(".jsonl") else line)
    if not prompts:
        prompts = ["def fibonacci(n):"]
    return prompts


def cmd_generate(a: argparse.Namespace) -> int:
    from deepinfer.llm import LLM

    params, prompts = _sampling_params(a), _read_prompts(a)  # validate input before loading weights
    llm = LLM(**{k: getattr(_engine_args(a), k) for k in EngineArgs.field_names()})
    try:
        outputs = llm.generate(prompts, params, use_tqdm=not a.quiet)
    finally:
        llm.close()
    sink = open(a.output, "w", encoding="utf-8") if a.output else None
    for out in outputs:
        for c in out.outputs:
            record = {"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                      "finish_reason": c.finish_reason}
            if sink:
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                print(f"--- prompt: {out.prompt!r} [sample {c.index}, {c.finish_reason}]")
                print(out.prompt + c.text)
    if sink:
        sink.close()
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from deepinfer.chat.repl import run_chat

    return run_chat(_engine_args(a), _sampling_params(a), thinking=a.thinking, system=a.system)


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from deepinfer.server.app import build_app, serve
    except ImportError as e:
        print(f"error: {e.name} is missing; install the server extra: pip install 'deepinfer[serve]'", file=sys.stderr)
        return 2
    from deepinfer.config.engine import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.server.engine_client import EngineClient, serves_here
    from deepinfer.server.log_setup import log_to_stderr
    from deepinfer.server.stat_log import LOG_STATS_INTERVAL_S

    if a.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes: must be >= 1, got {a.max_request_bytes}")
    config = EngineConfig.create(_engine_args(a))  # bad arguments are refused here, before anything starts
    log_to_stderr(a.log_level)
    if a.engine_process and serves_here(config):
        # The engine core in its own process (server/engine_process.py), logging at the same level.
        engine = EngineClient.launch(config, log_level=a.log_level)
    else:
        engine = LLMEngine.from_config(config)  # a follower node's ranks never return from here
    app = build_app(engine, served_model_name=a.served_model_name, api_key=a.api_key,
                    max_request_bytes=a.max_request_bytes, log_stats_interval=None if a.disable_log_stats else
                    LOG_STATS_INTERVAL_S)
    # SIGINT/SIGTERM: stop accepting, let in-flight requests run for --graceful-shutdown-timeout seconds,
    # abort what is left (clients get finish_reason "abort"), stop the engine, exit 0 (1: the engine died).
    return serve(app, host=a.host, port=a.port, log_level=a.log_level, graceful_timeout=a.graceful_shutdown_timeout)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from deepinfer.benchmarks.serve import main as bench_serve

    return bench_serve(a)


def cmd_info(a: argparse.Namespace) -> int:
    from deepinfer.assets import demo_model_dir
    from deepinfer.config.v41 import is_v41_config
    from deepinfer.config.v41_engine import read_config_json
    from deepinfer.engine.memory_plan import GIB, Deployment, device_memory_bytes

    model_dir = a.model or str(demo_model_dir())
    device_bytes = int(a.device_memory_gib * GIB) if a.device_memory_gib else device_memory_bytes()

    def deployment(max_position_embeddings: int) -> Deployment:
        return Deployment(
            tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size,
            enable_expert_parallel=a.enable_expert_parallel, max_num_seqs=a.max_num_seqs,
            max_model_len=a.max_model_len or min(max_position_embeddings, 8192),
            max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
            gpu_memory_utilization=a.gpu_memory_utilization, context_parallel_size=a.context_parallel_size,
            context_parallel_min_tokens=a.context_parallel_min_tokens, ranks_share_device=a.ranks_share_device)

    if is_v41_config(read_config_json(model_dir)):  # DeepSeek-V4.1: its layer plan, cache and memory plan
        from deepinfer.config.v41 import V41Config
        from deepinfer.engine.memory_plan_v41 import describe_v41, v41_parameter_specs
        from deepinfer.model.v41.summary import summarize_v41

        v41 = V41Config.from_model_dir(model_dir)
        specs = v41_parameter_specs(v41)
        summary = summarize_v41(model_dir, a.block_size, specs)
        summary["memory_plan"] = describe_v41(v41, deployment(v41.max_position_embeddings), device_bytes, specs)
    else:
        from deepinfer.config.model import ModelConfig
        from deepinfer.engine.memory_plan import describe
        from deepinfer.model.summary import parameter_specs, summarize

        cfg = ModelConfig.from_model_dir(model_dir)
        specs = parameter_specs(cfg)
        summary = summarize(model_dir, specs)
        summary["memory_plan"] = describe(cfg, deployment(cfg.max_position_embeddings), device_bytes, specs)
    print(json.dumps(summary, indent=2))
    plan = summary["memory_plan"]
    if not plan["fits"]:
        what = "not supported" if plan.get("supported") is False else "does not fit"
        hint = plan["suggestion"]
        print(f"error: {what}: {plan['reason']}; {'try ' if hint.startswith('--') else ''}{hint}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4 inference engine")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts (offline batch)")
    g.add_argument("prompts", nargs="*", help="prompt strings (default: a demo prompt)")
    g.add_argument("--prompt-file", default=None, help="file with one prompt per line, or .jsonl with 'prompt'")
    g.add_argument("--output", default=None, help="write JSONL results here instead of printing")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_flags(g)
    _sampling_flags(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    c.add_argument("--thinking", action="store_true", help="thinking mode: show the model's reasoning")
    c.add_argument("--system", default=None, help="system prompt")
    _engine_flags(c)
    _sampling_flags(c)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model directory's name, deepinfer-demo for the demo)")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body accepted (413 above)")
    s.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run on after SIGTERM before they are aborted")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line in the log (every 10 s: prompt/generation throughput, running and "
                        "waiting requests, KV cache usage, prefix hit rate, speculative acceptance)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so the HTTP work (parsing, streaming every "
                        "token) does not share a GIL with the engine loop (default: on); --no-engine-process "
                        "runs it in a thread of the server process")
    _engine_flags(s)
    s.set_defaults(func=cmd_serve)
    i = sub.add_parser("info", help="model summary and the memory plan per device (nothing is loaded)")
    i.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    i.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices splitting attention heads")
    i.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="attention data-parallel ranks")
    i.add_argument("--enable-expert-parallel", action="store_true", help="spread routed experts over all devices")
    _context_parallel_flags(i)
    i.add_argument("--max-num-seqs", type=int, default=64, help="max sequences per step")
    i.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    i.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens per sequence")
    i.add_argument("--block-size", type=int, default=256, help="cache block size in tokens")
    i.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of device memory to use")
    i.add_argument("--ranks-share-device", action="store_true",
                   help="plan every rank on one device, each with 1/ranks of it (as the engine's flag runs them)")
    i.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory of one device (default: the visible CUDA device, else an H200's 140 GiB)")
    i.set_defaults(func=cmd_info)
    from deepinfer.eval.perplexity import add_eval_parser

    add_eval_parser(sub)  # deepinfer eval: held-out perplexity / accuracy / MTP acceptance, deepinfer vs HF
    from deepinfer.benchmarks.options import add_bench_parser

    add_bench_parser(sub).set_defaults(func=cmd_bench_serve)  # deepinfer bench serve: a serving benchmark client
    from deepinfer.router.cli import add_router_parser

    add_router_parser(sub)  # deepinfer router: one endpoint in front of several replicas
    return p


# Commands whose --model is a model directory (``bench serve``'s is the served model's name).
_MODEL_DIR_COMMANDS = ("generate", "chat", "serve", "info", "eval")


def _missing_model_config(args: argparse.Namespace) -> str:
    """The error for a --model directory without config.json ("" when it has one or --model is not given): said
    before anything is imported or loaded, instead of a traceback from deep inside."""
    if args.command not in _MODEL_DIR_COMMANDS or not getattr(args, "model", None):
        return ""
    path = Path(args.model) / "config.json"
    if path.is_file():
        return ""
    where = "" if Path(args.model).is_dir() else f" ({args.model} is not a directory)"
    return f"--model: {path} not found{where}; a model directory holds config.json (and the tokenizer and weights)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = _missing_model_config(args)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
