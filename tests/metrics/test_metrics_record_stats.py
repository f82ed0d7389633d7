"""The record's statistics (record version 2) with real processes on the host
backend: several processes add to one record's counters and one scrape sees
the sum; maps, unmaps, refusals, wants and give-backs are counted where they
happen; a version-1 record (an older kvcached) is still read and written; a
corrupt statistics block is refused with a clear reason and never breaks a
scrape."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import pytest

from kvcached import _C
from kvcached.limits import DeviceBudget
from kvcached.limits.records import list_records, read_record
from limits_helpers import (
    BPP,
    RECORD_SIZE,
    RECORD_V2_SIZE,
    Worker,
    kvctl,
    kvctl_list_json,
    poke,
    shm_path,
)
from metrics_helpers import Exporter, parse, scrape, value

BUDGET = 8 * BPP

# A process that opens someone else's record and adds to its counters.
ADDER = """
import sys
from kvcached import _C
t = _C.MemInfoTracker.open(sys.argv[1])
n = int(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()  # every adder starts at once
add = t.add_counter
for _ in range(n):
    add("pages_mapped", 1)
for _ in range(n // 1000):
    t.observe("unmap_seconds", 0.002)
print("done", flush=True)
"""


def labels_of(w: Worker) -> dict:
    return dict(name=w.name, engine="test", device="cpu")


def until(pred, what: str, timeout: float = 15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_new_record_is_version_2_with_zeroed_statistics(prefix):
    t = _C.MemInfoTracker.create(prefix + "new", "t", 0, 0, 4 * BPP, 4 * BPP)
    assert os.stat(shm_path(t.name)).st_size == RECORD_V2_SIZE
    r = read_record(t.name)
    assert r.record_version == 2 and r.valid and not r.stats_problem
    assert set(r.counters.values()) == {0} and len(r.counters) == 9
    assert {h.count for h in r.histograms.values()} == {0}
    with pytest.raises(_C.InvalidArgumentError, match="no record counter named 'nope'"):
        t.add_counter("nope", 1)
    with pytest.raises(_C.InvalidArgumentError, match="seconds must be in"):
        t.observe("map_seconds", -1.0)
    del t


def test_two_processes_add_to_one_record_and_a_scrape_sees_the_sum(prefix):
    # No reserve: every alloc maps through the owner's PageAllocator, every free unmaps.
    w = Worker(name=prefix + "sum", pages=16, max_reserved=0)
    adders = []
    try:
        assert w.call("alloc", n=3)["ok"]  # one map call of 3 pages
        w.call("free", n=3)  # one unmap call of 3 pages
        n = 40_000
        adders = [
            subprocess.Popen([sys.executable, "-c", ADDER, w.name, str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        ]  # fmt: skip
        for p in adders:
            assert p.stdout.readline().strip() == "ready"
        for p in adders:
            p.stdin.write("go\n")
            p.stdin.flush()
        for _ in range(5):  # the owner maps and unmaps while the adders run
            assert w.call("alloc", n=1)["ok"]
            w.call("free", n=1)
        for p in adders:
            assert p.stdout.readline().strip() == "done"
            assert p.wait(60) == 0
        mapped = 2 * n + 3 + 5
        unmap_calls = 1 + 5 + 2 * (n // 1000)
        lab = labels_of(w)
        for samples in (scrape(prefix), None):
            if samples is None:  # the same numbers over HTTP, from the machine exporter
                e = Exporter("--prefix", prefix)
                try:
                    samples = parse(e.get())
                finally:
                    assert e.stop() == 0
            assert value(samples, "kvcached_pages_mapped_total", **lab) == mapped
            assert value(samples, "kvcached_pages_unmapped_total", **lab) == 3 + 5
            assert value(samples, "kvcached_map_seconds_count", **lab) == 1 + 5
            assert value(samples, "kvcached_map_seconds_bucket", **lab, le="+Inf") == 1 + 5
            assert value(samples, "kvcached_unmap_seconds_count", **lab) == unmap_calls
            assert value(samples, "kvcached_unmap_seconds_sum", **lab) >= 2 * (n // 1000) * 0.002
            # Cumulative buckets: the adders' 2 ms observations are all at or below 2.5 ms.
            assert value(samples, "kvcached_unmap_seconds_bucket", **lab, le="0.0025") == unmap_calls
            assert value(samples, "kvcached_unmap_seconds_bucket", **lab, le="0.001") == 1 + 5
            assert value(samples, "kvcached_stats_valid", **lab) == 1
            assert value(samples, "kvcached_map_failures_total", **lab) == 0
        row = next(r for r in kvctl_list_json() if r["name"] == w.name)
        assert row["record_version"] == 2 and row["counters"]["pages_mapped"] == mapped
        assert row["histograms"]["map_seconds"]["count"] == 1 + 5
    finally:
        for p in adders:
            if p.poll() is None:
                p.kill()
        w.kill()


def test_refusals_wants_and_give_backs_are_counted_where_they_happen(prefix):
    a = Worker(name=prefix + "a", pages=16, budget_bytes=BUDGET, scope=prefix, max_reserved=2)
    b = Worker(name=prefix + "b", pages=16, budget_bytes=BUDGET, scope=prefix)
    c = Worker(name=prefix + "c", pages=16, limit_bytes=2 * BPP)  # no device budget: only its limit
    try:
        assert a.call("alloc", n=6)["ok"]
        a.call("free", n=2)  # two pages stay mapped in a's reserve
        assert b.call("alloc", n=1)["ok"]
        # b's load needs 3 more pages; the budget is what stops it: a want, a budget refusal.
        assert b.call("short", need=3 * BPP)["published"]
        # The want woke a: its watcher unmaps the reserve (a give-back of 2 pages).
        until(lambda: read_record(a.name).counters["give_backs"] >= 1, "a's give-back")
        assert read_record(a.name).counters["given_back_bytes"] == 2 * BPP
        time.sleep(0.05)
        b.call("clear")  # a step placed everything: the refusals reach the record, the want ends
        # c: its own limit (2 pages in use) stops a 1-page need, three times.
        assert c.call("alloc", n=2)["ok"]
        for _ in range(3):
            assert not c.call("short", need=BPP)["published"]
        c.call("clear")
        samples = scrape(prefix)
        la, lb, lc = labels_of(a), labels_of(b), labels_of(c)
        assert value(samples, "kvcached_refused_allocations_total", **lb, reason="budget") == 1
        assert value(samples, "kvcached_refused_allocations_total", **lb, reason="limit") == 0
        assert value(samples, "kvcached_refused_allocations_total", **lc, reason="limit") == 3
        assert value(samples, "kvcached_refused_allocations_total", **lc, reason="budget") == 0
        assert value(samples, "kvcached_want_served_seconds_count", **lb) == 1
        assert 0.05 <= value(samples, "kvcached_want_served_seconds_sum", **lb) < 60
        assert value(samples, "kvcached_want_served_seconds_count", **la) == 0
        assert value(samples, "kvcached_idle_give_backs_total", **la) >= 1
        assert value(samples, "kvcached_given_back_bytes_total", **la) == 2 * BPP
        assert value(samples, "kvcached_pages_unmapped_total", **la) == 2
        assert value(samples, "kvcached_pages_mapped_total", **la) == 6
        assert read_record(b.name).want_since_ns == 0  # no want now
    finally:
        for w in (a, b, c):
            w.kill()


def _make_v1_record(name: str) -> None:
    """A record as kvcached before record version 2 wrote it: the same first
    312 bytes, version 1, nothing after (owned by this process)."""
    t = _C.MemInfoTracker.create(name, "old", 0, 0, 4 * BPP, 4 * BPP)
    with open(shm_path(name), "rb") as f:
        head = bytearray(f.read(RECORD_SIZE))
    t.unlink()
    del t
    struct.pack_into("<I", head, 8, 1)  # version
    struct.pack_into("<I", head, 12, RECORD_SIZE)  # record_size
    fd = os.open(shm_path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, bytes(head))
    finally:
        os.close(fd)


def test_a_version_1_record_is_still_read_and_written(prefix):
    name = prefix + "v1"
    _make_v1_record(name)
    new = Worker(name=prefix + "v2", pages=16)
    try:
        assert new.call("alloc", n=1)["ok"]
        r = read_record(name)
        assert r.record_version == 1 and r.valid and r.alive and r.state == "alive"
        assert r.counters == {} and r.histograms == {} and not r.stats_problem
        t = _C.MemInfoTracker.open(name)
        assert not t.has_stats
        t.add_counter("pages_mapped", 5)  # nothing to add to: a no-op, not an error
        t.observe("map_seconds", 0.001)
        t.set_wanted(BPP)  # the version-1 fields are written as before
        t.set_wanted(0)
        assert os.stat(shm_path(name)).st_size == RECORD_SIZE  # never grown
        # Budgets count it; kvctl lists it and writes its limit.
        assert name in [m.name for m in DeviceBudget("cpu", BUDGET, scope=prefix).members()]
        row = next(x for x in kvctl_list_json() if x["name"] == name)
        assert row["state"] == "alive" and row["record_version"] == 1 and row["counters"] == {}
        res = kvctl("limit", name, str(2 * BPP), timeout=30)
        assert res.returncode == 0, res.stderr
        assert read_record(name).limit == 2 * BPP
        # The scrape shows its gauges and no statistics; the version-2 record beside it has them.
        samples = scrape(prefix)
        old = dict(name=name, engine="old", device="cpu")
        assert value(samples, "kvcached_limit_bytes", **old) == 2 * BPP
        stats_series = ("kvcached_pages_", "kvcached_stats")
        assert not [k for k in samples if ("name", name) in k[1] and k[0].startswith(stats_series)]
        assert value(samples, "kvcached_stats_valid", **labels_of(new)) == 1
        assert value(samples, "kvcached_pages_mapped_total", **labels_of(new)) == 1
        del t
    finally:
        new.kill()


def test_a_record_of_an_unknown_version_is_refused_by_name(prefix):
    t = _C.MemInfoTracker.create(prefix + "v3", "t", 0, 0, 4 * BPP, 4 * BPP)
    poke(t.name, version=3)
    with pytest.raises(_C.InvalidArgumentError, match="of version 3, not a kvcached record of version 1 or 2"):
        _C.MemInfoTracker.open(t.name)
    (r,) = [x for x in list_records() if x.name == t.name]
    assert r.state == "damaged" and "version 3" in r.problem  # its owner (this process) lives
    samples = scrape(prefix)  # the scrape goes on
    assert value(samples, "kvcached_instance_state", name=t.name, engine="", device="?", state="damaged") == 1
    name = t.name
    del t
    (r,) = [x for x in list_records() if x.name == name]
    assert r.state == "invalid" and not r.alive  # the owner lock went with the owner


@pytest.mark.parametrize(
    "fields,why",
    [
        ({"stats_magic": 0}, "wrong magic"),
        ({"stats_version": 9}, "statistics block is of version 9"),
        ({"stats_counter_slots": 3}, "wrong layout"),
        ({"counter_pages_mapped": 1 << 63}, "pages_mapped = 9223372036854775808 is out of range"),
        ({"hist_map_bucket0": (1 << 62) + 1}, "map_seconds bucket 0"),
        ({"want_since_ns": -1}, "want_since_ns is negative"),
    ],
    ids=["magic", "version", "layout", "counter", "bucket", "want_since"],
)
def test_a_corrupt_statistics_block_is_refused_and_the_scrape_goes_on(prefix, fields, why):
    w = Worker(name=prefix + "bad", pages=16, max_reserved=0)
    ok = Worker(name=prefix + "ok", pages=16, max_reserved=0)
    try:
        assert w.call("alloc", n=1)["ok"] and ok.call("alloc", n=1)["ok"]
        poke(w.name, **fields)
        r = read_record(w.name)
        assert why in r.stats_problem and "statistics are not shown" in r.stats_problem, r.stats_problem
        # The record itself stays trusted: its limit and usage count in budgets.
        assert r.valid and r.state == "alive" and r.used == BPP
        assert r.counters == {} and r.histograms == {}
        # The owner runs on: its allocator maps and unmaps as before.
        assert w.call("alloc", n=1)["ok"]
        w.call("free", n=1)
        assert w.proc.poll() is None
        samples = scrape(prefix)
        bad, good = labels_of(w), labels_of(ok)
        assert value(samples, "kvcached_stats_valid", **bad) == 0
        assert value(samples, "kvcached_used_bytes", **bad) == BPP
        assert not [k for k in samples if ("name", w.name) in k[1] and k[0].startswith("kvcached_pages_")]
        assert value(samples, "kvcached_stats_valid", **good) == 1
        assert value(samples, "kvcached_pages_mapped_total", **good) == 1
        res = kvctl("list", timeout=30)
        assert res.returncode == 0 and f"{w.name}: statistics not shown: its statistics block" in res.stdout
        e = Exporter("--prefix", prefix)  # over HTTP too: the scrape succeeds
        try:
            assert value(parse(e.get()), "kvcached_stats_valid", **bad) == 0
        finally:
            assert e.stop() == 0
    finally:
        w.kill()
        ok.kill()


def test_a_block_overwritten_after_open_gets_no_more_adds(prefix):
    w = Worker(name=prefix + "ow", pages=16, max_reserved=0)
    try:
        assert w.call("alloc", n=1)["ok"]
        poke(w.name, stats_magic=0)
        assert w.call("alloc", n=1)["ok"]  # the owner's handle sees the magic gone: no add
        poke(w.name, stats_magic=int.from_bytes(b"K_STATS1", "little"))
        assert read_record(w.name).counters["pages_mapped"] == 1
    finally:
        w.kill()
