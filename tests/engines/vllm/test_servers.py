"""Two vLLM OpenAI servers with kvcached under one shared KV budget.

* the server's greedy tokens equal vLLM's without kvcached;
* an engine capped with ``kvctl limit`` below what its load needs preempts and
  completes every request (same tokens), never maps past the limit;
* under that limit, more shared prefixes than it can hold are evicted and
  recomputed: the tokens are still vLLM's;
* a limit lowered while every request decodes: the engine preempts down to it
  while decoding, every request completes with the same tokens; raised again,
  it grows;
* together the two never map past the shared budget, also when both are loaded;
* with a bounded prefix cache, an engine's memory falls back after the load;
* an idle engine whose prefix cache holds most of the budget gives it back
  to a loaded peer;
* ``kill -9`` of an engine leaves a dead record and a stale socket directory;
  an engine restarted under the same name replaces both and serves;
* stopping a server (SIGTERM) leaves neither;
* the benchmarks' engine view (``kvcached.bench.engine_view``) of a run counts
  its steps and tokens from vLLM's /metrics.

Three server starts in all (S1 and S2 at once, S3 under S1's name after the kill)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import vllm_engine_helpers as h

from kvcached.testing.engine_metrics import check_scrape_agrees, scrape_agreeing_with_kvctl

BUDGET = 4 << 20  # 16 pages of 256 KiB for both engines together
CAP = 1 << 20  # S2's limit: the null page + 3 pages = 7 blocks for 8 requests that grow to 2 blocks each


@pytest.fixture(scope="module")
def servers(tiny_model, workdir):
    tag = os.getpid()
    names = (f"kvt_s1_{tag}", f"kvt_s2_{tag}")
    common = dict(KVCACHED_HOST_MEMORY_BUDGET=str(BUDGET))
    started = []
    try:
        s1 = h.start_server(
            tiny_model,
            names[0],
            h.engine_env(True, names[0], KVCACHED_MAX_CACHED_TOKENS="256", VLLM_CPU_OMP_THREADS_BIND="0", **common),
            workdir,
        )
        started.append(s1)
        s2 = h.start_server(
            tiny_model, names[1], h.engine_env(True, names[1], VLLM_CPU_OMP_THREADS_BIND="1", **common), workdir
        )
        started.append(s2)
        h.wait_healthy(s1)
        h.wait_healthy(s2)
        yield {"s1": s1, "s2": s2, "model": tiny_model, "workdir": workdir, "started": started}
    finally:
        for s in started:
            s.stop()


def _budget_to_ourselves(servers) -> None:
    """The shared-budget checks count every kvcached instance on the host's cpu
    device: a foreign live one (another test run) moves memory on its own wants."""
    from kvcached.limits.records import list_records

    ours = {s.name for s in servers["started"]}
    foreign = [r.name for r in list_records() if r.alive and r.device == "cpu" and r.name not in ours]
    if foreign:
        pytest.fail(f"other kvcached instances share this host's cpu budget ({', '.join(foreign)}): run alone")


def _run_all(srv: h.Server, prompts, max_tokens: int):
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: h.complete(srv, p, max_tokens), prompts))


def test_server_greedy_tokens_identical_to_vllm_without_kvcached(servers, native_run):
    s1 = servers["s1"]
    got = _run_all(s1, h.prompts(12), h.MAX_TOKENS)
    assert got == native_run["tokens1"]


def test_the_engine_view_of_a_run_counts_its_steps_and_tokens(servers):
    from kvcached.bench.engine_view import scrape, view

    s1, n = servers["s1"], 4
    before = scrape(s1.port)
    t0 = time.monotonic()
    _run_all(s1, h.prompts(n, seed=9), h.MAX_TOKENS)
    duration = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while True:  # the last step's stats are recorded just after its tokens go out
        v = view(before, scrape(s1.port), duration)
        if v["generation_tokens"] >= n * h.MAX_TOKENS or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert v["generation_tokens"] == n * h.MAX_TOKENS, v
    assert v["prompt_tokens"] == n * 201, v  # BOS + 200
    assert h.MAX_TOKENS <= v["steps"] <= n * h.MAX_TOKENS, v
    # Cached prompt tokens are not computed. A count rebuilt from a float mean: 932 / 58 * 58 is
    # 932.0000000000001 (CI, 0.32), hence round().
    assert round(v["tokens_per_step"] * v["steps"]) <= n * (201 + h.MAX_TOKENS), v
    assert v["preemptions"] == 0 and v["ms_per_step"] > 0 and v["decode_ms"] > 0, v


def test_the_engines_own_metrics_endpoint_serves_its_kvcached_series(servers):
    """vLLM's /metrics carries kvcached_* of this engine's instance (and not its
    peer's), with the record's numbers: an existing scrape config needs no change."""
    import urllib.request

    s1, s2 = servers["s1"], servers["s2"]
    with urllib.request.urlopen(f"http://127.0.0.1:{s1.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    mine = [ln for ln in text.splitlines() if ln.startswith("kvcached_limit_bytes{") and f'name="{s1.name}"' in ln]
    assert mine, "no kvcached series in vLLM's /metrics"
    assert float(mine[0].rsplit(" ", 1)[1]) == h.read_record(s1.name)["limit"]
    assert f'name="{s2.name}"' not in text  # another engine's instance is its own /metrics' business
    assert "kvcached_device_budget_bytes{" in text


def _scrape_agreeing_with_kvctl(srv: h.Server):
    return scrape_agreeing_with_kvctl(f"http://127.0.0.1:{srv.port}", srv.name)


class _Load:
    """Prompts sent in one streamed request (the engine gets them together: sent one by
    one from threads on the loaded 2-core CI machine, the tiny model finished each in a
    fraction of a second and vLLM 0.32 never ran more than 2 at once); the client's view
    of which run: a prompt whose first token has arrived is running in the engine until
    its last one has (vLLM holds its blocks all that time, or preempts it)."""

    def __init__(self, srv: h.Server, prompts, max_tokens: int, on_chunk=None):
        self._lock = threading.Lock()
        self._on_chunk = on_chunk
        self.started = self.finished = self.most_running = 0
        self._seen = [False] * len(prompts)
        self._ex = ThreadPoolExecutor(1)
        self._fut = self._ex.submit(h.stream_batch, srv, [list(p) for p in prompts], max_tokens, self._token)

    def _token(self, i: int, finished: bool) -> None:
        with self._lock:
            if not self._seen[i]:
                self._seen[i] = True
                self.started += 1
            self.finished += finished
            self.most_running = max(self.most_running, self.started - self.finished)
        if self._on_chunk is not None:
            self._on_chunk()

    def running(self) -> int:
        with self._lock:
            return self.started - self.finished

    def done(self) -> bool:
        return self._fut.done()

    def result(self):
        try:
            return self._fut.result()
        finally:
            self._ex.shutdown()


def test_capped_engine_preempts_and_completes_instead_of_crashing(servers, native_run):
    s1, s2 = servers["s1"], servers["s2"]
    r = h.kvctl("limit", s2.name, "1M")
    assert r.returncode == 0, r.stderr
    rec = h.read_record(s2.name)
    assert rec["limit"] == CAP
    before = h.metrics(s2).get("vllm:num_preemptions_total", 0)
    sampler = h.Sampler([s1.name, s2.name], workers=False)
    # Sampled at every streamed token, not on a timer: on the loaded 2-core CI machine a
    # timer thread got 4 turns in the whole load (CI, 0.29, e87003e).
    on_token = lambda: sampler.samples.append(sampler.sample())  # noqa: E731
    # The prompts twice over: 8 requests that arrive staggered can run without ever
    # needing more than 7 blocks at once (CI, 0.32: no preemption); 16 keep the
    # waiting queue full, so every free block is taken and a request that needs its
    # second block finds none.
    load = _Load(s2, h.decode_prompts() * 2, h.LONG_DECODE, on_chunk=on_token)
    got = load.result()
    assert got == native_run["tokensB"] * 2  # every request completed, preempted or not, with the same tokens
    samples = [s for s in sampler.samples if s.get(s2.name)]
    assert len(samples) >= 16  # one per token: the engine was seen while it held blocks
    peak = max(h.mapped(s[s2.name]) for s in samples)
    assert peak <= CAP
    assert all(h.mapped(s[s1.name]) + h.mapped(s[s2.name]) <= BUDGET for s in samples)
    preempted = h.metrics(s2).get("vllm:num_preemptions_total", 0) - before
    assert preempted > 0, (
        f"the capped engine never preempted: the cap did not bite (at most {load.most_running} requests "
        f"streamed at once; peak {peak / h.BPP:.1f} pages of {CAP // h.BPP})"
    )
    assert s2.proc.poll() is None and h.read_record(s2.name)["alive"]


def _prefix_hits(srv: h.Server) -> float:
    return sum(v for k, v in h.metrics(srv).items() if k.startswith("vllm:prefix_cache_hits"))


def test_prefixes_evicted_under_a_small_limit_are_recomputed_with_the_same_tokens(servers, native_run):
    """8 groups' prefix blocks (and their tails) cannot all stay cached in S2's 6
    blocks: cached prefixes are evicted for new requests, preemption happens too,
    and the second pass recomputes what was evicted."""
    s2 = servers["s2"]
    assert h.read_record(s2.name)["limit"] == CAP  # from the previous test
    hits = _prefix_hits(s2)
    with h.Sampler([s2.name], workers=False) as sampler:
        got1 = _run_all(s2, h.shared_prefix_prompts(), h.PREFIX_DECODE)
        got2 = _run_all(s2, h.shared_prefix_prompts(), h.PREFIX_DECODE)
    assert got1 == got2 == native_run["tokensC"]
    assert _prefix_hits(s2) > hits  # the prefix cache still works under the limit
    assert max(h.mapped(s[s2.name]) for s in sampler.samples if s.get(s2.name)) <= CAP


def _lower_the_limit_while_decoding(s1: h.Server, s2: h.Server, n: int) -> dict:
    """Streams the grow load at S2 and lowers its limit to CAP once ``n`` requests run;
    what the client and the record saw."""
    from kvcached.control import set_instance_memory_limit

    assert h.kvctl("limit", s2.name, "4M").returncode == 0
    preempted = h.metrics(s2).get("vllm:num_preemptions_total", 0)
    with h.Sampler([s1.name, s2.name], workers=False, period=0.005) as sampler:
        # The prompts twice over: 8 requests that arrive staggered may never all run at
        # once (CI: at most 7), 16 keep vLLM's 8 sequences full.
        load = _Load(s2, h.grow_prompts() * 2, h.GROW_DECODE)
        # Lowered only once 8 requests stream tokens at once (each holds a block: 4 pages
        # + the null page, over the new limit); a request needs its second block only
        # ~100 decode steps after its first token. Lowered before 8 run, vLLM would admit
        # only what fits and never preempt. (Polling vLLM's running gauge over /metrics
        # raced: a scrape under load can outlast the load.)
        deadline = time.monotonic() + 120
        while not load.done() and load.running() < n and time.monotonic() < deadline:
            time.sleep(0.002)
        t_drop = time.monotonic()
        mapped_at_drop = h.mapped(h.read_record(s2.name))
        at_drop = f"{mapped_at_drop / h.BPP:.1f} pages mapped, {load.running()} running"
        r = set_instance_memory_limit(CAP, name=s2.name, wait_s=0)  # in-process: no interpreter start
        assert r.status in ("applied", "deferred"), r.message
        got = load.result()
        t_done = time.monotonic()
    s1_pages = sorted({h.mapped(s[s1.name]) // h.BPP for s in sampler.samples if s.get(s1.name)})
    during = [h.mapped(s[s2.name]) for s in sampler.samples if t_drop < s["t"] < t_done and s.get(s2.name)]
    return dict(
        ran_all=load.most_running >= n,
        never_ran=f"vLLM never ran {n} requests at once (at most {load.most_running}); at the end: {at_drop}; "
        f"pages S1 mapped meanwhile: {s1_pages}",
        got=got,
        mapped_at_drop=mapped_at_drop,
        during=during,
        decoded_after_drop_s=t_done - t_drop,
        preemptions=h.metrics(s2).get("vllm:num_preemptions_total", 0) - preempted,
        seen=f"at the drop: {at_drop}; {t_done - t_drop:.2f} s of load after it; "
        f"pages after it: {sorted(set(m // h.BPP for m in during))}",
    )


def test_a_limit_lowered_while_decoding_is_reached_while_decoding_and_every_request_completes(servers, native_run):
    s1, s2 = servers["s1"], servers["s2"]
    n = len(h.grow_prompts())  # vLLM's max_num_seqs
    attempts = []
    for _ in range(3):
        run = _lower_the_limit_while_decoding(s1, s2, n)
        assert run["got"] == native_run["tokensD"] * 2  # no request failed; preempted ones recomputed the same
        attempts.append(run["seen"])
        reached = bool(run["during"]) and min(run["during"]) <= CAP
        if run["ran_all"] and (run["preemptions"] > 0 or run["decoded_after_drop_s"] > 1.0) and reached:
            break
        # Not the case under test; again: the client saw 8 running only as the load was
        # ending (a finished stream not yet counted), so its requests finished instead of
        # shrinking; or staggered streams never had 8 at once (CI, 0.26 under load: 6).
        # Or the limit was not reached before the load ended (CI, 0.32: a page over it for
        # the last 1.75 s): vLLM preempts only when a request needs a block, and a freed
        # block's page stays while another request's block lives on it. Three in a row fail.
    assert run["ran_all"], run["never_ran"]
    seen = f"{run['seen']} (attempts: {attempts})"
    during = run["during"]
    assert run["preemptions"] > 0, seen
    # It was over the new limit when it was lowered (read just before; the engine may be
    # under it by the sampler's next look: CI, 0.26, 6 pages then only 4 sampled) ...
    assert run["mapped_at_drop"] > CAP, seen
    assert during and min(during) <= CAP, seen  # ... and got under it while its requests still decoded
    # Raised again: the same load grows past the old limit. Streamed together and twice
    # over (8 separate requests on a busy 2-core host can run one after another, within
    # the old limit: CI, 0.32), and the record read on every chunk as well as by the
    # sampler thread (which a busy host can starve for the whole load).
    assert h.kvctl("limit", s2.name, "4M").returncode == 0
    seen = []
    with h.Sampler([s2.name], workers=False) as sampler:
        load = _Load(s2, h.grow_prompts() * 2, h.GROW_DECODE, lambda: seen.append(h.mapped(h.read_record(s2.name))))
        assert load.result() == native_run["tokensD"] * 2
    sampled = [h.mapped(s[s2.name]) for s in sampler.samples if s.get(s2.name)]
    assert max(sampled + seen) > CAP, (
        f"did not grow past the old limit after it was raised: {len(sampled)} samples, {len(seen)} chunk reads, "
        f"at most {load.most_running} streamed at once, record {h.read_record(s2.name)}"
    )


def _refused_budget(srv: h.Server) -> int:
    return h.read_record(srv.name)["counters"].get("refused_budget", 0)


def test_two_loaded_engines_share_one_budget(servers, native_run):
    _budget_to_ourselves(servers)
    s1, s2 = servers["s1"], servers["s2"]
    assert h.kvctl("limit", s2.name, "4M").returncode == 0
    refused = _refused_budget(s1) + _refused_budget(s2)
    with h.Sampler([s1.name, s2.name], workers=False) as sampler:
        # Twice over, as in the capped test: 16 requests keep 8 running in each engine,
        # 9 pages each at most: more than the budget's 16 together.
        loads = [_Load(srv, h.decode_prompts() * 2, h.LONG_DECODE) for srv in (s1, s2)]
        got1, got2 = (load.result() for load in loads)
    assert got1 == got2 == native_run["tokensB"] * 2
    both = [h.mapped(s[s1.name]) + h.mapped(s[s2.name]) for s in sampler.samples if s.get(s1.name) and s.get(s2.name)]
    assert both and max(both) <= BUDGET
    # The budget, not a limit, held one of them back (counted by the engines, not sampled:
    # the sampler shares 2 cores with both engines and took a sample every 70 ms in CI,
    # longer than S1's whole load once S2 had finished and given the budget up).
    assert _refused_budget(s1) + _refused_budget(s2) > refused
    # Both really used memory (the null page is one).
    peaks = [max(h.mapped(s[srv.name]) for s in sampler.samples) // h.BPP for srv in (s1, s2)]
    assert min(peaks) > 1, f"peak pages {peaks}; at most {[load.most_running for load in loads]} streamed at once"


def test_bounded_prefix_cache_lets_memory_fall_back_after_load(servers):
    s1 = servers["s1"]
    time.sleep(0.5)
    rec = h.read_record(s1.name)
    # KVCACHED_MAX_CACHED_TOKENS=256: at most 2 cached blocks stay after the
    # load, on at most 2 pages, plus the null page and the reserve.
    assert rec["used"] <= 3 * h.BPP, rec
    assert rec["prealloc"] <= h.MAX_RESERVED_PAGES * h.BPP, rec


def _given_back(name: str) -> int:
    """Bytes the instance's idle give-backs unmapped so far (its record's counter: an idle
    engine gives back only to a peer short of budget or under a lowered limit)."""
    return h.read_record(name)["counters"].get("given_back_bytes", 0)


def _load_a_peer_of_an_idle_cache(s1, s2, native_run) -> tuple:
    """S2 fills its prefix cache and goes idle; S1 then runs a load larger than what is
    left of the budget. Returns (S2's bytes held before and after, the bytes S2's give-backs
    unmapped during the load)."""
    # S2 (unbounded prefix cache) keeps one cached block per request, each on
    # its own page: it ends up holding most of the shared budget while idle.
    _run_all(s2, h.prompts(12, seed=7), 8)
    time.sleep(1.5)
    held, given0 = h.mapped(h.read_record(s2.name)), _given_back(s2.name)
    assert held >= 8 * h.BPP, h.read_record(s2.name)
    # S1 now needs more than what is left: S2 must give its idle cache back. The
    # prompts twice over (16 requests for 8 sequences) in one streamed request: a load of
    # 8, or of separate requests, that arrives staggered may never run 8 at once, nor need
    # S2's pages.
    t0 = time.monotonic()
    with h.Sampler([s1.name, s2.name], workers=False) as sampler:
        got = _Load(s1, h.decode_prompts() * 2, h.LONG_DECODE).result()
    assert got == native_run["tokensB"] * 2
    assert time.monotonic() - t0 < 120
    after = h.mapped(h.read_record(s2.name))
    assert all(
        h.mapped(s[s1.name]) + h.mapped(s[s2.name]) <= BUDGET
        for s in sampler.samples
        if s.get(s1.name) and s.get(s2.name)
    )
    return held, after, _given_back(s2.name) - given0


def test_an_idle_engine_gives_its_cached_pages_to_a_loaded_peer(servers, native_run):
    _budget_to_ourselves(servers)
    s1, s2 = servers["s1"], servers["s2"]
    # S1's 16 requests on one core may run few at a time and finish within what the
    # budget has left: then S2's give-back was not needed and nothing was tested; the load
    # runs again (S2 refilled). Whether S1 needed S2's memory is S2's own give-back counter:
    # a sampled peak of S1 misses it when S1 frees a page as it maps S2's (CI, 0.29).
    seen = []
    for _ in range(3):
        held, after, given = _load_a_peer_of_an_idle_cache(s1, s2, native_run)
        seen.append((held, after, given))
        if given > 0:
            assert after < held, seen  # what S2 gave S1 left S2's mapping
            return
    pytest.fail(
        f"S1 never needed S2's memory in 3 loads (S2 held, after, given back): {seen}: the test did not test anything"
    )


# Last of the load tests: run before them, it left S1 in a state from which two of them failed
# on vLLM 0.26 (S2 never ran all 8 requests at once; S1 never asked idle S2 for memory), in
# every CI run, not on 0.29 or 0.32. Not yet explained: see the closing note of 2026-12-03.
def test_the_engines_metrics_agree_with_kvctl_and_move_with_load(servers):
    """Scraped over HTTP at vLLM's own /metrics, S1's kvcached_* numbers equal
    `kvctl list --json` idle and after a load. Under a 1 MiB limit the load
    fills the pages (used bytes rise, never past the limit, and fall back after:
    bounded prefix cache), maps what was not mapped, and is refused by the limit
    (vLLM waits or preempts): the counters say so."""
    s1, s2 = servers["s1"], servers["s2"]
    # S2's cache from the tests above is given back first (a lowered limit, idle), so the
    # whole of S1's 1 MiB limit is in the budget's room and the load can fill it.
    s2_limit = h.read_record(s2.name)["limit"]
    assert h.kvctl("limit", s2.name, "1M").returncode == 0
    deadline = time.monotonic() + 30
    while h.mapped(h.read_record(s2.name)) > CAP and time.monotonic() < deadline:
        time.sleep(0.1)
    idle, row0 = _scrape_agreeing_with_kvctl(s1)
    check_scrape_agrees(idle, row0)
    assert row0["record_version"] == 2
    r = h.kvctl("limit", s1.name, "1M")
    assert r.returncode == 0, r.stderr
    used_during = []
    try:
        # The peak is sampled from the record (what both kvctl and /metrics read): a scrape
        # under load can take longer than the whole load (0.32 in CI: one sample, no peak).
        # With both cores busy decoding, even this loop may wake only a few times (CI, 0.32:
        # 4 samples, the peak missed): then the load runs again (up to 3 times).
        for _ in range(3):
            used_during = []
            with ThreadPoolExecutor(1) as ex:
                fut = ex.submit(_run_all, s1, h.decode_prompts(), h.LONG_DECODE)
                while not fut.done():
                    used_during.append(h.read_record(s1.name)["used"])
                    time.sleep(0.01)
                assert len(fut.result()) == len(h.decode_prompts())
            if max(used_during) > row0["used"]:
                break
        time.sleep(1.5)  # idle: the bounded prefix cache lets blocks go
        after, row1 = _scrape_agreeing_with_kvctl(s1)
    finally:
        r = h.kvctl("limit", s1.name, str(row0["limit"]))
        assert r.returncode == 0, r.stderr
        assert h.kvctl("limit", s2.name, str(s2_limit)).returncode == 0
    check_scrape_agrees(after, row1)
    peak = max(used_during)
    assert row0["used"] < peak <= CAP and row1["used"] < peak, (row0["used"], used_during, row1["used"])
    grew = {k: row1["counters"][k] - row0["counters"][k] for k in row0["counters"]}
    # Every page in use at the peak is mapped: what was not mapped before the load was mapped during it.
    assert grew["pages_mapped"] >= peak // h.BPP - row0["mapped"] // h.BPP, (grew, row0["mapped"], peak)
    calls = row1["histograms"]["map_seconds"]["count"] - row0["histograms"]["map_seconds"]["count"]
    assert (calls > 0) == (grew["pages_mapped"] > 0), (calls, grew)
    # Refusals by the limit are not asserted here: whether vLLM asks and is refused or waits
    # depends on the cache S1 starts from (0.29 at this position: none); the record's refusal
    # counters are proven in tests/metrics/test_metrics_record_stats.py.


def test_kill9_then_a_restart_under_the_same_name_replaces_the_dead_record_and_serves(servers):
    s1, model, workdir = servers["s1"], servers["model"], servers["workdir"]
    root = h.socket_root(s1.name)
    assert os.path.isdir(root)
    s1.kill9()
    rec = h.read_record(s1.name)
    assert rec is not None and not rec["alive"]  # a crash cannot clean up after itself
    assert os.path.isdir(root)
    dead_owner = rec["owner_pid"]
    s3 = h.start_server(model, s1.name, h.engine_env(True, s1.name, KVCACHED_HOST_MEMORY_BUDGET=str(BUDGET)), workdir)
    servers["started"].append(s3)
    h.wait_healthy(s3)
    rec = h.read_record(s1.name)
    assert rec is not None and rec["alive"] and rec["owner_pid"] != dead_owner  # the new engine's record
    assert os.path.isdir(root)
    assert h.complete(s3, h.prompts(1)[0], h.MAX_TOKENS) == h.complete(servers["s2"], h.prompts(1)[0], h.MAX_TOKENS)


def test_stopping_servers_leaves_no_record_and_no_socket(servers):
    live = [s for s in servers["started"] if s.proc.poll() is None]
    assert len(live) == 2  # S2 and S3
    for s in live:
        s.stop()
        assert s.proc.returncode is not None
        assert h.read_record(s.name) is None
        assert not os.path.exists(h.socket_root(s.name))
