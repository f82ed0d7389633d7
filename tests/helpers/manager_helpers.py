"""Checks shared by the KVCacheManager tests, through its public methods only:
``check_invariants()`` (the ledger, the block index, and both against the C++
page allocator and the data plane's mapping table) and ``snapshot()``."""

from __future__ import annotations

from typing import Dict, Set

from kvcached.kv_cache_manager import KVCacheManager


def out_ids(m: KVCacheManager) -> Set[int]:
    """Ids the ledger says are handed out (alloc'd, reserved or null)."""
    s = m.snapshot()
    return set(s["allocated"]) | set(s["reserved"]) | set(s["null"])


def snapshot(m: KVCacheManager) -> Dict[str, object]:
    """Everything that must be unchanged after a refused or rolled-back call."""
    s = m.snapshot()
    return {
        "owned": (s["allocated"], sorted(s["reserved"]), s["null"]),
        "pages": s["free_by_page"],
        "reserved": s["reserved"],
        "nfree": s["open_free_blocks"],
        "target": s["target_pages"],
        "retired": s["retired"],
        "parked": s["parked"],
        "inuse": m.page_allocator.get_num_inuse_pages(),
        "logical": m.logical_free_size(),
    }


def check_invariants(m: KVCacheManager, group_id: int = 0) -> None:
    """No id out twice or lost; buckets, counters and mappings agree (see KVCacheManager.check_invariants)."""
    assert m.group_id == group_id
    m.check_invariants()
