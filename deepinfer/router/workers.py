"""The replicas behind the router: their load as the router sees it (requests in flight through it), their
health, and what the cache-aware policy remembers of their caches.

A replica is taken out after ``max_failures`` consecutive failed requests (no connection, or a 5xx before
any byte: the request then tries another replica), or when its ``/health`` check fails; it comes back when a
check passes. Taking it out forgets its prefix index: a replica that restarted has an empty cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.router.prefix_index import PrefixIndex


@dataclass(eq=False)
class Worker:
    url: str
    index: PrefixIndex
    outstanding: int = 0  # requests in flight through this router
    healthy: bool = True
    failures: int = 0  # consecutive failed requests
    routed: int = field(default=0)

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self, max_failures: int) -> None:
        self.failures += 1
        if self.failures >= max_failures:
            self.take_out()

    def take_out(self) -> None:
        self.healthy = False
        self.index.drop()

    def checked(self, ok: bool) -> None:
        """The result of a health check."""
        if ok:
            self.healthy, self.failures = True, 0
        elif self.healthy:
            self.take_out()


class Workers:
    def __init__(self, urls: tuple[str, ...], max_tree_size: int) -> None:
        self.all = [Worker(u.rstrip("/"), PrefixIndex(max_tree_size)) for u in urls]

    def healthy(self, exclude: set[Worker] = frozenset()) -> list[Worker]:  # type: ignore[assignment]
        return [w for w in self.all if w.healthy and w not in exclude]
