"""Two real SGLang servers sharing one KV budget (CPU, tiny Llama built at test time).

Both are ``python -m sglang.launch_server`` unchanged, ``ENABLE_KVCACHED=true``,
with the same ``KVCACHED_HOST_MEMORY_BUDGET`` (40 kvcached pages of 16 KiB) and no
``--max-total-tokens``: each pool is sized from the whole budget, so together they
could hold twice what the budget allows, and the pages are the only thing shared.

1. A serves a batch and idles with its prefix cache full (about half the budget);
2. B gets a batch that needs more than what A leaves: B's requests wait, B publishes
   a want, the idle A evicts its cache and gives the pages back, B finishes;
3. A gets B's prompts while B idles with its own cache full: the same, the other way.

Checked: both engines' tokens for the same prompts are identical, neither crashed or
reported a leak, what both map together never exceeds the budget (sampled from their
shared-memory records under the budget's lock all along), and each engine really used
pages the other gave back (its peak exceeds what the other left it at the start).
A runs with ``--sleep-on-idle`` (its idle loop sleeps in a poll that kvcached's wake
ends, ``idle_wake.py``), B without. Both run with ``--enable-metrics``: their own
/metrics serve kvcached_* series equal to ``kvctl list --json`` at every step, and the
record's counters tell the story above (pages mapped by A's batch, A's give-backs, B's
refusals by the budget and its want served).

The budget counts every live kvcached instance of this user on the host: run alone
(as CI does), not beside other kvcached engines on the CPU.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict

import pytest
from engine_driver import BATCH, ServerClient, batch_prompts

from kvcached.testing.engine_metrics import check_scrape_agrees, scrape_agreeing_with_kvctl

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(os.path.dirname(HERE), "sglang_stubs")
KV_PAGE = 4096
BYTES_PER_PAGE = KV_PAGE * 2 * 2  # 2 layers x K/V
BUDGET_PAGES = 40  # A's cache (~21 pages) + B's batch (~26) do not fit
BUDGET = BUDGET_PAGES * BYTES_PER_PAGE


def _env(name: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "SGLANG_")) and k != "ENABLE_KVCACHED"}
    env["PYTHONPATH"] = STUBS + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        ENABLE_KVCACHED="true",
        KVCACHED_IPC_NAME=name,
        KVCACHED_PAGE_SIZE=str(KV_PAGE),
        KVCACHED_HOST_MEMORY_BUDGET=str(BUDGET),
        KVCACHED_MIN_RESERVED_PAGES="1",
        KVCACHED_MAX_RESERVED_PAGES="2",
    )
    if os.environ.get("KVCACHED_TRACE"):  # a trace of this run: python -m kvcached.bench burst --trace DIR
        env["KVCACHED_TRACE"] = os.environ["KVCACHED_TRACE"]
    return env


def _mapped(name: str) -> int:
    from kvcached.limits import read_record

    try:
        return int(read_record(name).mapped)
    except Exception:  # not created yet, or gone
        return 0


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory) -> Dict[str, Any]:
    work = tmp_path_factory.mktemp("two_engines")
    names = {k: f"kvcached_sglang_t{os.getpid()}_pair{k}" for k in "ab"}
    servers: Dict[str, ServerClient] = {}
    out: Dict[str, Any] = {"names": names, "logs": {k: str(work / f"{k}.log") for k in "ab"}}
    peak = {"sum": 0, "a": 0, "b": 0}
    stop = threading.Event()

    def sample() -> None:
        from kvcached.limits import DeviceBudget

        budget = DeviceBudget("cpu", BUDGET)
        while not stop.is_set():
            # Both records read under the budget's lock: no grant grows meanwhile.
            mapped = {r.name: r.mapped for r in budget.sample().records}
            a, b = mapped.get(names["a"], 0), mapped.get(names["b"], 0)
            peak.update(sum=max(peak["sum"], a + b), a=max(peak["a"], a), b=max(peak["b"], b))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        # One after the other (SGLang's start-up picks free ports); the second sizes
        # its pool from the same budget while the first holds pages.
        for k in "ab":
            cfg = {"model": tiny_model, "server_log": out["logs"][k]}
            kw = dict(page_size=16, log_level="info", max_total_tokens=None, enable_metrics=True)
            if k == "a":  # A idles asleep in its poll of the request sockets: kvcached wakes it to give back
                kw["extra_flags"] = ["--sleep-on-idle"]
            servers[k] = ServerClient(cfg, kw, env=_env(names[k]))
        sampler.start()
        a, b = servers["a"], servers["b"]

        def scrape(step: str) -> None:
            out["scrapes"][step] = {k: scrape_agreeing_with_kvctl(s.base, names[k]) for k, s in servers.items()}

        out["scrapes"] = {}
        scrape("start")
        out["a_first"] = [o["output_ids"] for o in a.generate(batch_prompts("p", 6), BATCH)]
        time.sleep(1.0)  # A idles with its cache full
        out["a_idle_mapped"] = _mapped(names["a"])
        out["b_left_at_start"] = BUDGET - out["a_idle_mapped"]
        scrape("a_cached")
        t0 = time.monotonic()
        out["b_batch"] = [o["output_ids"] for o in b.generate(batch_prompts("q", 10), BATCH)]
        out["b_batch_s"] = round(time.monotonic() - t0, 1)
        out["b_peak"] = peak["b"]
        out["a_after_b"] = _mapped(names["a"])
        scrape("b_served")
        time.sleep(1.0)  # B idles with its cache full; now A wants
        out["b_idle_mapped"] = _mapped(names["b"])
        out["a_left_at_start"] = BUDGET - out["b_idle_mapped"]
        peak["a"] = 0
        out["a_batch"] = [o["output_ids"] for o in a.generate(batch_prompts("q", 10), BATCH)]
        out["a_peak"] = peak["a"]
        out["a_again"] = [o["output_ids"] for o in a.generate(batch_prompts("p", 6), BATCH)]
        out["alive"] = {k: s.proc.poll() is None for k, s in servers.items()}
    finally:
        stop.set()
        for s in servers.values():
            s.close()
        if sampler.is_alive():
            sampler.join(5)
    out["peak_sum"] = peak["sum"]
    out["log_text"] = {k: open(p).read() for k, p in out["logs"].items() if os.path.exists(p)}
    return out


def test_both_engines_serve_identical_tokens(pair) -> None:
    assert pair["alive"] == {"a": True, "b": True}
    assert [len(x) for x in pair["b_batch"]] == [BATCH["max_new_tokens"]] * 10
    assert pair["a_batch"] == pair["b_batch"]  # the same prompts on the two engines
    assert pair["a_again"] == pair["a_first"]  # and A's own, before and after giving its cache away


def test_together_they_never_map_more_than_the_budget(pair) -> None:
    assert 0 < pair["peak_sum"] <= BUDGET


def test_each_idle_engine_gives_its_cache_to_the_wanting_one(pair) -> None:
    # A held about half the budget in its cache; B's batch needed more than A left it.
    assert pair["a_idle_mapped"] >= BUDGET // 3
    assert pair["b_peak"] > pair["b_left_at_start"], pair
    assert pair["a_after_b"] < pair["a_idle_mapped"]
    # And the other way round.
    assert pair["b_idle_mapped"] >= BUDGET // 3
    assert pair["a_peak"] > pair["a_left_at_start"], pair


def test_each_engines_metrics_agree_with_kvctl_and_tell_what_happened(pair) -> None:
    scrapes = pair["scrapes"]
    for step, by_engine in scrapes.items():
        for k, (samples, row) in by_engine.items():
            assert row["record_version"] == 2, (step, k)
            check_scrape_agrees(samples, row)

    def grew(k: str, since: str, until: str, counter: str) -> int:
        return scrapes[until][k][1]["counters"][counter] - scrapes[since][k][1]["counters"][counter]

    def served(k: str, since: str, until: str, hist: str) -> int:
        h0, h1 = (scrapes[s][k][1]["histograms"][hist]["count"] for s in (since, until))
        return h1 - h0

    # A's batch mapped pages (timed by the map histogram); its cache then stayed mapped.
    assert grew("a", "start", "a_cached", "pages_mapped") > 0
    assert served("a", "start", "a_cached", "map_seconds") > 0
    # B's batch: the budget refused B (it waited and published a want, which was served) ...
    assert grew("b", "a_cached", "b_served", "refused_budget") > 0
    assert served("b", "a_cached", "b_served", "want_served_seconds") > 0
    # ... and A gave its idle cache back, counted in give-backs and bytes.
    assert grew("a", "a_cached", "b_served", "give_backs") > 0
    assert grew("a", "a_cached", "b_served", "given_back_bytes") > 0


def test_no_crash_or_leak_reported(pair) -> None:
    for k, text in pair["log_text"].items():
        low = text.lower()
        assert "traceback" not in low and "out of memory" not in low and "leak" not in low, (k, text[-3000:])
        assert "ElasticMHATokenToKVPool" in text, k
