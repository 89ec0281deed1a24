"""Per replica, the block prefixes of the prompts routed to it: what the cache-aware policy matches against.

A prompt's key is the chain of its full blocks of token ids (``block_size``, the replicas' cache block size: a
replica's prefix cache reuses whole blocks only), each block's hash covering every block before it, the
root salted with the request's ``cache_salt`` (replicas never share blocks across salts). An index holds at
most ``max_blocks`` block hashes and forgets the least recently routed first, as a cache under pressure does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def block_chain(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The hashes of the prompt's full blocks, each covering its whole prefix (a block-level hash chain)."""
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    parent = hashlib.blake2b((salt or "").encode(), digest_size=16).digest()
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little") for t in block))
        parent = h.digest()
        out.append(parent)
    return out


class PrefixIndex:
    """One replica's block hashes, least recently routed first."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, chain: Sequence[bytes]) -> int:
        """How many leading blocks of ``chain`` this replica holds, as far as the router knows."""
        n = 0
        while n < len(chain) and chain[n] in self._blocks:
            n += 1
        return n

    def insert(self, chain: Sequence[bytes]) -> None:
        """Record a prompt routed here: its blocks become the most recent, the oldest beyond the size go.
        Deepest block first, so that its prefix is fresher than its tail and the tail is forgotten first (a
        prefix other prompts share outlives the branches, as in a replica's own cache)."""
        for h in reversed(chain):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def drop(self) -> None:
        """Forget everything (the replica restarted or was taken out: its cache is gone)."""
        self._blocks.clear()
