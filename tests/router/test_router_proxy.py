"""The router in front of real stand-in engine processes (tests/router/test_router_standin.py):
routing by model, streaming passthrough, sleep after idle and wake on request
(both ways that need no kvcached record), restart after a crash, the bounded
wait, metrics, and every child stopped at shutdown. These test the router; the
real-engine proof is tests/engines/router."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from kvcached.router.config import ENGINE_SLEEP_FLAGS, parse_config
from kvcached.router.router import idle_due
from kvcached.router.supervisor import ASLEEP, READY, ModelEngine, free_port
from repo_paths import ROOT
from router_helpers import BOUND_S, complete, request, wait_for
from test_router_standin import standin_python


def test_routes_by_model_lists_models_and_refuses_unknown(running):
    r = running([{"name": "alpha"}, {"name": "beta"}])
    r.ready()
    for name in ("alpha", "beta"):
        status, out = complete(r.port, name)
        assert status == 200 and out["model"] == name and out["pid"] == r.pid(name)
    status, _, body = request(r.port, "POST", "/v1/chat/completions", {"model": "beta", "messages": []})
    assert status == 200 and json.loads(body)["model"] == "beta"
    status, _, body = request(r.port, "GET", "/v1/models")
    assert [(m["id"], m["state"]) for m in json.loads(body)["data"]] == [("alpha", "ready"), ("beta", "ready")]
    status, out = complete(r.port, "gamma")
    assert status == 404 and out["error"]["code"] == "model_not_found" and "alpha, beta" in out["error"]["message"]
    status, _, body = request(r.port, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 400 and "names no model" in json.loads(body)["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=BOUND_S)
    conn.request("POST", "/v1/completions", body=b"{oops", headers={"Content-Type": "application/json"})
    assert conn.getresponse().status == 400
    conn.close()
    status, _, body = request(r.port, "GET", "/health")
    assert status == 200 and json.loads(body)["models"] == {"alpha": "ready", "beta": "ready"}


def test_stream_is_passed_through_as_it_arrives(running, monkeypatch):
    monkeypatch.setenv("STANDIN_GATE", "1")
    r = running([{"name": "alpha"}])
    r.ready()
    engine = r.router.engines["alpha"]
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=BOUND_S)
    body = json.dumps({"model": "alpha", "prompt": "hi", "max_tokens": 3, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    assert resp.getheader("Transfer-Encoding") == "chunked"
    # The first event arrives while the engine holds back the second (its gate is shut).
    first = resp.readline() + resp.readline()
    assert json.loads(first.decode()[6:])["choices"][0]["text"] == "alpha-0"
    assert engine.inflight == 1
    # Counted with its status, before the answer ends: a client that has read all of it and
    # then reads /metrics finds it counted (CI: the router engine test read it first).
    counted = 'kvcached_router_requests_total{model="alpha",code="200"} 1'
    assert counted in request(r.port, "GET", "/metrics")[2].decode()
    request(engine.port, "POST", "/open_gate", {})
    rest = resp.read().decode()
    events = [e for e in rest.split("\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["alpha-1", "alpha-2"]
    assert events[-1] == "data: [DONE]"
    conn.close()
    wait_for(lambda: engine.inflight == 0, "request released")
    assert counted in request(r.port, "GET", "/metrics")[2].decode()  # once


def test_idle_model_sleeps_and_a_request_wakes_it(running):
    r = running([{"name": "alpha", "idle_seconds": 0.3}, {"name": "beta"}])
    r.ready()
    first_pid = complete(r.port, "alpha")[1]["pid"]
    alpha = r.router.engines["alpha"]
    wait_for(lambda: alpha.state == ASLEEP, "alpha asleep")
    assert alpha.proc is None  # sleep: stop (auto on an engine without its sleep flag)
    with pytest.raises(ProcessLookupError):
        os.killpg(first_pid, 0)
    assert r.router.engines["beta"].state == READY  # no idle_seconds: never sleeps
    status, out = complete(r.port, "alpha")  # waits for the wake
    assert status == 200 and out["pid"] != first_pid
    text = request(r.port, "GET", "/metrics")[2].decode()
    assert 'kvcached_router_sleeps_total{model="alpha"} 1' in text
    assert 'kvcached_router_wakes_total{model="alpha"} 1' in text
    assert 'kvcached_router_wake_seconds_count{model="alpha"} 1' in text
    assert 'kvcached_router_requests_total{model="alpha",code="200"} 2' in text
    assert 'kvcached_router_model_state{model="alpha",state="ready"} 1' in text


def test_engine_sleep_calls_the_engines_own_endpoints(running):
    r = running(
        [
            {"name": "v", "args": ["--enable-sleep-mode"], "idle_seconds": 0.3},
            {"name": "s", "engine": "sglang", "args": list(ENGINE_SLEEP_FLAGS["sglang"]), "idle_seconds": 0.3},
        ]
    )
    r.ready()
    pids = {n: complete(r.port, n)[1]["pid"] for n in ("v", "s")}
    for n in ("v", "s"):
        wait_for(lambda n=n: r.router.engines[n].state == ASLEEP, f"{n} asleep")
        stats = json.loads(request(r.router.engines[n].port, "GET", "/stats")[2])
        assert stats["sleeping"] is True
    for n in ("v", "s"):
        status, out = complete(r.port, n)
        assert status == 200 and out["pid"] == pids[n]  # the same process, woken
    calls = {n: json.loads(request(r.router.engines[n].port, "GET", "/stats")[2])["calls"] for n in ("v", "s")}
    assert calls["v"][1:4] == ["/sleep?level=1", "/wake_up", "/v1/completions"]
    # SGLang is asked to be idle first (its release asserts an idle scheduler).
    assert calls["s"][1:5] == [
        "/flush_cache?timeout=30",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/v1/completions",
    ]


def test_killed_engine_is_restarted_and_requests_wait_for_it(running):
    r = running([{"name": "alpha"}])
    r.ready()
    old = r.pid("alpha")
    os.killpg(old, signal.SIGKILL)
    status, out = complete(r.port, "alpha")  # the router notices (now or at its next check) and restarts
    assert status == 200 and out["pid"] != old
    assert r.router.engines["alpha"].restarts == 1
    text = request(r.port, "GET", "/metrics")[2].decode()
    assert 'kvcached_router_restarts_total{model="alpha"} 1' in text


def test_request_to_an_engine_killed_unnoticed_waits_for_its_restart(running):
    r = running([{"name": "alpha"}])
    r.ready()
    r.router.interval = 3600  # the monitor would not look again: the request itself notices
    old = r.pid("alpha")
    os.killpg(old, signal.SIGKILL)
    status, out = complete(r.port, "alpha")
    assert status == 200 and out["pid"] != old
    assert r.router.engines["alpha"].restarts == 1


def test_crash_loop_backs_off_and_recovers(running, tmp_path, monkeypatch):
    fail = tmp_path / "fail"
    fail.write_text("")
    monkeypatch.setenv("STANDIN_FAIL_FILE", str(fail))
    r = running([{"name": "alpha"}], restart_backoff_s=0.05, restart_backoff_max_s=0.4)
    alpha = r.router.engines["alpha"]
    wait_for(lambda: alpha.restarts >= 4, "several restarts")
    assert alpha.last_exit == 3 and alpha.backoff_s == 0.4  # doubled up to the maximum
    fail.unlink()
    r.ready()
    assert complete(r.port, "alpha")[0] == 200


def test_wait_for_a_model_is_bounded(running, monkeypatch):
    monkeypatch.setenv("STANDIN_START_DELAY", "30")
    r = running([{"name": "slow"}], wake_timeout_s=0.5)
    status, headers, body = request(r.port, "POST", "/v1/completions", {"model": "slow", "prompt": "x"})
    assert status == 503 and headers["Retry-After"] == "10"
    assert "not serving within 0.5 s (state starting)" in json.loads(body)["error"]["message"]
    assert r.router.engines["slow"].waiting == 0


def test_idle_policy_never_sleeps_a_busy_model(tmp_path):
    spec = parse_config({"models": [{"name": "m", "engine": "vllm", "model": str(tmp_path), "idle_seconds": 10}]})
    e = ModelEngine(spec.models[0])
    e.state, e.last_activity = READY, 100.0
    assert not idle_due(e, 109.0) and idle_due(e, 110.0)
    e.inflight = 1
    assert not idle_due(e, 1000.0)
    e.inflight, e.waiting = 0, 1
    assert not idle_due(e, 1000.0)
    e.waiting, e.state = 0, ASLEEP
    assert not idle_due(e, 1000.0)


def test_sigterm_stops_the_router_and_every_engine(tmp_path):
    port = free_port()
    cfg = {
        "port": port,
        "health_interval_s": 0.1,
        "log_dir": str(tmp_path / "logs"),
        "models": [
            {"name": n, "engine": "vllm", "model": str(tmp_path), "kvcached": False, "python": standin_python(tmp_path)}
            for n in ("a", "b")
        ],
    }
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcached.router", "serve", str(tmp_path / "c.json")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "listening on http://127.0.0.1:" in proc.stdout.readline()
        states = lambda: json.loads(request(port, "GET", "/health")[2])["models"]  # noqa: E731
        wait_for(lambda: states() == {"a": "ready", "b": "ready"}, "both ready")
        pids = [json.loads(request(port, "POST", "/v1/completions", {"model": n})[2])["pid"] for n in ("a", "b")]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_a_burst_of_connections_at_once_is_served(running):
    # A burst's clients connect within a millisecond: the listen queue must hold them
    # (socketserver's default of 5 refused some of 64 on the H200 run).
    r = running([{"name": "alpha"}])
    r.ready()
    n = 200
    go = threading.Barrier(n)
    results = []

    def one():
        go.wait()
        try:
            results.append(complete(r.port, "alpha")[0])
        except OSError as e:
            results.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert results.count(200) == n, [x for x in results if x != 200][:5]
