"""The router's ``sleep: engine`` with kvcached and ``max_awake`` (more models than the
device holds), over real stand-in engine processes (tests/router/test_router_standin.py):
the least recently used idle model is put to sleep through its engine's own endpoint
before another wakes, a model held back at start is started by its first request, a
wake restores the engine before the request is sent, wakes show in /metrics, and the
failure paths (a failed wake, nothing evictable) end in a restart or a bounded 503."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcached.router.config import ENGINE_SLEEP_FLAGS
from kvcached.router.engines import HIGHEST_PORT
from kvcached.router.router import holds_weights
from kvcached.router.supervisor import ASLEEP, READY, free_port
from router_helpers import complete, request, wait_for

SLEEPY = {"args": ["--enable-sleep-mode"], "idle_seconds": 300, "kvcached": True}


def _stats(r, name):
    return json.loads(request(r.router.engines[name].port, "GET", "/stats")[2])


def _holding(r):
    return sorted(e.name for e in r.router.engines.values() if holds_weights(e))


def test_max_awake_sleeps_the_least_recently_used_model_before_another_wakes(running, monkeypatch):
    from kvcached import control

    writes = []
    monkeypatch.setattr(control, "set_instance_memory_limit", lambda *a, **k: writes.append((a, k)))
    r = running([dict(SLEEPY, name=n) for n in ("a", "b", "c")], max_awake=2)
    r.ready("a", "b")
    c = r.router.engines["c"]
    assert c.state == ASLEEP and c.proc is None  # held back: two engines hold their weights
    assert complete(r.port, "b")[0] == 200  # b is now more recently used than a
    pid_a = r.pid("a")

    status, out = complete(r.port, "c")  # a is put to sleep (its engine's own sleep), then c starts
    assert status == 200 and out["model"] == "c"
    assert r.router.engines["a"].state == ASLEEP and _stats(r, "a")["sleeping"] is True
    assert _holding(r) == ["b", "c"]

    status, out = complete(r.port, "a")  # b (least recently used now) sleeps; a wakes: the same process
    assert status == 200 and out["pid"] == pid_a
    assert _stats(r, "a")["calls"][-3:] == ["/sleep?level=1", "/wake_up", "/v1/completions"]  # woken first
    assert r.router.engines["b"].state == ASLEEP and _holding(r) == ["a", "c"]
    assert writes == []  # with kvcached the engine's own sleep gives the KV back: no limit written

    text = request(r.port, "GET", "/metrics")[2].decode()
    assert 'kvcached_router_evictions_total{model="a"} 1' in text
    assert 'kvcached_router_evictions_total{model="b"} 1' in text
    assert 'kvcached_router_last_wake_seconds{model="a",sleep="engine"}' in text
    assert 'kvcached_router_last_wake_seconds{model="c",sleep="stop"}' in text  # its first start
    assert 'kvcached_router_wake_seconds_count{model="a"} 1' in text


def test_nothing_evictable_the_request_waits_its_bound_and_gets_503(running):
    r = running(
        [dict(SLEEPY, name="pinned", idle_seconds=None), dict(SLEEPY, name="other")], max_awake=1, wake_timeout_s=1
    )
    r.ready("pinned")
    status, out = complete(r.port, "other")
    assert status == 503
    assert r.router.engines["other"].proc is None and _holding(r) == ["pinned"]


def test_a_failed_engine_wake_restarts_the_engine_and_the_request_is_served(running, monkeypatch, tmp_path):
    fail = tmp_path / "wake-fails"
    monkeypatch.setenv("STANDIN_WAKE_FAIL_FILE", str(fail))
    r = running([dict(SLEEPY, name="a", idle_seconds=0.3)])
    r.ready()
    old = r.pid("a")
    wait_for(lambda: r.router.engines["a"].state == ASLEEP, "a asleep")
    fail.write_text("")  # the engine cannot restore its weights
    status, out = complete(r.port, "a")  # the wake fails, the engine is restarted, the request waits for it
    assert status == 200 and out["pid"] != old
    text = request(r.port, "GET", "/metrics")[2].decode()
    assert 'kvcached_router_wake_failures_total{model="a"} 1' in text
    assert r.router.engines["a"].restarts == 1 and r.router.engines["a"].state == READY


def test_an_sglang_engine_that_is_not_idle_is_not_put_to_sleep_and_stays_ready(running, monkeypatch, tmp_path):
    busy = tmp_path / "busy"
    busy.write_text("")
    monkeypatch.setenv("STANDIN_BUSY_FILE", str(busy))
    r = running([{"name": "s", "engine": "sglang", "args": list(ENGINE_SLEEP_FLAGS["sglang"]), "idle_seconds": 0.3}])
    r.ready()
    e = r.router.engines["s"]
    wait_for(lambda: "/flush_cache?timeout=30" in _stats(r, "s")["calls"], "an idle check")
    assert e.state in (READY, "sleeping") and e.restarts == 0
    assert "/release_memory_occupation" not in _stats(r, "s")["calls"]  # never released while busy
    busy.unlink()
    wait_for(lambda: e.state == ASLEEP, "s asleep once idle")
    assert e.restarts == 0


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_free_port_below_the_systems_range_is_a_free_port_below_it():
    highest = _ephemeral_low() - 1  # the system never picks one this low itself
    port = free_port(highest=highest)
    assert 1024 <= port <= highest
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free


def test_an_sglang_engine_is_started_on_a_port_its_release_accepts(running, monkeypatch):
    """SGLang 0.5.15 exits at start on a port above 55535 (the system picks one of those
    about once in five): the router picks below the engine's highest port. Here the highest is
    below the system's range, so the system's own pick would fail every start."""
    highest = _ephemeral_low() - 1
    if highest < 2048:
        pytest.skip("the system's port range starts too low to leave room below it")
    monkeypatch.setitem(HIGHEST_PORT, "sglang", highest)
    monkeypatch.setenv("STANDIN_HIGHEST_PORT", str(highest))
    r = running([{"name": "s", "engine": "sglang"}])
    r.ready()
    e = r.router.engines["s"]
    assert e.restarts == 0 and e.port <= highest
    assert complete(r.port, "s")[0] == 200


def test_a_stop_wake_whose_engine_exits_says_so_and_the_restart_serves(running, monkeypatch, tmp_path, caplog):
    fail = tmp_path / "start-fails"
    monkeypatch.setenv("STANDIN_FAIL_FILE", str(fail))
    r = running([{"name": "a", "idle_seconds": 0.3, "sleep": "stop"}], restart_backoff_s=0.5)
    r.ready()
    wait_for(lambda: r.router.engines["a"].state == ASLEEP, "a asleep (stopped)")
    fail.write_text("")  # the restart exits at once
    said = lambda: any("engine exited during its restart (log " in m for m in caplog.messages)  # noqa: E731
    with caplog.at_level("ERROR", logger="kvcached.router"), ThreadPoolExecutor(1) as ex:
        asked = ex.submit(complete, r.port, "a")
        wait_for(said, "the failed wake's line")
        fail.unlink()  # the next restart comes up; the request waits for it
        status, _ = asked.result()
    assert status == 200
