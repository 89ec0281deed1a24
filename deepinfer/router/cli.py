"""``deepinfer router`` (``python -m deepinfer.router``): its flags and how it runs."""

from __future__ import annotations

import argparse

from deepinfer.config.router import POLICIES, RouterConfig

_D = RouterConfig(("http://x",))  # the defaults


def add_router_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("router", help="one OpenAI-compatible endpoint routing to several deepinfer serve replicas "
                                      "(cache-aware by default)")
    r.add_argument("--worker-urls", nargs="+", required=True, metavar="URL",
                   help="the replicas, e.g. http://127.0.0.1:8001 http://127.0.0.1:8002")
    r.add_argument("--policy", default=_D.policy, choices=POLICIES,
                   help="cache_aware: the replica most likely to hold the prompt's prefix unless loads are "
                        "imbalanced; consistent_hash: by X-Session-ID / user; power_of_two; round_robin")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    r.add_argument("--port", type=int, default=8000, help="port to bind (0: any free one, printed at start)")
    r.add_argument("--tokenizer", default=None,
                   help="the replicas' model (or tokenizer) directory, to key prompts by their token ids "
                        "(default: the bundled demo model's)")
    r.add_argument("--block-size", type=int, default=_D.block_size,
                   help="the replicas' --block-size: prefixes count in whole cache blocks")
    r.add_argument("--cache-threshold", type=float, default=_D.cache_threshold,
                   help="cache_aware: the fraction of the prompt's blocks a replica must hold to get it")
    r.add_argument("--balance-abs-threshold", type=int, default=_D.balance_abs_threshold,
                   help="cache_aware: loads count as imbalanced when the busiest replica has more than this many "
                        "requests in flight beyond the idlest ...")
    r.add_argument("--balance-rel-threshold", type=float, default=_D.balance_rel_threshold,
                   help="... and more than this many times its count; then the idlest gets the request")
    r.add_argument("--max-tree-size", type=int, default=_D.max_tree_size,
                   help="cache_aware: prompt blocks remembered per replica (the oldest go first)")
    r.add_argument("--health-check-interval-secs", type=float, default=_D.health_check_interval_secs)
    r.add_argument("--max-failures", type=int, default=_D.max_failures,
                   help="consecutive failed requests that take a replica out until a health check passes")
    r.add_argument("--request-timeout-secs", type=float, default=_D.request_timeout_secs)
    r.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    r.set_defaults(func=cmd_router)
    return r


def cmd_router(a: argparse.Namespace) -> int:
    import uvicorn

    from deepinfer.router.app import build_router_app
    from deepinfer.tokenizer import Tokenizer

    config = RouterConfig(
        tuple(a.worker_urls), a.policy, a.block_size, a.cache_threshold, a.balance_abs_threshold,
        a.balance_rel_threshold, a.max_tree_size, a.health_check_interval_secs, a.max_failures,
        a.request_timeout_secs)
    tokenizer = Tokenizer(a.tokenizer) if a.tokenizer else Tokenizer()
    uvicorn.run(build_router_app(config, tokenizer), host=a.host, port=a.port, log_level=a.log_level)
    return 0
