"""Cache storage below the device pools: host memory and a local disk directory.

``TieredStore`` keeps self-checking objects (``blob``) by key in ``Tier``s (``HostTier``, ``DiskTier``)
with an LRU across them; ``payload.pack`` / ``payload.unpack`` turn one block of a pool into bytes and back.
"""

from deepinfer.kv.tiers.base import Tier
from deepinfer.kv.tiers.blob import BlobError, StoredBlock, StoreIdentity
from deepinfer.kv.tiers.disk import DiskTier
from deepinfer.kv.tiers.host import HostTier
from deepinfer.kv.tiers.payload import pack, pack_many, payload_bytes, unpack, unpack_many
from deepinfer.kv.tiers.stats import TierCounters, TierStats
from deepinfer.kv.tiers.store import TieredStore, open_store

__all__ = ["BlobError", "DiskTier", "HostTier", "StoreIdentity", "StoredBlock", "Tier", "TierCounters",
           "TierStats", "TieredStore", "open_store", "pack", "pack_many", "payload_bytes", "unpack",
           "unpack_many"]
