"""Which replica gets a request. Every policy picks among the healthy replicas it is given (never empty).

  * ``cache_aware`` (SGLang router's rule on the prompt's token blocks): if the loads are imbalanced -- the
    busiest replica has more than ``balance_abs_threshold`` requests in flight beyond the idlest and more
    than ``balance_rel_threshold`` times its count -- the idlest; else the replica whose index matches the
    most leading blocks of the prompt, if that is at least ``cache_threshold`` of them; else the idlest, and
    among equally idle the one remembering the fewest blocks (new prefixes spread over the replicas). The
    prompt's blocks are then recorded for the replica it went to.
  * ``consistent_hash``: the request's session key (the ``X-Session-ID`` header, else the body's ``user``)
    picks its replica by rendezvous hashing, so a session stays on one replica and only the sessions of a
    replica that leaves move; a request without a key goes to the idlest.
  * ``power_of_two``: the idler of two replicas drawn at random (seeded).
  * ``round_robin``: the next healthy replica in turn.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from deepinfer.config.router import RouterConfig
from deepinfer.router.workers import Worker


@dataclass(frozen=True, slots=True)
class RequestKey:
    chain: tuple[bytes, ...] = ()  # the prompt's block chain (prefix_index.block_chain); () when unknown
    session: str | None = None
    tokens: int = 0  # the prompt's token count (0 when unknown)


@dataclass(frozen=True, slots=True)
class Choice:
    worker: Worker
    reason: str  # cache | balance | least_load | session | power_of_two | round_robin
    matched_blocks: int = 0


def idlest(workers: list[Worker]) -> Worker:
    return min(workers, key=lambda w: (w.outstanding, len(w.index)))


class CacheAware:
    def __init__(self, config: RouterConfig) -> None:
        self.threshold = config.cache_threshold
        self.abs, self.rel = config.balance_abs_threshold, config.balance_rel_threshold

    def choose(self, workers: list[Worker], key: RequestKey) -> Choice:
        lo, hi = min(w.outstanding for w in workers), max(w.outstanding for w in workers)
        if hi - lo > self.abs and hi > self.rel * lo:
            return Choice(idlest(workers), "balance")
        if key.chain:
            matches = [(w.index.match(key.chain), -w.outstanding, -i) for i, w in enumerate(workers)]
            best = max(range(len(workers)), key=lambda i: matches[i])
            m = matches[best][0]
            if m and m >= self.threshold * len(key.chain):
                return Choice(workers[best], "cache", m)
        return Choice(idlest(workers), "least_load")

    def routed(self, choice: Choice, key: RequestKey) -> None:
        choice.worker.index.insert(key.chain)


class ConsistentHash:
    def choose(self, workers: list[Worker], key: RequestKey) -> Choice:
        if key.session is None:
            return Choice(idlest(workers), "least_load")

        def weight(w: Worker) -> bytes:
            return hashlib.blake2b(f"{key.session}\0{w.url}".encode(), digest_size=8).digest()

        return Choice(max(workers, key=weight), "session")

    def routed(self, choice: Choice, key: RequestKey) -> None:
        pass


class PowerOfTwo:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choose(self, workers: list[Worker], key: RequestKey) -> Choice:
        pair = self.rng.sample(workers, 2) if len(workers) > 1 else workers
        return Choice(min(pair, key=lambda w: w.outstanding), "power_of_two")

    def routed(self, choice: Choice, key: RequestKey) -> None:
        pass


class RoundRobin:
    def __init__(self) -> None:
        self.turn = 0

    def choose(self, workers: list[Worker], key: RequestKey) -> Choice:
        w = workers[self.turn % len(workers)]
        self.turn += 1
        return Choice(w, "round_robin")

    def routed(self, choice: Choice, key: RequestKey) -> None:
        pass


Policy = CacheAware | ConsistentHash | PowerOfTwo | RoundRobin


def make_policy(config: RouterConfig) -> Policy:
    if config.policy == "cache_aware":
        return CacheAware(config)
    if config.policy == "consistent_hash":
        return ConsistentHash()
    if config.policy == "power_of_two":
        return PowerOfTwo(config.seed)
    return RoundRobin()
