"""The kvcached_* Prometheus series against real instances in other processes
(host backend): the numbers agree with `kvctl list --json`, and the exporter
(`kvctl metrics`) serves them over HTTP, bounded, stopping on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, Tuple

import pytest

from kvcached import _C
from kvcached.limits.budget import WANT_TTL_S
from kvcached.metrics import exporter
from limits_helpers import BPP, Worker, kvctl, kvctl_list_json, poke
from metrics_helpers import BUDGET, Exporter, Samples, parse, scrape, value
from repo_paths import ROOT

FIELDS = {  # metric -> the `kvctl list --json` key it shows
    "kvcached_limit_bytes": "limit",
    "kvcached_granted_bytes": "granted",
    "kvcached_held_bytes": "held",
    "kvcached_mapped_bytes": "mapped",
    "kvcached_used_bytes": "used",
    "kvcached_reserved_bytes": "prealloc",
    "kvcached_virtual_bytes": "total",
    "kvcached_quarantined_bytes": "quarantined",
    "kvcached_limit_revision": "revision",
}


def listed(prefix: str) -> Dict[str, dict]:
    return {r["name"]: r for r in kvctl_list_json() if r["name"].startswith(prefix)}


def agreeing_scrape(prefix: str, get=scrape) -> Tuple[Samples, Dict[str, dict]]:
    """A scrape taken between two equal `kvctl list --json` reads (an owner's
    watcher may give slack back at any moment; then read again)."""
    for _ in range(20):
        before = listed(prefix)
        samples = get(prefix)
        after = listed(prefix)
        strip = lambda rows: {n: {k: v for k, v in r.items() if k != "updated_ns"} for n, r in rows.items()}  # noqa: E731
        if strip(before) == strip(after):
            return samples, after
    raise AssertionError("the records kept changing")


def check_agrees(samples: Samples, rows: Dict[str, dict]) -> None:
    held = 0
    for name, r in rows.items():
        labels = dict(name=name, engine=r["engine"], device=r["device"])
        for metric, key in FIELDS.items():
            assert value(samples, metric, **labels) == r[key], (metric, name)
        for state in ("alive", "pending", "dead", "busy", "invalid"):
            want = 1.0 if r["state"] == state else 0.0
            assert value(samples, "kvcached_instance_state", **labels, state=state) == want
        held += r["held"]
    assert value(samples, "kvcached_device_held_bytes", device="cpu") >= held  # other runs may share the host


@pytest.fixture
def pair(prefix):
    ws = [Worker(name=prefix + n, pages=16, budget_bytes=BUDGET, scope=prefix) for n in "ab"]
    yield ws
    for w in ws:
        w.kill()


def test_series_agree_with_kvctl_list(prefix, pair):
    a, b = pair
    assert a.call("alloc", n=3)["ok"] and b.call("alloc", n=1)["ok"]
    samples, rows = agreeing_scrape(prefix)
    assert set(rows) == {a.name, b.name}
    check_agrees(samples, rows)
    assert value(samples, "kvcached_used_bytes", name=a.name, engine="test", device="cpu") == 3 * BPP

    # Load moves: a frees, b grows; the series follow.
    a.call("free", n=3)
    assert b.call("alloc", n=2)["ok"]
    samples, rows = agreeing_scrape(prefix)
    check_agrees(samples, rows)
    assert value(samples, "kvcached_used_bytes", name=a.name, engine="test", device="cpu") == 0
    assert value(samples, "kvcached_used_bytes", name=b.name, engine="test", device="cpu") == 3 * BPP


def test_device_budget_and_free_bytes(prefix, pair):
    a, b = pair
    assert a.call("alloc", n=2)["ok"]
    # Records of this scope only: the sums are exact.
    samples, rows = agreeing_scrape(prefix)
    held = sum(r["held"] for r in rows.values())
    assert value(samples, "kvcached_device_budget_bytes", device="cpu") == BUDGET
    assert value(samples, "kvcached_device_held_bytes", device="cpu") == held > 0
    assert value(samples, "kvcached_device_free_bytes", device="cpu") == BUDGET - held
    assert value(samples, "kvcached_device_mapped_bytes", device="cpu") == sum(r["mapped"] for r in rows.values())
    assert value(samples, "kvcached_device_instances", device="cpu") == 2


def test_want_and_give_back_requests(prefix, pair):
    a, b = pair
    assert a.call("alloc", n=6)["ok"] and b.call("alloc", n=1)["ok"]
    labels = dict(name=b.name, engine="test", device="cpu")
    before = scrape(prefix)
    wakes_a = value(before, "kvcached_give_back_requests_total", name=a.name, engine="test", device="cpu")
    for _ in range(5):
        t0 = time.monotonic()
        assert b.call("short", need=3 * BPP)["published"]
        samples = scrape(prefix)
        wanted = _C.MemInfoTracker.open(b.name).snapshot().wanted
        if value(samples, "kvcached_wanted_bytes", **labels) or time.monotonic() - t0 < WANT_TTL_S:
            break
        time.sleep(0.3)  # a loaded box took longer than the want's life; publish it again
    assert wanted > 0 and value(samples, "kvcached_wanted_bytes", **labels) == wanted
    assert value(samples, "kvcached_device_wanted_bytes", device="cpu") == wanted
    assert value(samples, "kvcached_wanted_timestamp_seconds", **labels) > 0
    # b's want woke a (its peer) to give memory back: the record's counter moved.
    wakes = value(samples, "kvcached_give_back_requests_total", name=a.name, engine="test", device="cpu")
    assert wakes > wakes_a

    b.call("clear")
    samples = scrape(prefix)
    assert value(samples, "kvcached_wanted_bytes", **labels) == 0
    assert value(samples, "kvcached_device_wanted_bytes", device="cpu") == 0


def test_dead_and_invalid_records(prefix):
    w = Worker(name=prefix + "d", pages=16, budget_bytes=BUDGET, scope=prefix)
    try:
        assert w.call("alloc", n=2)["ok"]
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait(10)
    finally:
        w.kill()
    bad = _C.MemInfoTracker.create(prefix + "bad", "t", 0, 0, 4 * BPP, 4 * BPP)
    damaged = _C.MemInfoTracker.create(prefix + "dmg", "t", 0, 0, 4 * BPP, 4 * BPP)
    del bad  # its owner lock goes; its owner_pid below names no process
    poke(prefix + "bad", used=-5, owner_pid=-3)  # fields out of range: the record is not trusted
    poke(damaged.name, used=-5)  # the same while its owner (this process) lives
    samples, rows = agreeing_scrape(prefix)
    assert rows[prefix + "bad"]["state"] == "invalid" and rows[prefix + "d"]["state"] == "dead"
    assert rows[prefix + "dmg"]["state"] == "damaged"
    assert value(samples, "kvcached_instance_state", name=prefix + "dmg", engine="t", device="cpu",
                 state="damaged") == 1  # fmt: skip
    dead = dict(name=prefix + "d", engine="test", device="cpu")
    assert value(samples, "kvcached_instance_state", **dead, state="dead") == 1
    assert value(samples, "kvcached_held_bytes", **dead) == 0  # its memory died with it
    assert value(samples, "kvcached_used_bytes", **dead) == 2 * BPP  # the last numbers it published
    inv = rows[prefix + "bad"]
    assert value(samples, "kvcached_instance_state", name=inv["name"], engine=inv["engine"], device=inv["device"],
                 state="invalid") == 1  # fmt: skip
    # No numbers of an untrusted record, and none counted for the device.
    assert not [k for k in samples if k[0] == "kvcached_used_bytes" and ("name", prefix + "bad") in k[1]]
    assert ("kvcached_device_instances", (("device", "cpu"),)) not in samples  # nobody alive in this scope
    del damaged


# ------------------------------------------------------------------ the exporter


@pytest.fixture
def served(prefix):
    e = Exporter("--prefix", prefix)
    yield e
    e.stop()


def test_exporter_over_http(prefix, pair, served):
    a, _ = pair
    assert a.call("alloc", n=2)["ok"]
    samples, rows = agreeing_scrape(prefix, get=lambda _p: parse(served.get()))
    check_agrees(samples, rows)
    assert served.url.startswith("http://127.0.0.1:")  # loopback unless asked
    with pytest.raises(urllib.error.HTTPError) as e:
        served.get("/other")
    assert e.value.code == 404
    assert served.stop() == 0  # SIGTERM: a clean exit


def test_exporter_caps_connections(prefix, served):
    idle = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(exporter.MAX_CONNECTIONS)]
    try:
        # Connections are accepted in order, so this one finds every slot taken and is closed
        # unanswered, unless an earlier request's handler still held a slot when an idle one
        # came (that one was closed instead): either way at most MAX_CONNECTIONS are served.
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            extra_served = extra.recv(100) != b""
        # All at once (one by one, the later ones would meet the exporter's own deadlines):
        # a socket that is readable was closed by the exporter, one that is not is held open.
        import select

        readable, _, _ = select.select(idle, [], [], 0.3)
        closed = 0
        for s in readable:
            try:
                closed += s.recv(1) == b""  # data: impossible, nothing was asked
            except ConnectionError:
                closed += 1
        still_open = len(idle) - closed
        assert still_open + extra_served == exporter.MAX_CONNECTIONS, (still_open, extra_served)
    finally:
        for s in idle:
            s.close()
    for _ in range(100):  # the idle handlers notice the close and free their slots
        try:
            text = served.get()
            break
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    else:
        raise AssertionError("the exporter did not serve again after the idle connections closed")
    assert "# TYPE kvcached_device_held_bytes gauge" in text


def test_a_client_dripping_its_request_is_cut_at_the_deadline_and_blocks_no_scrape(prefix, monkeypatch):
    """Eight idle connections took every slot and one byte every ~4 s kept each forever (the
    10 s socket timeout only bounds silence): issue 34, item 8. Now more slots, and a deadline
    on each connection's whole life."""
    import threading

    monkeypatch.setattr(exporter, "REQUEST_DEADLINE_S", 1.0)
    server = exporter.start_server("127.0.0.1", 0, prefix)
    port = server.server_address[1]
    stop = threading.Event()
    cut = []

    def drip() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            try:
                while not stop.is_set():
                    s.sendall(b"G")
                    s.settimeout(0.3)
                    try:
                        if s.recv(1) == b"":
                            cut.append(1)  # closed by the exporter
                            return
                    except socket.timeout:
                        pass
            except ConnectionError:
                cut.append(1)

    drippers = [threading.Thread(target=drip, daemon=True) for _ in range(8)]
    try:
        for t in drippers:
            t.start()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            assert b"kvcached_device_held_bytes" in r.read()  # served while all eight drip
        for t in drippers:
            t.join(timeout=30)
        assert len(cut) == 8  # each was closed, though it kept sending
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_exporter_bad_input():
    r = kvctl("metrics", "--port", "70000")
    assert r.returncode == 2 and "outside [0, 65535]" in r.stderr and len(r.stderr.splitlines()) == 1
    r = kvctl("metrics")
    assert r.returncode == 2 and "--port" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = kvctl("metrics", "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen on" in r.stderr and "pick another --port" in r.stderr, r.stderr
    r = kvctl("metrics", "--port", "0", "--host", "192.0.2.1")  # not an address of this machine
    assert r.returncode == 2 and "cannot listen on" in r.stderr


# ------------------------------------------------------------------ an engine's /metrics

ENGINE_SCRAPE = """
import json
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from kvcached.metrics import register_engine_collector

assert register_engine_collector("vllm") is register_engine_collector("vllm")  # idempotent
reg = CollectorRegistry()  # what SGLang (and vLLM with several API servers) serve
multiprocess.MultiProcessCollector(reg)
print(json.dumps({"default": generate_latest(REGISTRY).decode(), "multi": generate_latest(reg).decode()}))
"""


def test_engine_registries_show_their_instance_only(prefix, tmp_path):
    base = prefix + "eng"
    recs = [_C.MemInfoTracker.create(n, "vllm", 0, 0, 4 * BPP, 4 * BPP) for n in (base, base + "_g1", prefix + "other")]
    env = dict(os.environ, KVCACHED_IPC_NAME=base, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", ENGINE_SCRAPE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for text in json.loads(r.stdout).values():
        names = {dict(k[1])["name"] for k in parse(text) if k[0] == "kvcached_limit_bytes"}
        assert names == {base, base + "_g1"}, names  # not prefix + "other", nor any other run's
        assert "kvcached_device_held_bytes" in text
    del recs


def test_docs_and_dashboard_use_exactly_the_exported_names(prefix, pair):
    """docs/OBSERVABILITY.md documents every series, and the Grafana dashboard
    uses no name the collector does not export."""
    import re

    assert pair[0].call("alloc", n=1)["ok"]
    exported = {name for name, _ in scrape(prefix)}
    with open(os.path.join(ROOT, "docs", "OBSERVABILITY.md")) as f:
        documented = set(re.findall(r"`(kvcached_[a-z_]+)`", f.read()))
    assert exported <= documented, exported - documented
    with open(os.path.join(ROOT, "docs", "grafana_kvcached.json")) as f:
        dash = json.load(f)
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"kvcached_[a-z_]+", t["expr"])}
    assert used and used <= exported, used - exported


def test_a_guarded_collector_never_fails_the_scrape_it_joins():
    """In an engine's /metrics a failing read of the records yields no kvcached
    series (logged once) instead of failing the engine's own; the exporter's
    unguarded collector raises."""
    from kvcached.metrics.collector import KvcachedCollector

    def broken():
        raise OSError("records unreadable")

    guarded, bare = KvcachedCollector(guarded=True), KvcachedCollector()
    guarded._records = bare._records = broken  # the failure that cannot be caused for real here
    assert list(guarded.collect()) == [] and list(guarded.collect()) == []
    with pytest.raises(OSError):
        list(bare.collect())


def test_router_metrics_label_records_by_name_not_instance(prefix):
    """The router's /metrics labelled records ``instance``, which Prometheus overwrites with
    the scrape target (issue 34, item 7): ``name``, as the exporter labels them."""
    from kvcached.router.metrics import kvcached_record_lines

    t = _C.MemInfoTracker.create(prefix + "r", "vllm", 0, 0, 1 << 16, 1 << 16)
    try:
        lines = [x for x in kvcached_record_lines({prefix + "r": "alpha"}) if prefix in x]
        assert lines and all(f'{{name="{prefix}r",model="alpha",' in x for x in lines), lines
        assert not any("instance=" in x for x in kvcached_record_lines({}))
    finally:
        t.unlink()
