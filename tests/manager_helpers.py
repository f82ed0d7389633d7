"""Checks shared by the KVCacheManager tests: the ledger's invariants, read
from the manager's own structures and cross-checked against the C++ page
allocator and the data plane's mapping table."""

from __future__ import annotations

from typing import Dict, Set

from kvcached import _C
from kvcached.kv_cache_manager import _NULL, _OUT, _RESERVED, KVCacheManager


def out_ids(m: KVCacheManager) -> Set[int]:
    """Ids the ledger says are handed out (alloc'd, reserved or null)."""
    return {b for b, s in enumerate(m._owned) if s in (_OUT, _RESERVED, _NULL)}


def snapshot(m: KVCacheManager) -> Dict[str, object]:
    """Everything that must be unchanged after a refused or rolled-back call."""
    return {
        "owned": bytes(m._owned),
        "pages": {pid: sorted(p) for pid, p in m._held.items()},
        "reserved": list(m._reserved),
        "nfree": m._nfree,
        "mask": m._mask,
        "target": m._target_pages,
        "retired": dict(m._retired),
        "inuse": m.page_allocator.get_num_inuse_pages(),
        "unheld": dict(m._unheld_caps),
    }


def check_invariants(m: KVCacheManager, group_id: int = 0) -> None:
    """No id out twice or lost; buckets, counters and mappings agree."""
    geo = m.geometry
    owned = m._owned
    seen: Set[int] = set()
    nfree = 0
    mask = 0
    for k, bucket in enumerate(m._buckets):
        if bucket:
            mask |= 1 << k
        for pid, page in bucket.items():
            assert k >= 1 and len(page) == k, f"page {pid} filed under {k} but has {len(page)} free"
            assert page.open and m._held[pid] is page
    assert mask == m._mask
    for pid, page in m._held.items():
        first, end = geo.block_range(pid)
        assert page.cap == end - first
        free = list(page)
        assert len(set(free)) == len(free), f"page {pid}: a block is free twice"
        for b in free:
            assert first <= b < end and owned[b] == 0, f"free block {b} of page {pid} is marked {owned[b]}"
        live = [b for b in range(first, end) if owned[b] != 0]
        assert len(live) + len(free) == page.cap, f"page {pid}: a block is lost"
        seen.update(range(first, end))
        assert page.open == (pid < m._target_pages)
        if page.open:
            if free:
                assert m._buckets[len(free)].get(pid) is page
            nfree += len(free)
        else:
            assert all(pid not in b for b in m._buckets)
        if not live:
            # An empty page stays held only while it waits for a release marker.
            assert m.defer_physical_release and pid in m._retired
    assert nfree == m._nfree
    for b, s in enumerate(owned):
        if s != 0:
            assert b in seen, f"block {b} is out but its page is not held"
    assert sorted(m._reserved) == sorted(b for b, s in enumerate(owned) if s == _RESERVED)
    assert len(set(m._reserved)) == len(m._reserved)
    # Pages: held by the manager == in use in C++; mapped == held + reserve.
    pa = m.page_allocator
    assert pa.get_num_inuse_pages() == len(m._held)
    assert pa.get_num_mapped_pages() == len(m._held) + pa.get_num_reserved_pages()
    if m._local:
        assert _C.group_info(group_id)["mapped_pages"] == pa.get_num_mapped_pages()
        mapped = set(_C.mapped_offsets(group_id))
        assert {pid * m.page_size for pid in m._held} <= mapped
    # Unheld pages within the target, by capacity.
    caps: Dict[int, int] = {}
    for pid in range(m._target_pages):
        if pid not in m._held:
            caps[geo.caps[pid]] = caps.get(geo.caps[pid], 0) + 1
    assert {c: n for c, n in m._unheld_caps.items() if n} == caps
