"""SGLang's idle turn paces a scheduler that admits nothing: requests waiting,
nothing in flight (``StallBackoff``, kvcached.elastic); a turn with nothing
waiting, or a batch that ran, resets it. A turn with nothing waiting yields the GIL
once (kvcached's threads in the scheduler process run at once, not at the switch
interval)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")


@pytest.fixture
def hooks(monkeypatch):
    import kvcached.elastic.stall as st
    import kvcached.integration.sglang.scheduler_hooks as sh

    slept = []
    monkeypatch.setattr(st.time, "sleep", slept.append)
    pool = SimpleNamespace(name="inst", limit_bytes=lambda: None, bytes_per_page=1 << 20)
    monkeypatch.setattr(sh, "instance", lambda: SimpleNamespace(pools=[pool]))
    monkeypatch.setattr(sh, "_stall", None)
    for name in ("poll_allocator", "shrink_to_limits", "release_all", "give_back_to_peers"):
        monkeypatch.setattr(sh, name, lambda *a, **k: 0)
    monkeypatch.setattr(sh, "note_waiting", lambda s: bool(s.waiting_queue))
    monkeypatch.setattr(sh, "yield_gil", lambda: slept.append("yield"))
    return sh, slept


def _scheduler(waiting, in_flight=False):
    return SimpleNamespace(last_batch=object() if in_flight else None, result_queue=[], waiting_queue=waiting)


def test_idle_turns_with_requests_waiting_sleep_longer_each_time_and_reset(hooks):
    sh, slept = hooks
    for _ in range(3):
        sh.on_idle(_scheduler(["r", "s"]))
    assert slept == [0.0005, 0.001, 0.002]
    sh.on_idle(_scheduler([]))  # nothing waits: no sleep (a yield), and the next stall starts again
    sh.on_idle(_scheduler(["r"]))
    assert slept[3:] == ["yield", 0.0005]


def test_a_batch_in_flight_is_not_paced(hooks):
    sh, slept = hooks
    for _ in range(3):
        sh.on_idle(_scheduler(["r"], in_flight=True))
    assert slept == []
