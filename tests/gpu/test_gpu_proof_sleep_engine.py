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
    # The references are compared across processes: every engine pins its kernel configs.
    assert all(m["env"].get(k) == v for k, v in sleep_engine.PINNED_KERNELS.items()), m["env"]
    assert 0 < cfg["kvcached"]["gpu_utilization"] < 0.2  # the shared KV budget, 16 GiB of 139


def test_sglang_engines_keep_their_weights_through_the_release(tmp_path):
    """SGLang's memory saver drops the weights at a release unless they have a host copy: the
    step's engines get both options, and the router's own check accepts the config."""
    out = tmp_path / "out"
    shape = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps(shape))  # the 8B's: SGLang's KV tokens come from it
    argv = ["--model", str(tmp_path), "--out", str(out), "--dry-run", "--engine", "sglang", "--device-gib", "79.6"]
    assert sleep_engine.main(argv + ["--weights-gib", "14.96"]) == 0
    m = json.loads((out / "router.json").read_text())["models"][0]
    assert m["sleep"] == "engine" and m["engine"] == "sglang"
    assert "--enable-memory-saver" in m["args"] and "--enable-weights-cpu-backup" in m["args"]


def test_cpu_refuses_engine_sleep_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="neither engine can sleep on a CPU"):
        sleep_engine.main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--cpu", "--sleep", "engine"])


def test_the_first_differing_token_of_each_sequence_that_differs():
    want = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert sleep_engine.first_differences([[1, 2, 3], [4, 0, 6], [7, 8]], want) == [1, 2]  # [7, 8]: a prefix
    assert sleep_engine.first_differences(want, want) == []


def _run(sleep: str, wakes, failed: int = 0, diffs: int = 0) -> dict:
    return {
        "config": {"models": 3, "max_awake": 1, "sleep": sleep, "engine": "vllm", "kv": "16.0G", "burst": 2,
                   "zipf_seconds": 5.0, "rate": 1.0},
        "warmup_s": 10.0,
        "transitions": {"wakes": [["m1", 50.0, "stop"]] + [["m0", w, sleep] for w in wakes], "sleeps": [],
                        "evictions": []},
        "rotating": [{"model": "m0", "state_before": "asleep", "first_batch_s": 1.0, "token_diffs": diffs,
                      "ttft": {"n": 2, "p50": 0.1, "p99": 0.2, "max": 0.2}, "failed": failed}],
        "zipf": [["m0", "asleep", 1.5, True], ["m0", "ready", 0.05, True]],
        "router_rc": 0,
    }  # fmt: skip


def test_report_reads_a_finished_run_and_sets_the_status_from_its_checks(tmp_path, capsys):
    """``--report``: the report of the run in --out beside --compare's, starting nothing; exit 1
    when a token differed after a wake or a request failed."""
    for name, res in (("engine", _run("engine", [0.5, 0.6])), ("stop", _run("stop", [47.0]))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sleep_engine.json").write_text(json.dumps(res))
    argv = ["--model", str(tmp_path), "--out", str(tmp_path / "engine"), "--report"]
    assert sleep_engine.main(argv + ["--compare", str(tmp_path / "stop" / "sleep_engine.json")]) == 0
    out = capsys.readouterr().out
    assert "wakes by engine: n=2 " in out and "compare: wake p50/p99 vllm sleep: engine" in out
    assert "| vllm sleep: stop n=2 " in out
    (tmp_path / "engine" / "sleep_engine.json").write_text(json.dumps(_run("engine", [0.5], diffs=1)))
    assert sleep_engine.main(argv) == 1
    unsound = {**_run("engine", [0.5]), "control": {"m0": [], "m1": [12]}}  # m1 differed from itself
    (tmp_path / "engine" / "sleep_engine.json").write_text(json.dumps(unsound))
    assert sleep_engine.main(argv) == 1
    assert "references twice before any sleep): 16 sequences, 1 differ" in capsys.readouterr().out


def test_engine_env_reaches_every_engine_and_a_kept_host_copy_is_planned_for(tmp_path, capsys):
    """``TMS_RETAIN_CPU_BACKUP=1`` (the A/B of SGLang's release time): every engine gets it, and
    the host must hold every model's weights, the awake ones' copies too."""
    out = tmp_path / "out"
    shape = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    argv = ["--model", str(tmp_path), "--out", str(out), "--dry-run", "--engine", "sglang", "--device-gib", "79.6"]
    argv += ["--weights-gib", "14.96"]
    assert sleep_engine.main(argv) == 0
    assert "(3 models' host weights" in capsys.readouterr().out  # 6 models, 3 awake: the sleeping ones
    assert sleep_engine.main(argv + ["--engine-env", "TMS_RETAIN_CPU_BACKUP=1"]) == 0
    assert "(6 models' host weights" in capsys.readouterr().out
    models = json.loads((out / "router.json").read_text())["models"]
    assert all(m["env"].get("TMS_RETAIN_CPU_BACKUP") == "1" for m in models)


def test_engine_env_without_a_key_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--engine-env takes KEY=VALUE"):
        sleep_engine.main(["--model", str(tmp_path), "--out", str(tmp_path / "o"), "--engine-env", "=1"])


def test_the_comparison_names_each_arm_by_engine_mode_and_variables():
    assert sleep_engine.arm_name({"engine": "sglang", "sleep": "engine"}) == "sglang sleep: engine"
    retain = {"engine": "sglang", "sleep": "engine", "engine_env": {"TMS_RETAIN_CPU_BACKUP": "1"}}
    assert sleep_engine.arm_name(retain) == "sglang sleep: engine, TMS_RETAIN_CPU_BACKUP=1"
    assert sleep_engine.arm_name({"sleep": "stop"}) == "vllm sleep: stop"  # a run from before --engine
