"""``deepinfer router`` settings. Flag names follow the SGLang router's where it has one
(``--worker-urls``, ``--policy``, ``--cache-threshold``, ``--balance-abs-threshold``,
``--balance-rel-threshold``, ``--max-tree-size``, ``--health-check-interval-secs``); what each does is in
``router/policies.py`` and ``router/workers.py``."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    worker_urls: tuple[str, ...]
    policy: str = "cache_aware"
    # The replicas' cache block size (their --block-size): a prefix counts in whole blocks, as their caches reuse.
    block_size: int = 256
    # cache_aware: a replica holding at least this fraction of the prompt's blocks gets it, unless loads are
    # imbalanced: the busiest replica has more than balance_abs_threshold requests in flight beyond the idlest
    # and more than balance_rel_threshold times its count (then the idlest gets it).
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 16  # blocks remembered per replica
    health_check_interval_secs: float = 5.0
    max_failures: int = 3  # consecutive failed requests that take a replica out until its health check passes
    request_timeout_secs: float = 600.0
    seed: int = 0  # power_of_two's draws

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise ValueError("worker_urls: give at least one replica URL (e.g. http://127.0.0.1:8000)")
        for url in self.worker_urls:
            u = urlparse(url)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise ValueError(f"worker_urls: {url!r} is not an http(s)://host:port URL")
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ValueError(f"worker_urls: each replica once, got {list(self.worker_urls)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold: must be in [0, 1], got {self.cache_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold: must be >= 1, got {self.balance_rel_threshold}")
        for name in ("block_size", "max_tree_size", "max_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold: must be >= 0, got {self.balance_abs_threshold}")
        for name in ("health_check_interval_secs", "request_timeout_secs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
