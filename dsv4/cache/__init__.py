"""Paged KV cache bookkeeping (pure Python): layout, block pool, per-request manager.

Reading path: `layout.py` (what lives where in the one backing tensor and what a hand-off
moves; `packing.py` has the entry formats and the packing), then `block_pool.py` (refcounted ids), then `manager.py` (per-request blocks).
"""

from dsv4.cache.block_pool import BlockPool
from dsv4.cache.layout import LAYOUT_VERSION, KindFootprint, KVLayout
from dsv4.cache.manager import KVCacheManager
from dsv4.cache.packing import (
    COMPRESSED,
    COMPRESSOR_STATE,
    INDEXER,
    INDEXER_STATE,
    WINDOW,
    CacheOptions,
    CacheRegion,
)

__all__ = [
    "COMPRESSED",
    "COMPRESSOR_STATE",
    "INDEXER",
    "INDEXER_STATE",
    "LAYOUT_VERSION",
    "WINDOW",
    "BlockPool",
    "CacheOptions",
    "CacheRegion",
    "KVCacheManager",
    "KVLayout",
    "KindFootprint",
]
