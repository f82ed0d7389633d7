"""KVCacheManager over the real data plane (host backend; CUDA too where present):
placement, page policy, reserve, deferred release, resize, rollback, bad input."""

from __future__ import annotations

import math
import os
import sys
import threading
import uuid

import pytest
import torch

from kvcached import _C
from kvcached.block_geometry import GOOD_UTILIZATION, BlockGeometry, better_page_size
from kvcached.errors import BackendError, InvalidArgumentError, ShutdownError
from kvcached.kv_cache_manager import KVCacheManager
from manager_helpers import check_invariants, out_ids, snapshot
from vmm_helpers import physical_bytes

BLOCK_TOKENS = 16
LAYERS = 2


@pytest.fixture
def make(vmm, device, page_size, monkeypatch):
    """Builds a manager over fresh KV tensors: ``per_page`` blocks per page,
    ``pages`` pages; reserve bounds min 0 / max ``max_reserved``; no pre-map.

    Parking is off unless a test asks (``empty_page_grace_s``): these tests pin
    what happens when a page empties; the grace has its own tests below."""
    made = []

    def _make(per_page=8, pages=8, num_blocks=None, max_reserved=2, create=True, kv=2, **kw):
        monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", str(kw.pop("min_reserved", 0)))
        monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", str(max_reserved))
        cell = page_size // (per_page * BLOCK_TOKENS)
        n = pages * per_page if num_blocks is None else num_blocks
        if create:
            vmm.create_kv_tensors(n * BLOCK_TOKENS * cell, 2, device, LAYERS, kv)
        kw.setdefault("empty_page_grace_s", 0)
        m = KVCacheManager(n, BLOCK_TOKENS, cell, LAYERS, num_kv_buffers=kv, **kw)
        made.append(m)
        return m

    yield _make
    for m in made:
        m.shutdown()


def page_of(m, ids):
    return sorted({m.get_page_id(b) for b in ids})


# ---------------------------------------------------------------- geometry


def test_block_never_straddles_and_holes_are_skipped(page_size):
    # MLA-like rows: 576 bf16 elements per token, 16 tokens: blocks do not divide pages.
    geo = BlockGeometry(200, 16, 1152, page_size)
    assert not geo.exact
    for p in range(geo.num_pages):
        first, end = geo.block_range(p)
        assert end > first  # every page holds a block
        for b in range(first, end):
            lo, hi = b * geo.block_mem_size, (b + 1) * geo.block_mem_size
            assert p * page_size <= lo and hi <= (p + 1) * page_size
    usable = {b for p in range(geo.num_pages) for b in range(*geo.block_range(p))}
    for b in range(geo.num_blocks):
        assert (b in usable) == geo.is_usable(b)
    assert len(usable) == geo.num_usable_blocks


@pytest.mark.parametrize(
    "block_size,cell_size,why",
    [(32, 4096, "does not fit in a page"), (5, 8000, "would hold no whole block")],
)
def test_unusable_geometry_is_refused_with_a_working_one(block_size, cell_size, why):
    page = 64 * 1024
    with pytest.raises(InvalidArgumentError, match=why) as e:
        BlockGeometry(100, block_size, cell_size, page)
    msg = str(e.value)
    # The message names a block size and a page size; both must really work.
    suggested_bs = int(msg.split("block_size=")[1].split()[0])
    suggested_page = int(msg.split("KVCACHED_PAGE_SIZE=")[1].split()[0])
    BlockGeometry(100, suggested_bs, cell_size, page)
    BlockGeometry(100, block_size, cell_size, suggested_page)


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(1114112, id="qwen3-next-bf16-state"),
        pytest.param(2162688, id="qwen3-next-fp32-state"),
        pytest.param(18432, id="mla-latent"),
        pytest.param(96 * 1024, id="96KiB"),
    ],
)
def test_page_utilization_is_what_the_geometry_uses_and_the_suggested_page_fills_nine_tenths(block):
    page = 2 << 20
    size, used = better_page_size(block, page)
    assert size % page == 0 and used >= GOOD_UTILIZATION
    for p in {size, 4 * page}:
        if p < block:
            continue
        periods = 3 * math.lcm(p, block) // block  # whole periods of the block/page pattern
        geo = BlockGeometry(periods, 1, block, p)
        assert geo.num_usable_blocks * block / (geo.num_pages * p) == pytest.approx(geo.utilization)
    assert BlockGeometry(64, 1, block, size).utilization == pytest.approx(used)


def test_a_page_that_wastes_a_tenth_warns_once_naming_a_better_one(vmm, device, page_size, caplog):
    # Blocks of 17/64 of a page (a real Qwen3-Next's 1,114,112 B blocks on 4 MiB pages):
    # 3 per page, 75% of it used.
    block = page_size * 17 // 64
    vmm.create_kv_tensors(8 * page_size, 1, device, 1, 1)
    with caplog.at_level("WARNING"):
        m = KVCacheManager(24, 1, block, 1, num_kv_buffers=1)
    try:
        lines = [r.getMessage() for r in caplog.records if "straddling" in r.getMessage()]
        assert len(lines) == 1, lines
        assert f"fill 75% of each {page_size >> 10} KiB page" in lines[0]
        size, used = better_page_size(block, page_size)
        assert used >= GOOD_UTILIZATION and f"KVCACHED_PAGE_SIZE={size} would fill {used:.0%}" in lines[0]
    finally:
        m.shutdown()


@pytest.mark.parametrize("bad", [0, -1, 1.5, None, True])
def test_constructor_refuses_bad_sizes(vmm, bad):
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(bad, 16, 64, 2)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(64, 16, 64, bad)


def test_manager_must_match_the_tensors(vmm, device, page_size):
    vmm.create_kv_tensors(4 * page_size, 2, device, LAYERS, 2)
    with pytest.raises(InvalidArgumentError, match="do not match"):
        KVCacheManager(64, 16, page_size // 16 // 16, LAYERS + 1)  # 3 layers over 2-layer tensors
    with pytest.raises(InvalidArgumentError, match="do not match"):
        KVCacheManager(8 * 16 * 2, 16, page_size // 16 // 16, LAYERS)  # more pages than the tensors


# ------------------------------------------------------------- alloc / free


def test_alloc_free_roundtrip_and_invariants(make):
    m = make()
    total = m.available_size()
    assert total == m.num_blocks
    got = [m.alloc(3), m.alloc(1), m.alloc(9)]
    ids = [b for g in got for b in g]
    assert len(ids) == len(set(ids)) == 13
    check_invariants(m)
    assert m.available_size() == total - 13
    for g in got:
        m.free(g)
        check_invariants(m)
    assert m.available_size() == total
    assert m.stats()["held_pages"] == 0


def test_page_affine_placement(make):
    m = make(per_page=8)
    a = m.alloc(6)  # page 0: 2 free
    b = m.alloc(3)  # does not fit page 0's 2 -> a fresh page; page 1: 5 free
    assert page_of(m, a) == [0] and len(page_of(m, b)) == 1 and page_of(m, b) != [0]
    c = m.alloc(2)  # the smallest page that fits the whole run: page 0 (2 free), not page 1 (5 free)
    assert page_of(m, c) == page_of(m, a)
    d = m.alloc(4)  # fits page 1 (5 free)
    assert page_of(m, d) == page_of(m, b)
    e = m.alloc(3)  # 1 free on page 1 only: a fresh page is needed anyway and takes the whole run
    check_invariants(m)
    assert len(e) == 3 and len(page_of(m, e)) == 1 and page_of(m, e)[0] not in page_of(m, a + b)
    f = m.alloc(12)  # 1 + 5 free held, needs one fresh page (8) -> 8 there, 4 on held pages
    new = set(page_of(m, f)) - set(page_of(m, a + b + e))
    assert len(f) == 12 and len(new) == 1 and m.get_page_occupancy(new) == {new.pop(): 8}
    assert m.stats()["held_pages"] == 4  # no more pages mapped than filling holes first would
    for g in (a, b, c, d, e, f):
        m.free(g)
    check_invariants(m)


def test_fast_path_makes_no_call_into_the_page_allocator(make):
    m = make()
    keep = m.alloc(1)  # the page stays held

    calls = []

    def profile(frame, event, arg):  # every call of a C++ function of kvcached._C
        owner = getattr(arg, "__self__", None)
        if event == "c_call" and (owner is _C or type(owner).__module__ == "kvcached._C"):
            calls.append(arg.__name__)

    sys.setprofile(profile)
    try:
        for _ in range(1000):
            m.free(m.alloc(1))
    finally:
        sys.setprofile(None)
    assert calls == []
    m.free(keep)
    check_invariants(m)


def test_empty_page_goes_to_reserve_then_unmapped(make, device):
    m = make(per_page=4, max_reserved=2)
    base = physical_bytes(device)
    per_page = m.bytes_per_page
    groups = [m.alloc(4) for _ in range(4)]  # four full pages
    assert m.get_mapped_memory_size() == 4 * per_page
    assert physical_bytes(device) - base == 4 * per_page
    for g in groups:
        m.free(g)
    # Two pages kept mapped in the reserve (its cap), two unmapped.
    st = m.stats()
    assert st["held_pages"] == 0 and st["reserve_pages"] == 2 and st["mapped_pages"] == 2
    assert physical_bytes(device) - base == 2 * per_page
    assert m.get_mapped_memory_size("kb") == 2 * per_page / 1024
    assert m.trim() == 2
    assert m.get_mapped_memory_size() == 0 and physical_bytes(device) == base
    check_invariants(m)


def test_data_survives_while_other_pages_come_and_go(make):
    m = make(per_page=4, max_reserved=0)
    keep = m.alloc(2)
    layers = _C.raw_kv_tensors(0)
    views = [torch.utils.dlpack.from_dlpack(c) for c in layers]
    B = m.block_mem_size
    for v in views:
        for b in keep:
            v[b * B : (b + 1) * B].fill_(b + 1)
            v[m.mem_size + b * B : m.mem_size + (b + 1) * B].fill_(100 + b)  # V buffer
    for _ in range(5):
        m.free(m.alloc(12))  # other pages mapped and unmapped around it
    for v in views:
        for b in keep:
            assert bool((v[b * B : (b + 1) * B] == b + 1).all())
            assert bool((v[m.mem_size + b * B : m.mem_size + (b + 1) * B] == 100 + b).all())


def test_exhaustion_returns_none_and_changes_nothing(make):
    m = make(pages=2, per_page=4)
    ids = m.alloc(8)
    assert m.available_size() == 0
    before = snapshot(m)
    assert m.alloc(1) is None
    assert snapshot(m) == before
    m.free(ids[:1])
    assert m.alloc(1) == ids[:1]


def test_available_size_respects_limit_and_is_exact(make):
    m = make(pages=8, per_page=4, max_reserved=0)
    a = m.alloc(2)
    m.set_mem_limit(3 * m.bytes_per_page)  # one held page + 2 more
    avail = m.available_size()
    assert avail == 2 + 2 * 4
    assert m.logical_free_size() == 32 - 2
    before = snapshot(m)
    assert m.alloc(avail + 1) is None
    assert snapshot(m) == before
    b = m.alloc(avail)
    assert b is not None and m.available_size() == 0
    m.free(a + b)
    check_invariants(m)


def test_partial_last_page_is_counted_exactly(make):
    m = make(per_page=8, num_blocks=8 * 3 + 3)  # 3 full pages and one with 3 blocks
    assert m.geometry.num_pages == 4 and m.geometry.caps[-1] == 3
    assert m.available_size() == 27
    m.set_mem_limit(1 * m.bytes_per_page)
    # The allocator hands out the lowest free page first: page 0, 8 blocks, not the last's 3
    # (counted as the next page until 12-06, so under a limit an engine saw fewer than it had).
    assert m.available_size() == 8
    got = m.alloc(8)
    assert got is not None and page_of(m, got) == [0] and m.available_size() == 0
    m.free(got)
    m.set_mem_limit(3 * m.bytes_per_page)
    assert m.available_size() == 24
    m.set_mem_limit(4 * m.bytes_per_page)  # every page: the last one comes too
    assert m.available_size() == 27
    got = m.alloc(27)
    assert got is not None and page_of(m, got) == [0, 1, 2, 3]
    m.free(got)
    check_invariants(m)


def test_a_partial_last_page_in_the_reserve_counts_as_the_next_page(make):
    """A reserved page is handed out before any free one: a last page that was freed into
    the reserve is counted as it comes (worst case), and the count holds what alloc gives."""
    m = make(per_page=8, num_blocks=8 * 4 + 3, max_reserved=2)  # caps 8, 8, 8, 8, 3
    ids = m.alloc(35)
    by_page = {p: [b for b in ids if m.get_page_id(b) == p] for p in range(5)}
    for p in (4, 3, 2):  # the reserve keeps pages 4 and 3; page 2 is unmapped, free
        m.free(by_page[p])
    pa = m.page_allocator
    assert pa.is_page_reserved(4) and pa.is_page_reserved(3) and not pa.is_page_reserved(2)
    m.set_mem_limit(4 * m.bytes_per_page)  # mapped: 2 held + 2 reserved: the reserve only
    assert m.available_size() == 8 + 3
    got = m.alloc(11)
    assert got is not None and page_of(m, got) == [3, 4]
    m.free(got + by_page[0] + by_page[1])
    check_invariants(m)


# ----------------------------------------------------------------- rollback


def test_map_fault_during_alloc_rolls_back_exactly(make):
    m = make(per_page=4, max_reserved=4)
    held = m.alloc(2)  # page with 2 free
    assert m.try_to_reserve(3)  # 2 from the held page + 1 on a fresh page
    reserved = m.snapshot()["reserved"]
    before = snapshot(m)
    _C.inject_fault("map", 2)  # the second map of the next allocation fails
    with pytest.raises(BackendError):
        m.alloc(3 + 4 * 3)  # reserved ones, the held free ones, then three fresh pages
    assert snapshot(m)["owned"] == before["owned"]
    assert m.snapshot()["reserved"] == reserved  # put back in their order
    assert snapshot(m)["pages"] == before["pages"]
    check_invariants(m)
    _C.clear_faults()
    got = m.alloc(5)
    assert got[:3] == reserved
    m.free(got + held)
    check_invariants(m)


def test_unmap_fault_on_free_keeps_page_mapped_and_ledger_consistent(make):
    m = make(per_page=4, max_reserved=0)
    ids = m.alloc(4)
    _C.inject_fault("unmap", 1)
    m.free(ids)  # the data plane rolls the unmap back; the page stays in the reserve
    check_invariants(m)
    assert m.stats()["reserve_pages"] == 1
    assert m.trim() == 1
    check_invariants(m)


# ------------------------------------------------------------- reservation


def test_try_to_reserve_and_free_reserved(make):
    m = make(pages=2, per_page=4)
    assert m.try_to_reserve(3)
    assert m.stats()["reserved_blocks"] == 3 and m.available_size() == 8  # reserved count as available
    assert m.try_to_reserve(2)  # already have >= 2
    assert m.stats()["reserved_blocks"] == 3
    assert not m.try_to_reserve(9)
    assert m.stats()["reserved_blocks"] == 3
    with pytest.raises(InvalidArgumentError, match="reserved"):
        m.free([m.snapshot()["reserved"][0]])
    got = m.alloc(1)
    assert m.stats()["reserved_blocks"] == 2
    m.free_reserved()
    assert m.snapshot()["reserved"] == [] and m.available_size() == 7
    m.free(got)
    check_invariants(m)


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize("n", [0, -3, 1.0, "2", None, True])
def test_alloc_bad_size(make, n):
    m = make()
    m.alloc(2)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError):
        m.alloc(n)
    with pytest.raises(InvalidArgumentError):
        m.try_to_reserve(n)
    assert snapshot(m) == before


def test_bad_free_changes_nothing(make):
    m = make(reserve_null_block=True)
    ids = m.alloc(3)
    before = snapshot(m)
    cases = [
        ([ids[0], 999999], "out of range"),
        ([ids[0], -1], "out of range"),
        ([ids[1], 40], "not allocated"),  # 40: never handed out
        ([ids[2], ids[2]], "not allocated"),  # twice in one call
        ([0], "null block"),
        (["a"], "integers"),
        ([1.0], "integers"),
    ]
    for bad, why in cases:
        with pytest.raises(InvalidArgumentError, match=why):
            m.free(bad)
        assert snapshot(m) == before, bad
    m.free(ids)
    with pytest.raises(InvalidArgumentError, match="not allocated"):
        m.free([ids[0]])  # double free, fast path
    with pytest.raises(InvalidArgumentError, match="not allocated"):
        m.free(ids)  # double free, general path
    check_invariants(m)
    assert m.available_size() == m.num_blocks - 1


@pytest.mark.parametrize("bad", [-1, -4096, 1.5, None])
def test_resize_bad_input(make, bad):
    m = make()
    m.alloc(3)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError):
        m.resize(bad)
    with pytest.raises(InvalidArgumentError, match="virtual capacity"):
        m.resize(m.mem_size + m.page_size)
    assert snapshot(m) == before


# ------------------------------------------------------------------ resize


def test_resize_grows_at_once_and_shrinks_gradually(make):
    m = make(pages=8, per_page=4, max_reserved=0)
    P = m.page_size
    groups = [m.alloc(4) for _ in range(6)]  # pages 0..5 full
    pages = [page_of(m, g)[0] for g in groups]
    assert pages == list(range(6))
    assert not m.resize(3 * P)  # pages 3, 4, 5 hold live blocks: gradual
    check_invariants(m)
    assert m.available_size() == 0  # nothing past the target is offered
    m.free(groups[4][:2])  # page 4 half free: not offered again
    assert m.available_size() == 0
    assert m.alloc(1) is None
    m.free(groups[4][2:])  # page 4 drained -> released at once
    assert 4 not in m.get_page_occupancy() and m.stats()["mapped_pages"] == 5
    m.free(groups[1])  # page 1, inside the target: reusable
    assert m.available_size() == 4
    m.free(groups[3] + groups[5])
    assert m.resize(3 * P) is True  # pages 0 and 2 remain
    assert all(pid < 3 for pid in m.get_page_occupancy())
    check_invariants(m)
    assert m.resize(8 * P) is True  # grow: at once
    assert m.available_size() == 32 - 8
    check_invariants(m)
    got = m.alloc(24)
    assert got is not None
    m.free(got + groups[0] + groups[2])
    check_invariants(m)


def test_resize_to_zero_and_back(make):
    m = make(pages=4, per_page=4, max_reserved=4)
    a = m.alloc(2)
    m.free(m.alloc(8))  # pages to the reserve
    assert m.stats()["reserve_pages"] > 0
    assert not m.resize(0)
    assert m.stats()["reserve_pages"] == 0  # reserve past the target is unmapped at once
    assert m.available_size() == 0
    m.free(a)
    assert m.stats()["mapped_pages"] == 0
    assert m.resize(4 * m.page_size)
    assert m.available_size() == 16


# ------------------------------------------------------- deferred release


def test_deferred_release_waits_for_marker(make, device):
    m = make(per_page=4, max_reserved=0, defer_physical_release=True)
    a = m.alloc(4)
    b = m.alloc(4)
    early = m.capture_physical_release_marker()  # captured before the pages empty
    m.free(a)
    m.free(b)
    check_invariants(m)
    assert m.stats()["mapped_pages"] == 2  # still mapped: a queued batch may read them
    assert m.release_retired_pages_through(early) == 0
    marker = m.capture_physical_release_marker()
    c = m.alloc(4)  # reuses a retired page (no map); it must not be released
    assert set(page_of(m, c)) <= {page_of(m, a)[0], page_of(m, b)[0]}
    assert m.release_retired_pages_through(marker) == 1
    assert m.stats()["mapped_pages"] == 1
    m.free(c)  # empties again: waits for a newer marker
    assert m.release_retired_pages_through(marker) == 0
    assert m.release_retired_pages_through(m.capture_physical_release_marker()) == 1
    assert m.stats()["mapped_pages"] == 0
    check_invariants(m)
    with pytest.raises(InvalidArgumentError, match="not captured"):
        m.release_retired_pages_through(10**6)


# -------------------------------------------------------------- misc API


def test_clear_keeps_null_block(make):
    m = make(reserve_null_block=True)
    assert m.null_block == [0]
    m.alloc(5)
    m.try_to_reserve(2)
    m.clear()
    assert out_ids(m) == {0}
    assert m.available_size() == m.num_blocks - 1
    check_invariants(m)
    assert m.alloc(1) != [0]


def test_page_occupancy(make):
    m = make(per_page=4)
    a = m.alloc(3)
    b = m.alloc(4)
    occ = m.get_page_occupancy()
    assert sorted(occ.values()) == [3, 4]
    pid = m.get_page_id(a[0])
    assert m.get_page_occupancy([pid, 7]) == {pid: 3, 7: 0}
    with pytest.raises(InvalidArgumentError):
        m.get_page_occupancy([99])
    m.free(a + b)


def test_get_mapped_memory_size_units(make):
    m = make()
    ids = m.alloc(1)
    n = m.bytes_per_page
    assert m.get_mapped_memory_size() == n
    assert m.get_mapped_memory_size("MB") == n / (1 << 20)
    with pytest.raises(InvalidArgumentError):
        m.get_mapped_memory_size("pages")
    m.free(ids)


def test_prealloc_thread_fills_reserve(make):
    import time

    m = make(min_reserved=2, max_reserved=3)
    end = time.monotonic() + 5
    while m.stats()["reserve_pages"] < 2 and time.monotonic() < end:
        time.sleep(0.01)
    assert m.stats()["reserve_pages"] == 2
    ids = m.alloc(m.geometry.max_blocks_per_page)  # served from the reserve
    assert ids is not None
    m.free(ids)


def test_python_mappers_path(make, vmm):
    calls = []

    def map_fn(offsets):
        calls.append(("map", list(offsets)))
        vmm.map_to_kv_tensors(offsets)

    def unmap_fn(offsets):
        calls.append(("unmap", list(offsets)))
        vmm.unmap_from_kv_tensors(offsets)

    m = make(per_page=4, max_reserved=0, map_fn=map_fn, unmap_fn=unmap_fn)
    ids = m.alloc(6)
    assert [c[0] for c in calls] == ["map"] and len(calls[0][1]) == 2
    check_invariants(m)
    m.free(ids)
    assert [c[0] for c in calls] == ["map", "unmap"]
    check_invariants(m)


def test_own_segment_record_and_limit(make, monkeypatch):
    """own_segment: the pool's record shows its usage, and a limit written like
    `kvctl limit` does caps what available_size promises and alloc maps."""
    import time

    from kvcached import control

    monkeypatch.setenv("KVCACHED_CAPACITY_TTL_MS", "0")
    name = f"kvcached_test_mgr_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    m = make(per_page=4, pages=8, max_reserved=0, own_segment=True, pool_name=name, engine="test")
    assert m.pool_name == name
    ids = m.alloc(5)
    snap = _C.MemInfoTracker.open(name).snapshot()
    assert snap.used == 2 * m.bytes_per_page and snap.total == m.geometry.num_pages * m.bytes_per_page
    res = control.set_instance_memory_limit(3 * m.bytes_per_page, name=name, wait_s=2.0)
    assert res.status == "applied", res
    end = time.monotonic() + 2
    while m.available_size() != 3 + 4 and time.monotonic() < end:
        time.sleep(0.01)
    assert m.available_size() == 3 + 4  # 3 free on held pages + one more page under the cap
    assert m.alloc(8) is None
    more = m.alloc(7)
    assert more is not None and m.get_mapped_memory_size() <= 3 * m.bytes_per_page
    m.free(ids + more)
    m.shutdown()
    assert name not in _C.list_mem_info_records()


def test_shutdown_releases_and_refuses_work(make, device):
    m = make(max_reserved=4)
    base = physical_bytes(device)  # the zero page only
    ids = m.alloc(20)
    m.shutdown()
    assert physical_bytes(device) <= base
    for call in (lambda: m.alloc(1), lambda: m.free(ids[:1]), lambda: m.free(ids), lambda: m.resize(0)):
        with pytest.raises(ShutdownError):
            call()
    assert m.available_size() == 0
    m.shutdown()  # idempotent


def test_threads_never_share_an_id(make):
    m = make(pages=16, per_page=8, max_reserved=4)
    errors = []
    held = [[] for _ in range(4)]

    def worker(i):
        try:
            for j in range(400):
                got = m.alloc(1 + (i + j) % 5)
                if got is not None:
                    held[i].append(got)
                if len(held[i]) > 3:
                    m.free(held[i].pop(0))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    live = [b for h in held for g in h for b in g]
    assert len(live) == len(set(live))
    assert out_ids(m) == set(live)
    check_invariants(m)
