"""The plan of the GPU proof's sleep-engine step (scripts/gpu_proof/sleep_engine.py), checked
without a GPU: how many models exceed the device, how many stay awake, and a router config
that passes the router's own checks (``--dry-run`` starts nothing)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from repo_paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu_proof"))
sleep_engine = pytest.importorskip("sleep_engine")

GIB = 1 << 30


@pytest.mark.parametrize("device_gib, models, awake", [(139, 10, 5), (79.6, 6, 3)])
def test_fit_exceeds_the_device_and_keeps_the_awake_ones_beside_the_kv_budget(device_gib, models, awake):
    w = int(14.96 * GIB)  # the 8B shape's bf16 weights
    n, k = sleep_engine.fit(int(device_gib * GIB), w, 16 * GIB)
    assert (n, k) == (models, awake)
    assert n * w > device_gib * GIB and k * w + 16 * GIB < device_gib * GIB and n - k >= 2


def test_dry_run_writes_a_config_the_router_accepts(tmp_path):
    out = tmp_path / "out"
    rc = sleep_engine.main(
        ["--model", str(tmp_path), "--out", str(out), "--dry-run", "--device-gib", "139", "--weights-gib", "14.96"]
    )
    assert rc == 0
    cfg = json.loads((out / "router.json").read_text())
    assert cfg["max_awake"] == 5 and len(cfg["models"]) == 10
    m = cfg["models"][0]
    assert m["sleep"] == "engine" and "--enable-sleep-mode" in m["args"] and m["engine"] == "vllm"
    assert 0 < cfg["kvcached"]["gpu_utilization"] < 0.2  # the shared KV budget, 16 GiB of 139


def test_cpu_refuses_engine_sleep_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="neither engine can sleep on a CPU"):
        sleep_engine.main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--cpu", "--sleep", "engine"])
