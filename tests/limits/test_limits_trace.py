"""The limits' trace events (KVCACHED_TRACE) at the real seams: a short instance's
want, the peer's watcher waking and releasing its grant, the grant moving, and
the burst report reading them as one timeline. Tracing changes no outcome."""

from __future__ import annotations

import time

import pytest

from kvcached import _C, trace
from kvcached.bench.burst_report import burst_rows
from kvcached.errors import OutOfMemoryError
from limits_helpers import BPP, LAYERS, PAGE, two_in_one_budget

PAGES = 16


@pytest.fixture
def host():
    _C.clear_faults()
    _C.init_kvcached("cpu", PAGE, False)
    for g in (0, 1):
        _C.create_kv_tensors(PAGES * PAGE, LAYERS, 2, g)
    made = []

    def make(group: int = 0):
        pa = _C.PageAllocator(LAYERS, PAGES * PAGE, PAGE, group_id=group, enable_prealloc=False, max_reserved=4)
        made.append(pa)
        return pa

    yield make
    for pa in made:
        pa.stop_prealloc_thread()
    _C.shutdown_kvcached()


@pytest.fixture
def traced(tmp_path):
    d = str(tmp_path / "trace")
    trace.configure(d)
    yield d
    trace.configure(None)


def test_a_short_instance_and_its_peer_write_one_timeline(host, prefix, traced):
    budget, pa_a, pa_b, holder, short = two_in_one_budget(host, prefix, 10)  # a holds, b is short
    try:
        holder.admit_pages(8)
        pa_a.alloc_pages(8)  # 8 pages + one quantum held: 1 page of room left
        time.sleep(0.06)
        with pytest.raises(OutOfMemoryError):
            short.admit_pages(4)  # publishes the want, wakes the holder
        t0 = time.monotonic()
        while holder.record().granted != 8 * BPP:
            assert time.monotonic() - t0 < 2, "the holder did not give back its unused quantum"
            time.sleep(0.001)
        short.admit_pages(2)
        assert len(pa_b.alloc_pages(2)) == 2  # the same outcome as without the trace
    finally:
        holder.close()
        short.close()
    events = trace.read(traced)
    mine = [(e["instance"], e["event"]) for e in events]
    want = mine.index((prefix + "b", "want"))
    woke = mine.index((prefix + "a", "peer_woke"))
    released = next(i for i, e in enumerate(events) if e["event"] == "grant_released" and e["instance"] == prefix + "a")
    grown = next(
        i
        for i, e in enumerate(events)
        if e["event"] == "grant" and e["instance"] == prefix + "b" and e["bytes"] > 0 and i > want
    )
    assert want < woke < released < grown
    assert events[want]["new"] == 1 and events[want]["bytes"] > 0
    assert events[released]["bytes"] == BPP  # the quantum the holder held unused
    refused = next(e for e in events if e["event"] == "grant" and e["instance"] == prefix + "b" and e["short"])
    assert refused["bytes"] == 0 and refused["ms"] >= 0
    phases = [r["phase"] for r in burst_rows(events) if r["instance"] == prefix + "b"]
    assert phases[:5] == [
        "want published",
        "peer woke (limits watcher)",
        "peer released grant",
        "want withdrawn (a step placed all it tried)",  # the grant covers it: withdrawn inside the lock
        "grant grew for the wanting engine",
    ]
