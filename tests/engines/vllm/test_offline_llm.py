"""vLLM's offline ``LLM`` with kvcached (EngineCore and worker in their own
processes, map/unmap over the IPC fan-out) against the same workload without
kvcached: identical greedy tokens, KV memory that follows the load in the
shared record and in the worker's own pages, prefix-cache hits, a clean exit.

One kvcached engine start for all checks (engine starts dominate CI time)."""

from __future__ import annotations

import os

import pytest
import vllm_engine_helpers as h

N = 12


@pytest.fixture(scope="module")
def kv_run(tiny_model, workdir):
    name = f"kvt_offline_{os.getpid()}"
    # No kv_cache_memory_bytes: the KV capacity comes from the kvcached budget.
    env = h.engine_env(True, name, KVCACHED_HOST_MEMORY_BUDGET="64M")
    out = os.path.join(workdir, "kvcached_offline.json")
    res = h.run_driver(tiny_model, out, env, "--name", name)
    res["name"] = name
    with open(out + ".log", errors="replace") as f:  # the engine's own log of idle give-backs
        res["given_to_peers"] = [ln.strip() for ln in f if "(wanted by a peer)" in ln]
    return res


def test_greedy_tokens_identical_with_and_without_kvcached(kv_run, native_run):
    assert len(kv_run["tokens1"]) == N and all(len(t) == h.MAX_TOKENS for t in kv_run["tokens1"])
    assert kv_run["tokens1"] == native_run["tokens1"]
    assert kv_run["tokens2"] == native_run["tokens2"] == native_run["tokens1"]
    assert kv_run["tokensB"] == native_run["tokensB"]
    assert kv_run["tokensC"] == native_run["tokensC"] and kv_run["tokensD"] == native_run["tokensD"]


def test_mapped_kv_rises_during_generation_and_falls_back_to_the_reserve(kv_run):
    name = kv_run["name"]
    before = kv_run["before"][name]
    # Idle after start: only the null block's page is mapped (the reserve starts empty).
    assert before["used"] == h.BPP and before["prealloc"] == 0
    assert before["total"] >= 64 << 20 and before["limit"] == before["total"]  # capacity from the 64M budget
    during = [s[name] for s in kv_run["during"] if s.get(name)]
    assert len(during) >= 5, "too few samples during generation"
    peak = max(h.mapped(r) for r in during)
    # 8 running requests x 2 blocks = 8 pages of 2 blocks, plus the null page.
    assert peak >= before["used"] + 6 * h.BPP, f"peak {peak} B: mapped KV did not rise"
    assert all(h.mapped(r) <= r["limit"] for r in during)
    after = kv_run["after_reset"][name]
    assert kv_run["reset"] is True
    # Everything freed and uncached: back to the null page plus at most the reserve.
    assert after["used"] == h.BPP
    assert after["prealloc"] <= h.MAX_RESERVED_PAGES * h.BPP
    assert h.mapped(after) < peak


def test_the_worker_maps_and_unmaps_what_the_record_says(kv_run):
    """The worker's physical pages (its memfds, as /proc shows them) move with
    the scheduler's record: 2 layers x one 128 KiB page per record page."""
    name = kv_run["name"]
    before, after = kv_run["before"], kv_run["after_reset"]
    zero = before[name + ":worker"] - h.mapped(before[name])  # the shared zero page
    assert 0 <= zero <= h.PAGE
    assert after[name + ":worker"] - zero == h.mapped(after[name])
    peak_phys = max(s.get(name + ":worker", 0) for s in kv_run["during"])
    assert peak_phys >= before[name + ":worker"] + 6 * h.BPP


def test_prefix_cache_hits_still_happen(kv_run, native_run):
    # Alone on the host nobody wants this engine's cache; another kvcached
    # instance sharing the cpu budget (another test run) takes it between passes.
    assert not kv_run["given_to_peers"], (
        f"another kvcached instance on this host took the cache: run alone; {kv_run['given_to_peers'][0]}"
    )
    assert kv_run["cached1"] == [0] * N
    # Every prompt's first (full) block is a hit in pass 2, as without kvcached.
    assert kv_run["cached2"] == native_run["cached2"] == [h.BLOCK_TOKENS] * N
    hits = kv_run["metrics"].get("vllm:prefix_cache_hits", 0)
    assert hits >= N * h.BLOCK_TOKENS, kv_run["metrics"]


def test_a_clean_exit_leaves_no_record_and_no_socket(kv_run):
    name = kv_run["name"]
    assert h.read_record(name) is None
    assert not os.path.exists(h.socket_root(name))
