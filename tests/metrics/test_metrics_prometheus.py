"""A real Prometheus server (the Debian `prometheus` package, installed by
scripts/setup_prometheus.sh) scrapes `kvctl metrics` on loopback, and a PromQL
query through its HTTP API returns the instances' series."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from limits_helpers import BPP, Worker, remove_records, unique_prefix
from metrics_helpers import BUDGET, Exporter
from repo_paths import ROOT

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no `prometheus` binary; run scripts/setup_prometheus.sh (Debian package)"
)
DEADLINE_S = 120  # Prometheus starts, scrapes every second, and answers within this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port: int, promql: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_exporter(tmp_path):
    prefix = unique_prefix()
    w = Worker(name=prefix + "p", pages=16, budget_bytes=BUDGET, scope=prefix)
    exp = Exporter("--prefix", prefix)
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: kvcached\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{exp.port}']\n"
    )
    log = open(tmp_path / "prometheus.log", "w")
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        assert w.call("alloc", n=3)["ok"]
        promql = f'kvcached_used_bytes{{name="{w.name}"}}'
        end, result = time.monotonic() + DEADLINE_S, []
        while time.monotonic() < end and prom.poll() is None:
            try:
                result = query(port, promql)
            except OSError:
                result = []  # not listening yet
            if result and float(result[0]["value"][1]) == 3 * BPP:
                break
            time.sleep(0.5)
        assert result, f"no series within {DEADLINE_S} s: {(tmp_path / 'prometheus.log').read_text()[-2000:]}"
        labels = result[0]["metric"]
        assert float(result[0]["value"][1]) == 3 * BPP
        assert labels["job"] == "kvcached" and labels["instance"] == f"127.0.0.1:{exp.port}"  # the target
        assert labels["name"] == w.name and labels["engine"] == "test" and labels["device"] == "cpu"
        # "Who holds the device's KV memory": the docs' query answers with this instance.
        held = query(port, 'topk(5, sum by (name) (kvcached_held_bytes{device="cpu"}))')
        assert w.name in {r["metric"]["name"] for r in held}
        free = query(port, 'kvcached_device_free_bytes{device="cpu"}')
        assert free and float(free[0]["value"][1]) <= BUDGET
        # Every query of the Grafana dashboard is valid PromQL for this server.
        with open(os.path.join(ROOT, "docs", "grafana_kvcached.json")) as f:
            exprs = [t["expr"] for p in json.load(f)["panels"] for t in p["targets"]]
        for e in exprs:
            query(port, e.replace("$device", "cpu"))
    finally:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(10)
        log.close()
        exp.stop()
        w.kill()
        remove_records(prefix)
