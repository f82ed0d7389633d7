"""``python -m kvcached.bench router`` runs end to end: a router process over the
echo engine answers every request of every row (numbers are not judged here)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_router_benchmark_prints_every_row():
    r = subprocess.run(
        [sys.executable, "-m", "kvcached.bench", "router", "--requests", "20", "--clients", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [(x["mode"], x["path"]) for x in rows] == [
        ("json", "direct"),
        ("json", "router"),
        ("stream x16", "direct"),
        ("stream x16", "router"),
        ("parallel x2", "direct"),
        ("parallel x2", "router"),
    ]
    assert all(x["p50_ms"] > 0 for x in rows[:4]) and all(x["req_per_s"] > 0 for x in rows[4:])


def test_bad_arguments_exit_2_with_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "kvcached.bench", "router", "--requests", "0"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "--requests must be at least 1" in r.stderr
