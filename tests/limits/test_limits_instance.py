"""InstanceLimits, DeviceBudget and kvcached.control inside one process, over
a real PageAllocator on the host backend."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from kvcached import _C
from kvcached.control import set_instance_memory_limit
from kvcached.errors import InvalidArgumentError, OutOfMemoryError
from kvcached.limits import DeviceBudget, InstanceLimits, format_size, parse_size
from kvcached.naming import default_instance_name, instance_name, validate_name
from kvcached.naming import group_name as group_record_name
from limits_helpers import BPP, LAYERS, PAGE, record_state, two_in_one_budget

PAGES = 16


@pytest.fixture
def host():
    """Host backend with two KV groups of PAGES pages; a PageAllocator factory."""
    _C.clear_faults()
    _C.init_kvcached("cpu", PAGE, False)
    for g in (0, 1):
        _C.create_kv_tensors(PAGES * PAGE, LAYERS, 2, g)
    made = []

    def make(group: int = 0, **kw):
        kw.setdefault("enable_prealloc", False)
        kw.setdefault("max_reserved", 4)
        pa = _C.PageAllocator(LAYERS, PAGES * PAGE, PAGE, group_id=group, **kw)
        made.append(pa)
        return pa

    yield make
    for pa in made:
        pa.stop_prealloc_thread()
    _C.shutdown_kvcached()


def wait_applied(limits: InstanceLimits, revision: int, timeout: float = 10.0) -> float:
    """Seconds until the owner enforces ``revision`` (fails the test after ``timeout``)."""
    t0 = time.monotonic()
    while limits.record().applied_revision < revision:
        assert time.monotonic() - t0 < timeout, f"limit revision {revision} not applied within {timeout}s"
        time.sleep(0.001)
    return time.monotonic() - t0


def test_record_is_private_and_unlinked_on_close(host, prefix):
    pa = host()
    lim = InstanceLimits.for_page_allocator(pa, engine="vllm", device="cpu", name=prefix + "a", budget=None)
    st = os.stat(f"/dev/shm/{prefix}a")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    rec = lim.record()
    assert (rec.engine, rec.device, rec.owner_pid, rec.alive) == ("vllm", "cpu", os.getpid(), True)
    assert rec.total == PAGES * BPP and rec.limit == PAGES * BPP and rec.applied_revision == rec.revision
    with pytest.raises(InvalidArgumentError, match="belongs to live process"):
        InstanceLimits(engine="vllm", device="cpu", total_bytes=BPP, name=prefix + "a", budget=None)
    lim.close()
    lim.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{prefix}a")


def test_group_records_have_their_own_names(host, prefix):
    a = InstanceLimits.for_page_allocator(host(0), engine="t", device="cpu", name=prefix + "i", budget=None)
    b = InstanceLimits.for_page_allocator(host(1), engine="t", device="cpu", name=prefix + "i", group_id=1, budget=None)
    try:
        assert (a.name, b.name) == (prefix + "i", prefix + "i_g1")
        assert record_state(prefix + "i_g1") is not None
    finally:
        a.close()
        b.close()


def test_shrink_is_gradual_and_never_unmaps_a_live_page(host, prefix):
    pa = host()
    lim = InstanceLimits.for_page_allocator(pa, engine="t", device="cpu", name=prefix + "s", budget=None)
    try:
        ids = pa.alloc_pages(8)
        pa.free_pages(ids[6:])
        live = ids[:6]
        assert pa.get_num_reserved_pages() == 2
        writer = _C.MemInfoTracker.open(prefix + "s")  # another handle, as kvctl holds
        rev = writer.set_limit(3 * BPP)
        wait_applied(lim, rev)
        assert pa.mem_limit() == 3 * BPP
        assert pa.get_num_reserved_pages() == 0  # unused mapped pages went at once
        assert pa.get_num_inuse_pages() == 6
        mapped = set(_C.mapped_offsets())
        assert {i * PAGE for i in live} <= mapped  # every live page still mapped
        with pytest.raises(OutOfMemoryError):
            pa.alloc_page()  # over the limit: nothing new is mapped
        pa.free_pages(live[:4])
        assert pa.get_num_mapped_pages() == 2 and lim.record().mapped == 2 * BPP
        assert pa.alloc_page() is not None  # 3 of 3
        rev = writer.set_limit(12 * BPP)  # grow applies at once
        wait_applied(lim, rev)
        assert len(pa.alloc_pages(9)) == 9
        assert lim.record().used == 12 * BPP
    finally:
        lim.close()


def test_budget_gate_shares_one_device_between_instances(host, prefix):
    budget, pa_a, pa_b, a, b = two_in_one_budget(host, prefix, 10)
    try:
        assert b.num_free_pages() == 10 - 1  # a holds its first quantum
        a.admit_pages(8)
        ids_a = pa_a.alloc_pages(8)
        assert a.record().granted == 9 * BPP  # 8 + one quantum for its reserve pool
        time.sleep(0.06)  # num_free_pages may reuse a peer sum for 50 ms
        assert b.num_free_pages() == 1
        with pytest.raises(OutOfMemoryError, match="device budget of cpu exhausted"):
            b.admit_pages(4)  # asks a to give back its unused quantum
        t0 = time.monotonic()
        while a.record().granted != 8 * BPP:
            assert time.monotonic() - t0 < 2, "the nudged instance did not give back its unused budget"
            time.sleep(0.001)
        b.admit_pages(2)
        ids_b = pa_b.alloc_pages(2)
        s = budget.sample()
        assert s.held <= s.budget and s.mapped == 10 * BPP
        with pytest.raises(OutOfMemoryError):
            b.admit_pages(1)
        # That miss woke a's watcher; let it be done (a write it acknowledges comes
        # after the wake-up), or it could trim the reserve filled just below.
        wait_applied(a, _C.MemInfoTracker.open(prefix + "a").set_limit(a.limit))
        pa_a.free_pages(ids_a[:6])  # 4 stay mapped in a's reserve pool, 2 are unmapped
        a.on_free()
        assert pa_a.get_num_mapped_pages() == 6 and a.record().granted == 8 * BPP
        with pytest.raises(OutOfMemoryError):
            b.admit_pages(3)  # a, asked again, unmaps its idle reserve and gives it back
        t0 = time.monotonic()
        while a.record().granted != 2 * BPP:
            assert time.monotonic() - t0 < 2, "the nudged instance kept its idle reserve"
            time.sleep(0.001)
        assert pa_a.get_num_inuse_pages() == 2 == pa_a.get_num_mapped_pages()
        b.admit_pages(3)
        pa_b.alloc_pages(3)
        assert budget.sample().mapped <= budget.budget_bytes
        # The limit still caps below the budget.
        rev = _C.MemInfoTracker.open(prefix + "b").set_limit(5 * BPP)
        wait_applied(b, rev)
        b.admit_pages(1)
        with pytest.raises(OutOfMemoryError):
            pa_b.alloc_page()
        del ids_b
    finally:
        a.close()
        b.close()


def test_asleep_caps_at_zero_and_a_limit_written_meanwhile_applies_at_the_wake(host, prefix):
    """The engine's own sleep (vLLM sleep mode, SGLang release_memory_occupation): cap 0
    whatever the limit, the reserve unmapped, unused budget back to the device; a kvctl
    limit written while asleep is applied at the wake, never before."""
    budget = DeviceBudget("cpu", 12 * BPP, scope=prefix)
    pa = host(max_reserved=4, enable_prealloc=False)
    lim = InstanceLimits.for_page_allocator(
        pa, engine="t", device="cpu", name=prefix + "z", budget=budget, quantum_bytes=2 * BPP
    )
    try:
        lim.admit_pages(6)
        ids = pa.alloc_pages(6)
        pa.free_pages(ids[1:])  # one page keeps a block (the null block's), five go to the reserve
        assert pa.get_num_mapped_pages() > 1
        lim.set_asleep(True)
        assert lim.asleep and lim.cap == 0 and pa.mem_limit() == 0
        assert pa.get_num_mapped_pages() == 1 == pa.get_num_inuse_pages()  # only the live page
        assert lim.record().granted == BPP and budget.held_bytes() == BPP  # the rest is the device's
        assert lim.num_free_pages() == 0 and lim.note_shortage(BPP) is False
        lim.admit_pages(1)  # no grant grows while asleep: the allocator's cap of 0 answers
        with pytest.raises(OutOfMemoryError):
            pa.alloc_page()
        rev = _C.MemInfoTracker.open(prefix + "z").set_limit(3 * BPP)  # kvctl limit during the sleep
        wait_applied(lim, rev)
        assert lim.limit == 3 * BPP and lim.cap == 0 and pa.get_num_mapped_pages() == 1
        lim.set_asleep(True)  # idempotent
        lim.set_asleep(False)
        assert not lim.asleep and 0 < lim.cap <= 3 * BPP
        lim.admit_pages(2)
        more = pa.alloc_pages(2)
        assert pa.get_num_inuse_pages() == 3
        lim.admit_pages(1)
        with pytest.raises(OutOfMemoryError):
            pa.alloc_page()  # the limit written while asleep holds now
        pa.free_pages(more)
    finally:
        lim.close()


def test_a_wanting_instance_counts_a_peers_give_back_at_once(host, prefix):
    """Outside a want, what peers hold is reused for 50 ms (num_free_pages runs every
    step); while a want is published it is read on every call, so the step after a
    peer's give-back admits the load (trace: it came up to 46 ms late)."""
    budget, pa_a, pa_b, a, b = two_in_one_budget(host, prefix, 10)
    try:
        a.admit_pages(9)
        ids = pa_a.alloc_pages(9)  # a maps 9 of 10: one page of room
        time.sleep(0.06)
        assert b.num_free_pages() == 1 and not b.wanting
        assert b.note_shortage(3 * BPP) and b.wanting  # the want is published
        a.set_asleep(True)  # stands for a's idle give-back (its pages unmapped, its grant released)
        pa_a.free_pages(ids)
        a.on_free()
        t0 = time.monotonic()
        while budget.held_bytes(exclude=b.name) > 0:
            assert time.monotonic() - t0 < 2, "a did not give its budget back"
            time.sleep(0.001)
        assert b.num_free_pages() >= 3  # no sum of before the give-back
        b.admit_pages(3)
        assert not b.wanting  # the budget covers the load again
    finally:
        a.close()
        b.close()


def test_an_applied_limit_that_changed_calls_on_limit_applied(host, prefix):
    """The hook the elastic instance wakes its idle engine with (it evicts down to a
    lowered limit at once, also from SGLang's --sleep-on-idle poll): once per change,
    after the ack, on the watcher thread."""
    import threading

    pa = host(0)
    limits = InstanceLimits.for_page_allocator(pa, engine="t", device="cpu", name=prefix + "hook", budget=None)
    called = []
    limits.on_limit_applied = lambda: called.append(threading.current_thread().name)
    try:

        def calls_after(limit: int) -> int:
            n = len(called)
            wait_applied(limits, tracker.set_limit(limit))
            # The hook runs just after the ack: a later write's ack orders it.
            wait_applied(limits, tracker.set_limit(limit))
            return len(called) - n

        tracker = _C.MemInfoTracker.open(prefix + "hook")
        assert calls_after(4 * BPP) == 1 and called[0] != threading.current_thread().name
        assert calls_after(4 * BPP) == 0  # written again, not changed
        assert calls_after(8 * BPP) == 1
    finally:
        limits.close()


def test_dead_instances_hold_nothing(host, prefix):
    budget = DeviceBudget("cpu", 4 * BPP, scope=prefix)
    # A live record counts what it holds; the same record of a dead owner counts nothing.
    ghost = _C.MemInfoTracker.create(prefix + "ghost", "t", 0, 0, 4 * BPP, 4 * BPP)
    ghost.publish_usage(4 * BPP, 0)
    ghost.set_granted(4 * BPP)
    assert budget.held_bytes() == 4 * BPP
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_create_and_die, args=(prefix + "dead",))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    ghost.unlink()
    assert record_state(prefix + "dead") is not None  # left behind by a dead owner
    assert budget.held_bytes() == 0
    pa = host()
    lim = InstanceLimits.for_page_allocator(pa, engine="t", device="cpu", name=prefix + "dead", budget=budget)
    try:  # the dead owner's record was reclaimed by the new instance
        assert lim.record().owner_pid == os.getpid()
        lim.admit_pages(4)
        assert len(pa.alloc_pages(4)) == 4
    finally:
        lim.close()


def _create_and_die(name: str) -> None:
    t = _C.MemInfoTracker.create(name, "t", 0, 0, 4 * BPP, 4 * BPP)
    t.publish_usage(4 * BPP, 0)
    t.set_granted(4 * BPP)
    os._exit(0)  # no clean shutdown: the record stays


def test_control_statuses(host, prefix):
    pa = host()
    lim = InstanceLimits.for_page_allocator(
        pa, engine="t", device="cpu", name=prefix + "c", budget=DeviceBudget("cpu", PAGES * BPP, scope=prefix)
    )
    name = prefix + "c"
    try:
        rev0 = lim.record().revision
        r = set_instance_memory_limit(8 * BPP, name=name)
        assert r == "applied" and r.revision == rev0 + 1 and pa.mem_limit() <= 8 * BPP
        lim.admit_pages(6)
        ids = pa.alloc_pages(6)
        r = set_instance_memory_limit(2 * BPP, revision=r.revision, name=name)
        assert r == "deferred" and r.mapped == 6 * BPP and "still mapped" in r.message
        assert set_instance_memory_limit(4 * BPP, revision=rev0, name=name) == "stale"
        assert set_instance_memory_limit(4 * BPP, revision=r.revision + 5, name=name) == "conflict"
        before = record_state(name)
        for bad in (-1, 1.5, "1G", True, (PAGES + 1) * BPP):  # 0 is allowed in the API (upstream's)
            rr = set_instance_memory_limit(bad, name=name)  # type: ignore[arg-type]
            assert rr == "rejected" and rr.message, bad
        assert set_instance_memory_limit(BPP, name=prefix + "nope") == "rejected"
        assert set_instance_memory_limit(BPP, revision=-3, name=name) == "rejected"
        assert record_state(name) == before  # nothing was written
        pa.free_pages(ids)
        r = set_instance_memory_limit(4 * BPP, name=name)
        assert r == "applied"
        # A process that owns exactly one instance (and no KV pool): the default
        # target. In a fresh interpreter, so instances other tests left open do not count.
        code = (
            "import sys\n"
            "from kvcached import _C\n"
            "from kvcached.control import set_instance_memory_limit\n"
            "from kvcached.limits import InstanceLimits\n"
            f"_C.init_kvcached('cpu', {PAGE}, False)\n"
            f"_C.create_kv_tensors({PAGES * PAGE}, {LAYERS}, 2, 0)\n"
            f"pa = _C.PageAllocator({LAYERS}, {PAGES * PAGE}, {PAGE})\n"
            "lim = InstanceLimits.for_page_allocator(pa, engine='t', device='cpu', name=sys.argv[1], budget=None)\n"
            f"print(set_instance_memory_limit({5 * BPP}).name)\n"
            "lim.close()\n"
        )
        r = subprocess.run([sys.executable, "-c", code, prefix + "only"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.split() == [prefix + "only"], r.stderr
    finally:
        lim.close()


def test_names(monkeypatch):
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    # kvcached.naming rule 1: the pid of the engine's first process (was the pgid).
    assert instance_name("vllm") == f"kvcached_vllm_{os.getpid()}" == default_instance_name("vllm")
    monkeypatch.setenv("KVCACHED_IPC_NAME", "my_model")
    assert instance_name("sglang") == "my_model"
    assert group_record_name("my_model", 2) == "my_model_g2"
    for bad in ("", "a/b", "x" * 128, "has space", "..", "caf\u00e9"):
        with pytest.raises(ValueError):
            validate_name(bad)


def test_sizes():
    assert parse_size("512") == 512
    assert parse_size("64k") == 64 << 10
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("-3M") == -(3 << 20)
    for bad in ("", "abc", "1e3", "1.5X", "G", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert [format_size(n) for n in (0, 512, 64 << 10, 3 << 29)] == ["0", "512", "64.0K", "1.50G"]


def test_on_free_gives_back_slack_beyond_two_quanta(host, prefix):
    budget = DeviceBudget("cpu", PAGES * BPP, scope=prefix)
    pa = host(max_reserved=2)
    lim = InstanceLimits.for_page_allocator(
        pa, engine="t", device="cpu", name=prefix + "f", budget=budget, quantum_bytes=BPP
    )
    try:
        lim.admit_pages(10)
        ids = pa.alloc_pages(10)
        assert lim.record().granted == 11 * BPP
        pa.free_pages(ids)  # 2 stay in the reserve pool, 8 are unmapped
        lim.on_free()
        assert pa.get_num_mapped_pages() == 2 and lim.record().granted == 3 * BPP
        assert budget.headroom() == (PAGES - 3) * BPP
    finally:
        lim.close()


def test_after_a_lowered_limit_is_met_the_grant_follows_what_is_mapped(host, prefix):
    """H200: limit 512M met, 512 MiB mapped, the record still showed 2.38 GiB held (issue 34,
    item 12): the grant was floored at what was mapped when the limit fell and stayed there
    (within two quanta of slack) until the idle watcher's next wake, 10 s later. Now the
    frees that meet the limit bring it down with them."""
    budget = DeviceBudget("cpu", PAGES * BPP, scope=prefix)
    pa = host(max_reserved=0)
    lim = InstanceLimits.for_page_allocator(
        pa, engine="t", device="cpu", name=prefix + "g", budget=budget, quantum_bytes=4 * BPP
    )
    try:
        lim.admit_pages(10)
        ids = pa.alloc_pages(10)
        r = set_instance_memory_limit(4 * BPP, name=lim.name)
        wait_applied(lim, r.revision)
        assert lim.record().granted == 10 * BPP  # floored at what is mapped: the pages are live
        pa.free_pages(ids[4:])  # the engine frees until it fits
        lim.on_free()
        rec = lim.record()
        assert pa.get_num_mapped_pages() == 4 and rec.granted == 4 * BPP and rec.held == 4 * BPP
        assert budget.headroom() == (PAGES - 4) * BPP  # the peers see it at once
        pa.free_pages(ids[:4])
    finally:
        lim.close()


def test_budget_from_env(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_MEMORY_BUDGET", "8M")
    assert DeviceBudget.from_env("cpu").budget_bytes == 8 << 20
    monkeypatch.delenv("KVCACHED_HOST_MEMORY_BUDGET")
    monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", "0.5")
    total = _C.backend_info("cpu")["total_bytes"]
    assert abs(DeviceBudget.from_env("cpu").budget_bytes - total // 2) <= 1
    for name, bad in (
        ("KVCACHED_GPU_UTILIZATION", "1.5"),
        ("KVCACHED_GPU_UTILIZATION", "x"),
        ("KVCACHED_HOST_MEMORY_BUDGET", "abc"),
        ("KVCACHED_HOST_MEMORY_BUDGET", "-1G"),
    ):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            DeviceBudget.from_env("cpu")
        monkeypatch.delenv(name)


def test_record_state_alive_pending_dead(prefix):
    from kvcached.limits import read_record

    t = _C.MemInfoTracker.create(prefix + "p", "t", 0, 0, BPP, BPP)
    try:
        assert read_record(prefix + "p").state == "alive"  # an owner that never acknowledges
        t.ack_revision(1)
        rev = t.set_limit(2 * BPP)
        assert read_record(prefix + "p").state == "pending"
        t.ack_revision(rev)
        assert read_record(prefix + "p").state == "alive"
    finally:
        t.unlink()


def test_a_want_is_published_in_the_record_and_goes_stale(prefix):
    from kvcached.limits import read_record

    t = _C.MemInfoTracker.create(prefix + "w", "t", 0, 0, BPP, BPP)
    try:
        r = read_record(prefix + "w")
        assert r.wanted == r.wanted_ns == 0 and r.wants(10.0) == 0
        with pytest.raises(InvalidArgumentError, match="wanted bytes must be >= 0"):
            t.set_wanted(-1)
        assert read_record(prefix + "w").wanted == 0  # refused: nothing changed
        t.set_wanted(3 * BPP)
        r = read_record(prefix + "w")
        assert r.wanted == 3 * BPP and abs(r.wanted_ns - time.time_ns()) < 5e9
        assert r.wants(10.0) == 3 * BPP
        assert r.wants(1.0, now_ns=r.wanted_ns + 2_000_000_000) == 0  # not renewed: stale
        assert r.to_dict()["wanted"] == 3 * BPP  # kvctl list --json shows it
        t.set_wanted(0)
        assert read_record(prefix + "w").wants(10.0) == 0
    finally:
        t.unlink()


_OWNER = """
import ctypes, os, sys, threading, time
from kvcached import _C
t = _C.MemInfoTracker.create(sys.argv[1], "t", 0, 0, {n}, {n})
t.publish_usage({n}, 0)
t.set_granted({n})
if sys.argv[2] == "thread":
    threading.Thread(target=time.sleep, args=(60,)).start()
print("ok", flush=True)
if sys.argv[2] == "thread":
    ctypes.CDLL(None).pthread_exit(None)  # the leader exits; the other thread runs on
os._exit(0)  # no clean shutdown: the record stays
"""


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _start_owner(name: str, mode: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _OWNER.format(n=4 * BPP), name, mode], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline() == "ok\n"
    deadline = time.monotonic() + 10
    while _proc_state(p.pid) != "Z":  # exited (or its leader thread did), not reaped
        assert time.monotonic() < deadline, "the owner did not exit"
        time.sleep(0.01)
    return p


def test_an_exited_owner_not_yet_reaped_holds_nothing(prefix):
    from kvcached.limits import read_record

    budget = DeviceBudget("cpu", 8 * BPP, scope=prefix)
    p = _start_owner(prefix + "z", "exit")
    try:
        r = read_record(prefix + "z")
        assert not r.alive and r.state == "dead" and r.held == 0  # a zombie's memory is gone
        assert budget.held_bytes() == 0
        _C.delete_mem_info_record(prefix + "z", False)  # no force needed
    finally:
        p.wait(10)
    # A leader thread that exited while another thread runs is a live process.
    p = _start_owner(prefix + "t", "thread")
    try:
        r = read_record(prefix + "t")
        assert r.alive and r.held == 4 * BPP
        with pytest.raises(InvalidArgumentError):
            _C.delete_mem_info_record(prefix + "t", False)
    finally:
        p.kill()
        p.wait(10)
    assert not read_record(prefix + "t").alive


def test_a_limit_below_one_page_is_applied_and_says_the_engine_can_map_nothing(host, prefix, caplog):
    """The writer cannot see the page size: the owner applies a limit smaller than one page as
    written (nothing can be mapped) and says so in one line with the limit that would work."""
    pa = host()
    lim = InstanceLimits.for_page_allocator(pa, engine="t", device="cpu", name=prefix + "p", budget=None)
    try:
        writer = _C.MemInfoTracker.open(prefix + "p")
        with caplog.at_level("WARNING", logger="kvcached.limits.instance"):
            wait_applied(lim, writer.set_limit(BPP // 2))
            with pytest.raises(OutOfMemoryError):
                pa.alloc_page()
            wait_applied(lim, writer.set_limit(BPP))
        lines = [r.getMessage() for r in caplog.records if "less than one page" in r.getMessage()]
        assert len(lines) == 1 and f"kvctl limit {prefix}p {BPP}" in lines[0]
        assert pa.alloc_page() is not None  # one page: admitted
    finally:
        lim.close()
