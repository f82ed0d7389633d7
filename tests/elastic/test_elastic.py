"""The engine-neutral elastic runtime (kvcached.elastic) on the host backend:
the release fence, pools against a real instance record and limit, idle
decisions, the prefix-cache bound, and the one reading of the variables both
engines share."""

from __future__ import annotations

import os
import re
import time

import pytest

from kvcached import config
from kvcached.elastic import ElasticInstance, ElasticPool, IdleAction, ReleaseFence, cache_excess_tokens
from kvcached.kv_cache_manager import KVCacheManager

KiB = 1 << 10
P = 128 * KiB


@pytest.fixture
def host_plane(monkeypatch):
    from kvcached import _C, vmm_ops

    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    _C.clear_faults()
    vmm_ops.init_kvcached("cpu", page_size=P, contiguous_layout=False)
    # 4 blocks of 32 KiB per 128 KiB page, 2 layers, one buffer.
    vmm_ops.create_kv_tensors(64 * 32 * KiB, 1, "cpu", num_layers=2, num_kv_buffers=1)
    yield vmm_ops
    vmm_ops.shutdown_kvcached()


def _manager(**kw) -> KVCacheManager:
    return KVCacheManager(
        64, 16, 2 * KiB, 2, reserve_null_block=True, num_kv_buffers=1, defer_physical_release=True, **kw
    )


def test_fence_waits_for_every_step_that_could_read_a_freed_page(host_plane):
    m = _manager()
    f = ReleaseFence([m])
    mapped = lambda: m.stats()["mapped_pages"]  # noqa: E731

    ids = m.alloc(4)  # a fresh page (page 0 holds the null block)
    assert mapped() == 2
    f.launched()  # step 1 reads ids
    f.launched()  # step 2 submitted before step 1's output (async scheduling)
    f.finished()  # step 1 finished
    f.depth += 1
    m.free(ids)  # the request finished in step 1's output; step 2 may still read its blocks
    f.depth -= 1
    f.settle()
    assert mapped() == 2, "released while step 2 could still read the page"
    f.after_free()  # inside no step, but step 2 is in flight
    assert mapped() == 2
    f.finished()  # step 2 finished: nothing in flight
    assert mapped() == 1
    # Synchronous pattern (CPU): a page freed after the step finished goes at once.
    ids = m.alloc(4)
    f.launched()
    f.finished()
    f.depth += 1
    m.free(ids)
    f.depth -= 1
    f.settle()
    assert mapped() == 1
    # A page emptied and refilled before the release stays mapped.
    ids = m.alloc(4)
    f.launched()
    f.launched()
    m.free(ids)
    again = m.alloc(4)
    f.finished()
    f.finished()
    assert mapped() == 2  # the reused page was kept
    m.free(again)
    f.after_free()
    assert mapped() == 1
    m.shutdown()


def test_fence_steps_finished_by_token_and_grace(host_plane):
    # SGLang's pattern: the step number travels on the batch result; releases
    # wait a grace period while busy and go at once when idle.
    m = _manager()
    f = ReleaseFence([m], grace_s=3600.0)
    ids = m.alloc(4)
    s1 = f.launched()
    m.free(ids)  # freed while step 1 runs
    s2 = f.launched()
    f.finished(s1)
    assert m.stats()["mapped_pages"] == 2  # step 2 may still read it
    f.finished(s2)
    assert m.stats()["mapped_pages"] == 2  # safe now, but within the grace period
    assert f.release_due(grace_s=0.0) == 1
    assert m.stats()["mapped_pages"] == 1
    ids = m.alloc(4)
    f.launched()
    m.free(ids)
    assert f.idle() == 1 and f.in_flight == 0  # idle: nothing in flight, released at once
    m.shutdown()


def test_fence_of_a_closed_instance_releases_nothing(host_plane):
    m = _manager()
    inst = ElasticInstance("x", [ElasticPool(m)])
    ids = m.alloc(4)
    m.free(ids)
    inst.close()
    assert inst.fence.idle() == 0 and m.stats()["mapped_pages"] == 2
    m.shutdown()


def test_a_watcher_poked_while_its_engine_is_busy_does_not_spin(host_plane):
    """A peer's poke stays set while the engine is busy (it may turn idle soon), and
    the watcher looks again every few milliseconds, not in a loop that holds a core."""
    import threading

    m = _manager()
    inst = ElasticInstance("spin", [ElasticPool(m)])
    calls, idle, ran = [0], threading.Event(), threading.Event()

    def busy() -> bool:
        calls[0] += 1
        return not idle.is_set()

    inst.poke.set()
    inst.peers_wanting = lambda: ["peer"]  # what a peer's want in the budget's records reads as
    inst.start_idle_watch(busy, lambda: True, lambda act: ran.set())
    time.sleep(0.3)
    busy_calls = calls[0]
    idle.set()  # the engine turns idle: the poke still set is acted on
    assert ran.wait(5)
    inst.close()
    m.shutdown()
    assert busy_calls < 300, busy_calls  # a spin makes ~10^5 calls in 0.3 s; 10 ms rechecks ~30


def test_pool_over_a_lowered_limit_and_the_idle_action(host_plane, prefix, monkeypatch):
    from kvcached import control

    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "64M")
    m = _manager(own_segment=True, pool_name=prefix + "a")
    pool = ElasticPool(m)
    inst = ElasticInstance(pool.name, [pool])
    assert pool.name == prefix + "a" and pool.limits is m.limits
    ids = m.alloc(12)  # 3 fresh pages + the null block's page
    assert pool.mapped_pages() == 4 and pool.live_pages() == 4
    assert pool.pages_over_limit() == 0 and inst.idle_action(check_peers=False) == IdleAction.NONE
    r = control.set_instance_memory_limit(2 * pool.bytes_per_page, name=pool.name, wait_s=5.0)
    assert r.status in ("applied", "deferred"), r
    assert pool.pages_over_limit() == 2 and pool.live_pages_over_limit() == 2
    assert inst.idle_action(check_peers=False) == IdleAction.SHRINK_TO_LIMIT
    m.free(ids[4:])  # two pages empty: retired, still mapped until the fence releases them
    assert pool.live_pages() == 2 and pool.live_pages_over_limit() == 0 and pool.pages_over_limit() == 2
    assert inst.give_back() == 2  # idle: nothing in flight
    assert pool.pages_over_limit() == 0 and pool.released_pages == 2
    inst.close()
    m.shutdown()


def test_instance_sleep_unmaps_every_page_and_wake_maps_on_demand(host_plane, prefix, monkeypatch):
    """The engine's own sleep: every block freed (the adapter's part), then sleep() releases the
    retired pages and the null block's, unmaps the reserve and caps the pool at 0; wake()
    restores the limit and the next alloc maps the null block's page first."""
    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "64M")
    m = _manager(own_segment=True, pool_name=prefix + "z")
    pool = ElasticPool(m)
    inst = ElasticInstance(pool.name, [pool])
    ids = m.alloc(12)  # 3 fresh pages + the null block's page
    inst.fence.launched()  # a step reads them
    m.free(ids)  # retired: a launched step may still read them
    assert pool.mapped_pages() == 4
    left = inst.sleep()  # the engine synchronised: nothing in flight any more
    assert inst.asleep and left == 0 and pool.mapped_pages() == 0 and m.null_block is None
    # Nothing is mapped while asleep, the null block's page neither.
    assert m.available_size() == 0 and m.alloc(1) is None and pool.mapped_pages() == 0
    assert inst.sleep() == 0  # idempotent
    inst.wake()
    assert not inst.asleep
    again = m.alloc(4)  # page 0 (the null block and 3 more) and one page
    assert again is not None and m.null_block == [0] and 0 not in again and pool.mapped_pages() == 2
    m.free(again)
    monkeypatch.setenv("KVCACHED_KEEP_NULL_PAGE", "true")
    assert inst.sleep() == pool.bytes_per_page and m.null_block == [0]  # kept
    inst.wake()
    inst.close()
    m.shutdown()


def test_an_idle_give_back_releases_the_null_page_and_the_next_alloc_maps_it_first(host_plane, prefix, monkeypatch):
    """An idle instance's last page is its null block's: given back too once nothing else is
    left and no step is in flight, mapped again (page 0, block 0 held) by the next alloc."""
    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "64M")
    m = _manager(own_segment=True, pool_name=prefix + "n")
    pool = ElasticPool(m)
    inst = ElasticInstance(pool.name, [pool])
    ids = m.alloc(12)  # 3 fresh pages + the null block's page
    inst.fence.launched()
    m.free(ids)
    assert inst.give_back() == 0 and pool.mapped_pages() == 4  # a step in flight: retired, null kept
    inst.fence.finished()  # the retired pages go
    assert pool.mapped_pages() == 1 and m.null_block == [0]
    assert inst.give_back() == 1 and pool.mapped_pages() == 0  # then the null block's page too
    from kvcached.limits.records import list_records

    rec = next(r for r in list_records() if r.name == pool.name)
    assert m.null_block is None and rec.used == rec.prealloc == 0  # what kvctl list shows
    m.check_invariants()
    assert m.available_size() == m.logical_free_size() == 63  # every block but block 0
    again = m.alloc(4)
    assert again is not None and 0 not in again and m.null_block == [0]
    assert pool.mapped_pages() == 2 and m.get_page_occupancy()[0] >= 1  # page 0 first, then one for the run
    m.check_invariants()
    assert inst.give_back() == 0 and m.null_block == [0]  # a live block: the null page stays
    m.free(again)
    monkeypatch.setenv("KVCACHED_KEEP_NULL_PAGE", "true")
    assert inst.give_back() == 1 and pool.mapped_pages() == 1 and m.null_block == [0]  # kept
    inst.close()
    m.shutdown()


def test_an_alloc_refused_after_the_null_page_went_changes_nothing(host_plane, prefix, monkeypatch):
    """Page 0 comes back with the blocks asked for or not at all: a refused alloc (the limit
    fits page 0 but not the run) leaves the null page given back, as any refused alloc."""
    from kvcached import control

    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "64M")
    m = _manager(own_segment=True, pool_name=prefix + "r")
    pool = ElasticPool(m)
    inst = ElasticInstance(pool.name, [pool])
    m.free(m.alloc(4))
    assert inst.give_back() == 2 and pool.mapped_pages() == 0
    r = control.set_instance_memory_limit(pool.bytes_per_page, name=pool.name, wait_s=5.0)
    assert r.status == "applied", r
    before = m.snapshot()
    assert m.alloc(8) is None  # page 0 would fit the limit, the run's second page not
    assert m.snapshot() == before and m.null_block is None and pool.mapped_pages() == 0
    m.check_invariants()
    got = m.alloc(3)  # page 0's own free blocks
    assert got == [1, 2, 3] and m.null_block == [0] and pool.mapped_pages() == 1
    m.check_invariants()
    m.free(got)
    inst.close()
    m.shutdown()


def test_the_null_page_comes_back_as_page_0_with_a_premapping_reserve(monkeypatch):
    """With the pre-map thread on, the reserve would hand out another page first and the thread
    would map page 0 into it: the release stops the thread, the next alloc trims and starts it."""
    from kvcached import _C, vmm_ops

    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "2")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "4")
    _C.clear_faults()
    vmm_ops.init_kvcached("cpu", page_size=P, contiguous_layout=False)
    vmm_ops.create_kv_tensors(64 * 32 * KiB, 1, "cpu", num_layers=2, num_kv_buffers=1)
    try:
        m = _manager()
        pool = ElasticPool(m)
        inst = ElasticInstance("prealloc", [pool])
        m.free(m.alloc(8))
        inst.give_back()
        assert m.null_block is None and m.page_allocator.get_num_reserved_pages() == 0
        for _ in range(3):
            got = m.alloc(5)
            assert got is not None and 0 not in got and m.null_block == [0]
            deadline = time.monotonic() + 10
            while m.page_allocator.get_num_reserved_pages() < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # the thread refills the reserve (P1 counts a page it is mapping as neither)
            m.check_invariants()
            m.free(got)
            inst.give_back()
            assert m.null_block is None and pool.mapped_pages() == 0
            m.check_invariants()
        inst.close()
        m.shutdown()
    finally:
        vmm_ops.shutdown_kvcached()


def test_a_pool_without_a_record_sleeps_on_its_own_cap(host_plane):
    m = _manager()
    pool = ElasticPool(m)
    inst = ElasticInstance("norecord", [pool])
    before = int(m.page_allocator.mem_limit())
    m.free(m.alloc(8))
    inst.sleep()
    assert pool.mapped_pages() == 0 and int(m.page_allocator.mem_limit()) == 0
    inst.wake()
    assert int(m.page_allocator.mem_limit()) == before and m.alloc(4) is not None
    inst.close()
    m.shutdown()


def test_want_is_withdrawn_by_a_step_without_shortage(host_plane, prefix, monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "64M")
    m = _manager(own_segment=True, pool_name=prefix + "w")
    calls = []
    m.limits.note_shortage = lambda *a: calls.append("short") or False  # noqa: E731
    m.limits.clear_want = lambda: calls.append("clear")  # noqa: E731
    inst = ElasticInstance("w", [ElasticPool(m)])
    inst.note_shortage()
    inst.end_step()  # the step missed: the want stays
    inst.end_step()  # the next step placed everything: withdrawn
    assert calls == ["short", "clear"]
    m.shutdown()


def test_a_shortage_asks_for_the_pages_of_the_tokens_the_request_needs(host_plane, prefix, monkeypatch):
    # An engine stops admitting a request of several pages while one more page
    # would still fit: a want of one page would never be published.
    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "64M")
    m = _manager(own_segment=True, pool_name=prefix + "n")
    asked = []
    m.limits.note_shortage = lambda need=0: asked.append(need) or False  # noqa: E731
    pool = ElasticPool(m)
    inst = ElasticInstance("n", [pool])
    tokens_per_page = m.page_size // m.cell_size  # 64: 4 blocks of 16 tokens
    inst.note_shortage(2 * tokens_per_page + 1)
    inst.note_shortage(tokens_per_page)
    inst.note_shortage()  # unknown need: the limits' default, one page
    assert asked == [4 * pool.bytes_per_page, 2 * pool.bytes_per_page, 0]  # +1 page: block placement
    inst.close()
    m.shutdown()


@pytest.mark.parametrize(
    "cached, evictable, bound, excess",
    [(100, 100, None, 0), (100, 100, 100, 0), (101, 101, 100, 11), (150, 20, 100, 20), (5, 5, 0, 5)],
)
def test_cache_bound_evicts_down_to_ninety_percent(cached, evictable, bound, excess):
    assert cache_excess_tokens(cached, evictable, bound) == excess


@pytest.mark.parametrize("raw, want", [("", None), ("-1", None), ("0", 0), ("4096", 4096)])
def test_max_cached_tokens_one_rule(monkeypatch, raw, want):
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", raw)
    assert config.max_cached_tokens() == want


@pytest.mark.parametrize("raw", ["-2", "lots", "1.5"])
def test_max_cached_tokens_bad_values_name_the_fix(monkeypatch, raw):
    monkeypatch.setenv("KVCACHED_MAX_CACHED_TOKENS", raw)
    with pytest.raises(ValueError, match="KVCACHED_MAX_CACHED_TOKENS"):
        config.max_cached_tokens()


def _direct_readers(var: str):
    """Modules under kvcached/ other than kvcached.config that read ``var`` from the environment themselves."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(config.__file__)))
    direct = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\s*\()\s*["']""" + var + """["']""")
    found = []
    for dirpath, _, files in os.walk(os.path.join(root, "kvcached")):
        for f in files:
            path = os.path.join(dirpath, f)
            if f.endswith(".py") and path != config.__file__ and direct.search(open(path).read()):
                found.append(os.path.relpath(path, root))
    return root, found


def test_max_cached_tokens_means_the_same_in_both_engines():
    # One reader (config.max_cached_tokens) and one rule (cache_excess_tokens) for vLLM and SGLang.
    root, direct = _direct_readers("KVCACHED_MAX_CACHED_TOKENS")
    assert direct == []
    users = []
    for engine in ("vllm/block_pool.py", "sglang/scheduler_hooks.py"):
        src = open(os.path.join(root, "kvcached", "integration", engine)).read()
        if "cache_bound import max_cached_tokens" in src and "cache_excess_tokens(" in src:
            users.append(engine)
    assert users == ["vllm/block_pool.py", "sglang/scheduler_hooks.py"]


@pytest.mark.parametrize("raw, on", [("true", True), ("1", True), ("off", False), ("", False)])
def test_enable_kvcached_means_the_same_in_both_engines(monkeypatch, raw, on):
    from kvcached import autopatch
    from kvcached.integration.sglang import plugin as sglang_plugin
    from kvcached.integration.vllm import plugin as vllm_plugin

    assert _direct_readers("ENABLE_KVCACHED")[1] == []
    monkeypatch.setenv("ENABLE_KVCACHED", raw)
    assert autopatch.enabled() is on and config.enabled() is on
    monkeypatch.setenv("ENABLE_KVCACHED", "maybe")
    # A value that is neither refuses in both engines' activation, with the same one-line message.
    errors = []
    for activate in (vllm_plugin.activate, sglang_plugin.activate):
        with pytest.raises(ValueError) as e:
            activate()
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "ENABLE_KVCACHED" in errors[0] and "\n" not in errors[0]


def test_sglang_want_counts_the_queue_that_could_start_and_the_running_growth():
    # Shapes of SGLang's Scheduler/Req attributes (the engine tests run the real ones:
    # tests/engines/sglang/test_two_engines.py); the arithmetic is checked here.
    from types import SimpleNamespace as NS

    from kvcached.integration.sglang.admission import tokens_wanted

    def req(prompt: int, out: int, max_new: int) -> NS:
        return NS(origin_input_ids=[0] * prompt, output_ids=[0] * out, sampling_params=NS(max_new_tokens=max_new))

    running = [req(10, 30, 96), req(10, 96, 96)]  # 66 and 0 tokens still to grow
    queue = [req(20, 0, 96), req(40, 0, 96), req(8, 0, 96)]
    sched = NS(running_batch=NS(reqs=running), waiting_queue=queue, max_running_requests=4)
    assert tokens_wanted(sched, queue) == 66 + (20 + 96) + (40 + 96)  # only 2 more may run
    sched.max_running_requests = 16
    assert tokens_wanted(sched, queue) == 66 + (20 + 96) + (40 + 96) + (8 + 96)
    assert tokens_wanted(NS(waiting_queue=[object()]), [object()]) == 0  # unknown shape: one page
