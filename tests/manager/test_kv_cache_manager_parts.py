"""KVCacheManager's parts and seams: the block index and ledger invariant checks
(corrupted on purpose), parked pages (the grace after a page empties), and the
injected mapper / limits / release barrier."""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import pytest

from kvcached import _C
from kvcached.block_geometry import BlockGeometry
from kvcached.block_index import BlockIndex
from kvcached.block_ledger import OUT, BlockLedger
from kvcached.compat.manager_args import AUTO, FunctionMapper, build_collaborators
from kvcached.errors import InvalidArgumentError, StateConsistencyError
from kvcached.kv_cache_manager import KVCacheManager
from kvcached.manager_setup import limits_factory
from manager_helpers import check_invariants
from vmm_helpers import physical_bytes

BLOCK_TOKENS = 16
LAYERS = 2
GRACE_BOUND_S = 1.0  # parked pages go within this when idle (the contract)
LONG = 3600.0  # a grace no test waits for: only the call under test ends it


@pytest.fixture
def make(vmm, device, page_size, monkeypatch):
    """A manager over fresh KV tensors: ``per_page`` blocks per page, ``pages`` pages."""
    made = []

    def _make(per_page=8, pages=8, max_reserved=2, **kw):
        monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
        monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", str(max_reserved))
        cell = page_size // (per_page * BLOCK_TOKENS)
        n = pages * per_page
        vmm.create_kv_tensors(n * BLOCK_TOKENS * cell, 2, device, LAYERS, 2)
        m = KVCacheManager(n, BLOCK_TOKENS, cell, LAYERS, **kw)
        made.append(m)
        return m

    yield _make
    for m in made:
        m.shutdown()


def c_calls(fn):
    """Runs fn; returns the names of the kvcached._C functions it called."""
    calls = []

    def profile(frame, event, arg):
        owner = getattr(arg, "__self__", None)
        if event == "c_call" and (owner is _C or type(owner).__module__ == "kvcached._C"):
            calls.append(arg.__name__)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def wait_for(cond, bound_s):
    end = time.monotonic() + bound_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


# ------------------------------------------------------------ block index


def _index(pages=4, per_page=8):
    geo = BlockGeometry(pages * per_page, 16, 64, per_page * 16 * 64)
    ix = BlockIndex(geo)
    for pid in range(2):
        ix.shelve(ix.adopt(pid))
    return ix


def test_index_picks_the_smallest_page_that_fits():
    ix = _index()
    out = []
    assert ix.take(6, out) == 0 and len({ix.geometry.page_of(b) for b in out}) == 1  # one page: 2 left
    got = []
    assert ix.take(2, got) == 0
    assert {ix.geometry.page_of(b) for b in got} == {ix.geometry.page_of(out[0])}  # the page with 2, not 8
    ix.check()
    assert ix.put(out + got) and ix.nfree == 16
    ix.check()


@pytest.mark.parametrize(
    "corrupt,invariant",
    [
        (lambda ix: setattr(ix, "mask", ix.mask ^ 0b10), "I2 mask"),
        (lambda ix: setattr(ix, "nfree", ix.nfree + 1), "I3 nfree"),
        (lambda ix: ix.held[0].append(ix.held[0][-1]), "I1 bucket"),  # a block free twice, filed wrong
        (lambda ix: ix.buckets[7].update(ix.buckets[8]), "I1 bucket"),  # a page filed under two counts
        (lambda ix: ix.held[1].append(0), "I1 bucket"),  # page 1 lists page 0's block
        (lambda ix: ix.unheld_caps.__setitem__(8, 9), "I5 unheld"),
        (lambda ix: setattr(ix.held[0], "open", False), "I1 bucket"),
    ],
)
def test_index_check_names_the_broken_invariant(corrupt, invariant):
    ix = _index()
    ix.take_one()  # page 0 (or 1) now in bucket 7
    ix.check()
    corrupt(ix)
    with pytest.raises(StateConsistencyError, match=invariant):
        ix.check()


def test_ledger_check_names_the_broken_invariant():
    ix = _index()
    led = BlockLedger(ix.geometry.num_blocks)
    b = ix.take_one()
    led.states[b] = OUT
    keep_empty = lambda pid: True  # noqa: E731  (the other held page is empty)
    led.check(ix, keep_empty)
    led.states[b + 1] = OUT  # marked out but still filed free
    with pytest.raises(StateConsistencyError, match="L1 free"):
        led.check(ix, keep_empty)
    led.states[b + 1] = 0
    led.states[31] = OUT  # out on a page nobody holds
    with pytest.raises(StateConsistencyError, match="L2 out"):
        led.check(ix, keep_empty)
    led.states[31] = 0
    led.reserved.append(b)
    with pytest.raises(StateConsistencyError, match="L3 reserved"):
        led.check(ix, keep_empty)
    led.reserved.clear()
    # An empty held page is allowed only where the caller says it may keep it.
    with pytest.raises(StateConsistencyError, match="L4 empty"):
        led.check(ix, lambda pid: False)


def test_manager_check_invariants_is_public_and_silent_when_consistent(make):
    m = make()
    ids = m.alloc(11)
    m.check_invariants()
    m.free(ids)
    m.check_invariants()
    m.shutdown()
    m.check_invariants()  # a no-op after shutdown


# ---------------------------------------------------------- parked pages


def test_a_parked_page_is_reused_without_a_call_into_cpp(make):
    m = make(empty_page_grace_s=LONG)
    b = m.alloc(1)
    m.free(b)
    st = m.stats()
    assert st["parked_pages"] == 1 and st["held_pages"] == 1 and st["inuse_pages"] == 1
    assert m.available_size() == m.logical_free_size() == m.num_blocks  # parked blocks count as free
    check_invariants(m)

    def lone_request():
        for _ in range(500):
            m.free(m.alloc(1))

    assert c_calls(lone_request) == []
    assert m.alloc(1) == b  # the same page, the same lowest block
    assert m.stats()["parked_pages"] == 0  # in use again
    check_invariants(m)


def test_parked_pages_are_bounded(make):
    m = make(per_page=4, max_reserved=0, empty_page_grace_s=LONG)
    groups = [m.alloc(4) for _ in range(8)]
    for g in groups:
        m.free(g)
    st = m.stats()
    assert st["parked_pages"] == st["held_pages"] == 4 and st["mapped_pages"] == 4  # MAX_PARKED_PAGES
    check_invariants(m)


def test_a_parked_page_goes_within_a_second_when_idle(make, device):
    m = make(max_reserved=0)  # the default grace; released pages are unmapped
    base = physical_bytes(device)
    m.free(m.alloc(1))
    assert m.stats()["parked_pages"] == 1
    assert wait_for(lambda: m.stats()["held_pages"] == 0, GRACE_BOUND_S + 0.5)
    assert m.get_mapped_memory_size() == 0 and physical_bytes(device) <= base
    check_invariants(m)
    # The timer sleeps once nothing is parked, and wakes for the next page.
    m.free(m.alloc(3))
    assert wait_for(lambda: m.stats()["held_pages"] == 0, GRACE_BOUND_S + 0.5)


def test_release_parked_and_trim_release_at_once(make):
    m = make(max_reserved=2, empty_page_grace_s=LONG)
    m.free(m.alloc(1))
    assert m.release_parked() == 1
    st = m.stats()
    assert st["held_pages"] == 0 and st["reserve_pages"] == 1  # like any emptied page: into the reserve
    assert m.release_parked() == 0
    m.free(m.alloc(1))
    assert m.stats()["parked_pages"] == 1
    assert m.trim() == 1  # parked page released, then the reserve unmapped
    assert m.get_mapped_memory_size() == 0
    check_invariants(m)


def test_shutdown_releases_parked_pages_and_ends_the_timer(make, device):
    m = make(max_reserved=0, empty_page_grace_s=0.05)
    base = physical_bytes(device)
    m.free(m.alloc(1))
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("kvcached-grace") for n in names)
    m.free(m.alloc(1))
    m.shutdown()
    assert physical_bytes(device) <= base
    assert not any(t.name.startswith("kvcached-grace") and t.is_alive() for t in threading.enumerate())


def test_set_mem_limit_below_mapped_takes_parked_pages_at_once(make):
    m = make(per_page=4, max_reserved=0, empty_page_grace_s=LONG)
    keep = m.alloc(1)
    m.free(m.alloc(4))
    m.free(m.alloc(4))  # the same parked page again
    extra = m.alloc(8)
    m.free(extra)  # two more parked pages
    assert m.stats()["parked_pages"] == 2 and m.stats()["mapped_pages"] == 3
    m.set_mem_limit(1 * m.bytes_per_page)
    st = m.stats()
    assert st["parked_pages"] == 0 and st["mapped_pages"] == 1  # only the live page
    m.free(m.alloc(3))  # fills keep's page: nothing new
    assert m.alloc(4) is None  # a page past the limit cannot be had
    m.set_mem_limit(-1)
    m.free(m.alloc(4))
    assert m.stats()["parked_pages"] == 1  # under the cap again: parking resumes
    m.free(keep)
    check_invariants(m)


def test_a_lowered_record_limit_takes_parked_pages_at_once(make, monkeypatch):
    from kvcached import control

    monkeypatch.setenv("KVCACHED_CAPACITY_TTL_MS", "0")
    name = f"kvcached_test_park_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    m = make(per_page=4, max_reserved=0, own_segment=True, pool_name=name, engine="test", empty_page_grace_s=LONG)
    keep = m.alloc(1)
    m.free(m.alloc(8))  # two parked pages
    assert m.stats()["parked_pages"] == 2 and m.get_mapped_memory_size() == 3 * m.bytes_per_page
    res = control.set_instance_memory_limit(1 * m.bytes_per_page, name=name, wait_s=2.0)
    assert res.status in ("applied", "deferred"), res
    # Applied means enforced: the parked pages went with the limit, not with the grace.
    assert wait_for(lambda: m.get_mapped_memory_size() == m.bytes_per_page, 2.0)
    assert m.stats()["parked_pages"] == 0
    m.free(keep)
    check_invariants(m)


def test_deferred_release_parks_nothing_and_keeps_marker_semantics(make):
    m = make(max_reserved=0, defer_physical_release=True, empty_page_grace_s=0.05)
    m.free(m.alloc(1))
    st = m.stats()
    assert st["parked_pages"] == 0 and st["retired_pages"] == 1 and st["held_pages"] == 1
    time.sleep(0.2)  # no grace thread releases a retired page
    assert m.stats()["held_pages"] == 1
    marker = m.capture_physical_release_marker()
    assert m.release_parked() == 0 and m.stats()["held_pages"] == 1
    assert m.release_retired_pages_through(marker) == 1
    assert m.stats()["held_pages"] == 0
    check_invariants(m)


def test_grace_zero_releases_at_once(make):
    m = make(max_reserved=0, empty_page_grace_s=0)
    m.free(m.alloc(1))
    assert m.stats()["held_pages"] == 0 and m.get_mapped_memory_size() == 0
    with pytest.raises(InvalidArgumentError, match="grace"):
        KVCacheManager(64, 16, 64, LAYERS, empty_page_grace_s=-1)


# ------------------------------------------------------ injected collaborators


def test_injected_mapper_maps_every_page(make, vmm):
    calls = []

    class Mapper:
        def map(self, offsets):
            calls.append(("map", list(offsets)))
            vmm.map_to_kv_tensors(offsets)

        def unmap(self, offsets):
            calls.append(("unmap", list(offsets)))
            vmm.unmap_from_kv_tensors(offsets)

    mapper = Mapper()
    m = make(per_page=4, max_reserved=0, mapper=mapper, empty_page_grace_s=0)
    assert m.mapper is mapper
    ids = m.alloc(6)
    assert [c[0] for c in calls] == ["map"] and len(calls[0][1]) == 2
    m.free(ids)
    assert [c[0] for c in calls] == ["map", "unmap"]
    check_invariants(m)
    with pytest.raises(InvalidArgumentError, match="not both"):
        KVCacheManager(64, 16, 64, LAYERS, mapper=mapper, map_fn=mapper.map, unmap_fn=mapper.unmap)


def test_injected_limits_admit_every_fresh_page_and_close_at_shutdown(make):
    seen = {}

    class Limits:
        name = f"kvcached_test_inj_{os.getpid()}"
        reclaim_unused = None

        def __init__(self, pa):
            seen["pa"] = pa
            self.admitted, self.freed, self.closed = [], 0, False

        def admit_pages(self, n):
            self.admitted.append(n)

        def on_free(self):
            self.freed += 1

        def num_free_pages(self):
            return seen["pa"].get_num_free_pages()

        def close(self):
            self.closed = True

    m = make(per_page=4, max_reserved=0, limits=Limits, empty_page_grace_s=LONG)
    lim = m.limits
    assert seen["pa"] is m.page_allocator and m.pool_name == Limits.name
    assert callable(lim.reclaim_unused)  # the manager's hook for a lowered limit
    m.free(m.alloc(6))
    assert lim.admitted == [2]
    assert m.stats()["parked_pages"] == 2 and lim.reclaim_unused() == 2 and lim.freed == 1
    m.shutdown()
    assert lim.closed
    assert lim.reclaim_unused() == 0  # after shutdown: nothing, no error
    with pytest.raises(InvalidArgumentError, match="not both"):
        KVCacheManager(64, 16, 64, LAYERS, limits=Limits, own_segment=True, device="cpu")


def test_injected_release_barrier_runs_before_every_release(make):
    events = []
    # The barrier runs under the manager's lock: it reads the allocator, not the manager.
    m = make(per_page=4, max_reserved=0, empty_page_grace_s=0,
             release_barrier=lambda: events.append(m.page_allocator.get_num_mapped_pages()))  # fmt: skip
    keep = m.alloc(1)
    assert c_calls(lambda: [m.free(m.alloc(1)) for _ in range(10)]) == [] and events == []  # fast path: none
    m.free(m.alloc(8))
    assert events == [3]  # called once for the two pages, while they were still mapped
    m.free(keep)
    assert events == [3, 1]


def test_the_barrier_also_runs_on_the_grace_thread(make):
    threads = []
    m = make(max_reserved=0, release_barrier=lambda: threads.append(threading.current_thread().name),
             empty_page_grace_s=0.05)  # fmt: skip
    m.free(m.alloc(1))
    assert wait_for(lambda: threads, GRACE_BOUND_S)
    assert threads[0].startswith("kvcached-grace")


def test_build_collaborators_keeps_the_old_defaults():
    kw = dict(world_size=1, pp_rank=0, group_id=0, async_sched=True, defer_physical_release=False,
              own_segment=False, map_fn=None, unmap_fn=None, engine="x", device="cuda:0", pool_name=None,
              mapper=None, limits=None, release_barrier=AUTO)  # fmt: skip
    mapper, limits, barrier = build_collaborators(**kw)
    assert mapper is None and limits is None and callable(barrier)  # async + local CUDA: sync before release
    for change in ({"async_sched": False}, {"defer_physical_release": True}, {"device": "cpu"}):
        assert build_collaborators(**{**kw, **change})[2] is None
    f = lambda offsets: None  # noqa: E731
    mapper, _, barrier = build_collaborators(**{**kw, "map_fn": f, "unmap_fn": f})
    assert isinstance(mapper, FunctionMapper) and mapper.map is f and barrier is None  # workers map: no local sync
    assert build_collaborators(**{**kw, "release_barrier": None})[2] is None
    _, limits, _ = build_collaborators(**{**kw, "own_segment": True, "pool_name": "p"})
    assert limits.keywords == limits_factory(engine="x", device="cuda:0", name="p").keywords
    with pytest.raises(InvalidArgumentError, match="device"):
        build_collaborators(**{**kw, "own_segment": True, "device": None})
    with pytest.raises(InvalidArgumentError, match="both"):
        build_collaborators(**{**kw, "map_fn": f})


# ------------------------------------------------- the hot calls' lock and count


def test_token_lock_excludes_and_hands_over():
    from kvcached.locks import TokenLock

    lock = TokenLock()
    lock.try_enter()
    assert lock.locked()
    with pytest.raises(IndexError):
        lock.try_enter()
    assert not lock.acquire(blocking=False)
    got = []

    def waiter():
        with lock:
            got.append(lock.locked())

    t = threading.Thread(target=waiter)
    t.start()
    t.join(0.05)
    assert not got  # still waiting for the token
    lock.leave(True)
    t.join(10)
    assert got == [True] and not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()
    with lock:
        with pytest.raises(IndexError):
            lock.try_enter()
    assert not lock.locked()


def test_token_lock_never_lets_two_in():
    from kvcached.locks import TokenLock

    lock = TokenLock()
    inside, overlaps = [0], []

    def section():
        inside[0] += 1
        if inside[0] != 1:
            overlaps.append(inside[0])
        time.sleep(0)  # let another thread try now
        inside[0] -= 1

    def fast(n):
        for _ in range(n):
            try:
                lock.try_enter()
            except IndexError:
                with lock:
                    section()
                continue
            try:
                section()
            finally:
                lock.leave(True)

    def slow(n):
        for _ in range(n):
            with lock:
                section()

    threads = [threading.Thread(target=f, args=(300,)) for f in (fast, fast, slow, slow)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not overlaps and not lock.locked()


def _fresh_count(m):
    """available_size counted from the data plane now (what the kept count must equal)."""
    with m._lock:
        m._supply.changed()
    return m.available_size()


def test_available_size_kept_count_follows_every_change(make):
    m = make(per_page=4, pages=8, max_reserved=2, reserve_null_block=True, empty_page_grace_s=LONG)
    steps = [
        lambda: m.alloc(1),
        lambda: m.alloc(6),  # fresh pages
        lambda: m.free(held.pop()),
        lambda: m.try_to_reserve(5),
        lambda: m.alloc(2),  # from the reserved ones
        lambda: m.free_reserved(),
        lambda: m.free(held.pop()),  # a page empties: parked
        lambda: m.release_parked(),
        lambda: m.trim(),
        lambda: m.alloc(9),
        lambda: m.clear(),
        lambda: m.capacity_changed(),
    ]
    held = []
    for i, step in enumerate(steps):
        m.available_size()  # a count is kept (unless the TTL just ran out)
        out = step()
        if isinstance(out, list):
            held.append(out)
        assert m.available_size() == _fresh_count(m), f"step {i}"
        check_invariants(m)
    m.shutdown()
    assert m.available_size() == 0 and m._supply.rest == -1


def test_available_size_kept_count_expires_and_the_timer_sleeps(make):
    m = make(per_page=4, pages=8, max_reserved=0)
    n = m.available_size()
    assert wait_for(lambda: m.available_size() == n and m._supply.rest >= 0, 5.0)  # kept
    assert wait_for(lambda: m._supply.rest == -1, 5.0)  # one TTL later it is counted again
    assert wait_for(lambda: m._supply._expiry.idle, 5.0)  # nobody asks: the timer sleeps
    # A cap set outside the manager (like the limits watcher thread does) is seen after the TTL.
    m.available_size()
    m.page_allocator.set_mem_limit(m.bytes_per_page)
    assert wait_for(lambda: m.available_size() == 4, 5.0), (n, m.available_size())


def test_available_size_ttl_zero_keeps_no_count(make, monkeypatch):
    monkeypatch.setenv("KVCACHED_CAPACITY_TTL_MS", "0")
    m = make(per_page=4, pages=8, max_reserved=0)
    assert m.available_size() == 32 and m._supply.rest == -1
    m.page_allocator.set_mem_limit(m.bytes_per_page)
    assert m.available_size() == 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_available_size_kept_count_expires_in_a_forked_child(make, device):
    m = make(per_page=4, pages=8, max_reserved=0)
    assert wait_for(lambda: m.available_size() >= 0 and m._supply.rest >= 0, 5.0)
    pid = os.fork()
    if pid == 0:  # the child: the parent's timer thread does not run here
        ok = False
        try:
            ok = m._supply.rest == -1  # the count it inherited is dropped at the fork
            if device == "cpu":  # a forked child cannot use CUDA: counting anew asks the device
                m.available_size()  # kept again, and expired by the child's own timer thread
                ok = ok and wait_for(lambda: m._supply.rest == -1, 5.0)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_an_idle_timer_thread_ends_once_its_owner_is_gone():
    import gc

    from kvcached.page_release import GraceTimer

    class Owner:
        def tick(self):
            t.idle = True  # nothing to do: the thread goes to sleep without a timeout
            return True

    owner = Owner()
    t = GraceTimer(owner.tick, 0.01, "kvcached-test-timer")
    t.wake()
    assert wait_for(lambda: t.idle, 5.0)
    thread = t._thread
    del owner
    gc.collect()
    thread.join(5.0)
    assert not thread.is_alive()


def test_a_record_limit_is_seen_by_the_kept_count_once_applied_not_a_ttl_later(make, monkeypatch):
    """kvctl limit (raised or lowered) is applied on the limits' watcher thread: the
    kept count is cleared there, so the first available_size after the ack is fresh
    even with a TTL far longer than the test."""
    from kvcached import control

    monkeypatch.setenv("KVCACHED_CAPACITY_TTL_MS", "600000")
    name = f"kvcached_test_kept_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    m = make(per_page=4, pages=8, max_reserved=0, own_segment=True, pool_name=name, engine="test")
    for pages in (2, 6, 1):
        m.available_size()
        assert m._supply.rest >= 0  # kept
        res = control.set_instance_memory_limit(pages * m.bytes_per_page, name=name, wait_s=2.0)
        assert res.status == "applied", res
        assert m.available_size() == pages * 4, (pages, m.available_size())
    check_invariants(m)


def test_a_wanting_manager_keeps_no_count(make):
    """While its load wants memory the budget could not give, every available_size
    counts anew: a peer's give-back is seen by the next scheduling step."""
    name = f"kvcached_test_want_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    m = make(per_page=4, pages=8, max_reserved=0, own_segment=True, pool_name=name, engine="test")
    m.available_size()
    assert m._supply.rest >= 0
    m.limits._set_want(m.bytes_per_page)  # as note_shortage does when the budget is short
    m.capacity_changed()
    for _ in range(3):
        m.available_size()
        assert m._supply.rest == -1
    m.limits._set_want(0)
    m.available_size()
    assert m._supply.rest >= 0
