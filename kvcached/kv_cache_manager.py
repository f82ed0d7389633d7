"""Upstream's import path of ``KVCacheManager`` (``from kvcached.kv_cache_manager import KVCacheManager``).

The class is ``kvcached.compat.upstream_manager``'s: upstream's constructor,
revisioned limit and snapshots over the core ``kvcached.block_manager.BlockManager``.
"""

from kvcached.block_manager import EMPTY_PAGE_GRACE_S, MAX_PARKED_PAGES
from kvcached.compat.upstream_manager import KVCacheManager

__all__ = ["EMPTY_PAGE_GRACE_S", "MAX_PARKED_PAGES", "KVCacheManager"]
