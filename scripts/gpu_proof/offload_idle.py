"""Issue 32, item 4: what the host tier buys an idle engine whose memory a peer took.

    python scripts/gpu_proof/offload_idle.py --model DIR --out DIR [--kv 16G] [--offload 16]
        [--prefix 7680] [--prompts 32] [--burst 128] [--only native,recompute,offload]
        [--plot PNG] [--cpu] [--dry-run]

Two vLLM servers (A and B) of one model on one device, one arm at a time:

* ``offload``: both with kvcached sharing ``--kv`` of KV (the device budget of every
  kvcached instance), A with vLLM's host tier (``--kv-offloading-size``, native backend);
* ``recompute``: the same without the host tier (kvcached's behaviour before issue 32: a
  prefix given back is recomputed);
* ``native``: both without kvcached, each with its own static pool of half of ``--kv``.

In each arm A serves ``--prompts`` prompts sharing one long prefix (the first alone, then
the rest at once), goes idle; B's burst wants more than the budget, so an idle A gives its
pages back (kvcached arms); once B is done A is asked again with the same prefix (new
suffixes, the first alone, then the rest). Reported per arm: A's TTFT (first request,
p50/p99 of the rest) before and after, A's prefix-cache hit rate over the second round
(vLLM's ``prefix_cache_hits/queries``) and the connector's own (``external_prefix_cache_*``,
``kv_offload_load_bytes``) where the version reports them, and how long A took to give its
pages back. The plot (``--plot``, default OUT/gpu_offload_idle.png) shows mapped KV of A
and B (kvcached's records) and the bytes A's host tier holds over time, per kvcached arm.

``--cpu``: the tiny model on vLLM's CPU build. vLLM-CPU refuses its own offload worker
("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), so the dry run
runs the ``recompute`` and ``native`` arms and says the ``offload`` arm needs a GPU.
``--dry-run`` prints the plan and starts nothing. ``--only`` runs some arms; the arms an
earlier run with the same settings left in OUT/offload_idle.json are kept beside them (so the
three can be split over device calls of limited length). Exits 1 when a request failed or an arm
could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import budget_env, log, percentile, start_server, wait_all, write_json  # noqa: E402
from three_models import burst  # noqa: E402

from kvcached.testing import vllm_server as vs  # noqa: E402
from kvcached.testing.record_sampler import RecordSampler  # noqa: E402
from kvcached.units import format_size, parse_size  # noqa: E402

ARMS = ("native", "recompute", "offload")
GIB = 1 << 30

# vLLM's metric names (counters get ``_total`` in Prometheus; looked up with and without).
PREFIX_Q, PREFIX_H = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
EXT_Q, EXT_H = "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits"
LOAD_B, STORE_B = "vllm:kv_offload_load_bytes", "vllm:kv_offload_store_bytes"
HOST_USAGE = "vllm:kv_offload_cpu_cache_usage_perc"  # fraction of the host tier in use (gauge)
WATCHED = (PREFIX_Q, PREFIX_H, EXT_Q, EXT_H, LOAD_B, STORE_B, HOST_USAGE)


def metric(m: Dict[str, float], name: str) -> Optional[float]:
    for n in (name, name + "_total"):
        if n in m:
            return m[n]
    return None


def read_metrics(srv: vs.Server) -> Dict[str, Optional[float]]:
    try:
        m = vs.metrics(srv)
    except Exception:  # noqa: BLE001 - a missed sample, not fatal
        return {}
    return {k: metric(m, k) for k in WATCHED}


def delta(after: Dict, before: Dict, name: str) -> Optional[float]:
    a, b = after.get(name), before.get(name)
    return None if a is None or b is None else a - b


def prefix_prompts(n: int, prefix: List[int], suffix: int, seed: int) -> List[List[int]]:
    """``n`` prompts: the shared ``prefix`` then ``suffix`` tokens of their own."""
    rng = random.Random(seed)
    return [prefix + [rng.randrange(7, 500) for _ in range(suffix)] for _ in range(n)]


def ask(srv: vs.Server, prompts: List[List[int]], gen: int) -> Dict[str, object]:
    """The first prompt alone (its TTFT: the prefix computed or found), then the rest at once."""
    ttft0, _total, got = vs.stream(srv, prompts[0], gen, timeout=900)
    failed = int(got < gen)
    ttfts: List[float] = []
    lock = threading.Lock()

    def one(p: List[int]) -> None:
        nonlocal failed
        try:
            t, _tt, g = vs.stream(srv, p, gen, timeout=900)
            with lock:
                ttfts.append(t)
                failed += int(g < gen)
        except Exception:  # noqa: BLE001 - counted and reported
            with lock:
                failed += 1

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "first_ttft_s": ttft0,
        "p50_ttft_s": percentile(ttfts, 50),
        "p99_ttft_s": percentile(ttfts, 99),
        "failed": failed,
    }


class MetricsPoller(threading.Thread):
    """A's host-tier counters over time, on the RecordSampler's clock: (t, metrics)."""

    def __init__(self, srv: vs.Server, clock: RecordSampler, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.srv, self.clock, self.period = srv, clock, period
        self.series: List[Tuple[float, Dict[str, Optional[float]]]] = []
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.series.append((self.clock.now(), read_metrics(self.srv)))
            self._stop_evt.wait(self.period)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()


def run_arm(arm: str, a: argparse.Namespace, p: Dict[str, int], kv: int, tag: int) -> Dict[str, object]:
    """One arm: start A and B, A's first round, B's burst, A asked again; stop both."""
    kvc = arm != "native"
    size = kv if kvc else kv // 2
    extra: Dict[str, str] = budget_env(kv, a.cpu) if kvc else {}
    if kvc and a.cpu:
        extra["KVCACHED_PAGE_SIZE"] = "65536"  # 256 tokens of the tiny model a page: a budget of a few MiB
    a_args = ["--kv-offloading-size", str(a.offload)] if arm == "offload" else []
    mml = p["max_model_len"]
    srv_a = start_server(a.model, f"oi_{arm}_A_{tag}", kvc, a.out, cpu=a.cpu, kv_bytes=size,
                         max_model_len=mml, extra_args=a_args, **extra)  # fmt: skip
    srv_b = start_server(a.model, f"oi_{arm}_B_{tag}", kvc, a.out, cpu=a.cpu, kv_bytes=size, max_model_len=mml, **extra)
    rec: Optional[RecordSampler] = None
    poll: Optional[MetricsPoller] = None
    try:
        log(f"{arm}: A and B up after {wait_all([srv_a, srv_b], 1200):.0f} s")
        for srv in (srv_a, srv_b):  # warm-up: the first requests compile and allocate
            burst(srv, 2, 32, 4, seed=99)
        rec = RecordSampler([srv_a.name, srv_b.name] if kvc else [], period=0.05)
        rec.start()
        poll = MetricsPoller(srv_a, rec)
        poll.start()
        prefix = vs.token_prompts(1, p["prefix"], seed=7)[0]
        phases: List[Tuple[str, float, float]] = []

        t0, m0 = rec.now(), read_metrics(srv_a)
        first = ask(srv_a, prefix_prompts(p["prompts"], prefix, p["suffix"], seed=1), p["gen"])
        m1 = read_metrics(srv_a)
        phases.append(("A: prefix", t0, rec.now()))
        log(f"{arm}: A first round: first TTFT {first['first_ttft_s']:.3f} s, p50 {first['p50_ttft_s']:.3f} s")
        time.sleep(a.idle)

        t0 = rec.now()
        mapped_a = rec.series[srv_a.name][-1].mapped if kvc and rec.series[srv_a.name] else 0
        ttfts_b, failed_b = burst(srv_b, p["burst"], p["burst_len"], p["burst_gen"], seed=20)
        phases.append(("B: burst", t0, rec.now()))
        gave = None
        if kvc:
            gave_at = rec.first_time(srv_a.name, lambda s: s.mapped < mapped_a // 2, after=t0)
            gave = None if gave_at is None else gave_at - t0
        log(f"{arm}: B burst: {p['burst']} requests, p50 TTFT {percentile(ttfts_b, 50):.2f} s, {failed_b} failed; "
            f"A gave half its pages back after {gave if gave is None else f'{gave:.2f} s'}")  # fmt: skip
        time.sleep(a.idle)

        t0, m2 = rec.now(), read_metrics(srv_a)
        mapped_b = rec.series[srv_b.name][-1].mapped if kvc and rec.series[srv_b.name] else 0
        again = ask(srv_a, prefix_prompts(p["prompts"], prefix, p["suffix"], seed=2), p["gen"])
        time.sleep(1.0)  # vLLM's stats reach /metrics at its next logging step
        m3 = read_metrics(srv_a)
        phases.append(("A: again", t0, rec.now()))
        b_gave = None  # A's want served by idle B: part of A's first TTFT in the kvcached arms
        if kvc:
            b_at = rec.first_time(srv_b.name, lambda s: s.mapped < mapped_b, after=t0)
            b_gave = None if b_at is None else b_at - t0
        q, h = delta(m3, m2, PREFIX_Q), delta(m3, m2, PREFIX_H)
        eq, eh = delta(m3, m2, EXT_Q), delta(m3, m2, EXT_H)
        again.update(
            prefix_hit_rate=(h / q) if q else None,
            external_hit_rate=(eh / eq) if eq else None,
            offload_load_bytes=delta(m3, m2, LOAD_B),
            offload_store_bytes_first_round=delta(m1, m0, STORE_B),
        )
        log(f"{arm}: A asked again: first TTFT {again['first_ttft_s']:.3f} s, prefix hits {again['prefix_hit_rate']}, "
            f"host-tier hits {again['external_hit_rate']}, loaded {again['offload_load_bytes']}")  # fmt: skip
        time.sleep(1.0)
    finally:
        if poll is not None:
            poll.stop()
        if rec is not None:
            rec.stop()
        for srv in (srv_a, srv_b):
            srv.stop()
    # Bytes A's host tier holds (its usage gauge x its size); where the version does not report
    # the gauge, the bytes stored so far (a counter) instead.
    host: List[Tuple[float, float]] = []
    host_what = None
    if arm == "offload":
        for name, what, scale in ((HOST_USAGE, "held", a.offload * GIB), (STORE_B, "stored so far", 1.0)):
            host = [(t, m[name] * scale) for t, m in poll.series if m.get(name) is not None]
            if host:
                host_what = what
                break
        if not host:
            log("offload: A reported neither the host tier's usage nor its stored bytes on /metrics")
    return {
        "first": first,
        "again": again,
        "burst_b": {"p50_ttft_s": percentile(ttfts_b, 50), "failed": failed_b},
        "give_back_s": gave,
        "b_give_back_s": b_gave,
        "phases": phases,
        "mapped": {n: [tuple(s) for s in v] for n, v in rec.series.items()},
        "labels": {srv_a.name: "A", srv_b.name: "B"},
        "host_bytes": host,
        "host_what": host_what,
        "failed": int(first["failed"]) + int(again["failed"]) + failed_b,  # type: ignore[call-overload]
    }


def plot(results: Dict[str, Dict], kv: int, path: str) -> None:
    arms = [arm for arm in ("recompute", "offload") if arm in results]
    if not arms:
        return
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed: no plot (the series are in the JSON beside it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(arms), 1, figsize=(10, 3.6 * len(arms)), squeeze=False)
    for ax, arm in zip(axes[:, 0], arms):
        r = results[arm]
        for name, pts in r["mapped"].items():
            ax.step([s[0] for s in pts], [s[1] / GIB for s in pts], where="post", lw=2,
                    label=f"model {r['labels'][name]}: mapped KV (kvcached)")  # fmt: skip
        if r["host_bytes"]:
            ax.plot([t for t, _ in r["host_bytes"]], [b / GIB for _, b in r["host_bytes"]], "k--", lw=1.5,
                    label=f"model A: KV {r.get('host_what')} in host memory (offload tier)")  # fmt: skip
        ax.axhline(kv / GIB, color="red", ls=":", lw=1, label=f"shared KV budget {format_size(kv)}")
        for what, t0, t1 in r["phases"]:
            ax.axvspan(t0, t1, color="green", alpha=0.07)
            ax.text((t0 + t1) / 2, kv / GIB * 1.03, what, ha="center", fontsize=8)
        ag = r["again"]
        hit = "n/a" if ag["prefix_hit_rate"] is None else f"{ag['prefix_hit_rate']:.0%}"
        ax.set_title(f"{arm}: A asked again after B's burst: first TTFT {ag['first_ttft_s']:.3f} s, "
                     f"prefix hits {hit}", fontsize=10)  # fmt: skip
        ax.set_ylabel("GiB")
        ax.set_ylim(0, kv / GIB * 1.15)
        ax.legend(loc="center right", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle("kvcached: an idle engine gives its KV to a peer; the host tier keeps its prefix", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv", default=None, help="KV budget of A and B together (default 16G; --cpu 2M)")
    ap.add_argument("--offload", type=float, default=16, help="A's host tier, GiB (--kv-offloading-size)")
    ap.add_argument("--prefix", type=int, default=None, help="shared prefix tokens (default 7680; --cpu 256)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per round at A (default 32; --cpu 8)")
    ap.add_argument("--burst", type=int, default=None, help="B's burst, requests (default 128; --cpu 16)")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds A stays idle before and after B's burst")
    ap.add_argument("--only", default=",".join(ARMS), help=f"arms, comma-separated ({', '.join(ARMS)})")
    ap.add_argument("--plot", default=None, help="PNG (default OUT/gpu_offload_idle.png)")
    ap.add_argument("--cpu", action="store_true", help="dry run on vLLM-CPU with the tiny model (no offload arm)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    a = ap.parse_args(argv)
    kv = parse_size(a.kv or ("2M" if a.cpu else "16G"))
    # The tiny model's context is 512 tokens: a 256-token prefix, B's requests of 256 in / 64 out.
    p = {
        "prefix": a.prefix or (256 if a.cpu else 7680),  # the 8B preset's context: 8192
        "suffix": 32 if a.cpu else 128,
        "gen": 8 if a.cpu else 32,
        "prompts": a.prompts or (8 if a.cpu else 32),
        "burst": a.burst or (16 if a.cpu else 128),
        "burst_len": 256 if a.cpu else 2048,
        "burst_gen": 64 if a.cpu else 256,
    }
    p["max_model_len"] = 512 if a.cpu else p["prefix"] + p["suffix"] + p["gen"] + 256
    arms = [x for x in a.only.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {bad}; choose from {ARMS}")
    skipped = []
    if a.cpu and "offload" in arms:
        arms.remove("offload")
        skipped.append("offload")
    print(f"plan: arms {', '.join(arms)}; KV {format_size(kv)} shared by A and B (kvcached) or half each (native)")
    print(f"  A: {p['prompts']} prompts of a {p['prefix']}-token shared prefix + {p['suffix']} own tokens, "
          f"{p['gen']} out; the first alone, then the rest at once; idle {a.idle:.0f} s")  # fmt: skip
    print(f"  B: a burst of {p['burst']} requests of {p['burst_len']} in / {p['burst_gen']} out (wants the budget)")
    print(f"  A again: the same prefix, new suffixes; offload arm: --kv-offloading-size {a.offload:g} at A")
    if skipped:
        print("  the offload arm needs a GPU: vLLM-CPU refuses its offload worker (CPU Offloading is currently "
              "only supported on CUDA-alike and XPU GPUs); run without --cpu on the device")  # fmt: skip
    if a.dry_run:
        return 0
    os.makedirs(a.out, exist_ok=True)
    tag = os.getpid()
    results: Dict[str, Dict] = {}
    failed = 0
    for arm in arms:
        try:
            results[arm] = run_arm(arm, a, p, kv, tag)
            failed += results[arm]["failed"]
        except Exception as e:  # noqa: BLE001 - the arm is reported as failed; the others still run
            log(f"{arm}: failed: {type(e).__name__}: {e}")
            results[arm] = {"error": f"{type(e).__name__}: {e}"}
            failed += 1
    out_json = os.path.join(a.out, "offload_idle.json")
    try:  # arms an earlier run with the same settings measured (--only split over device calls)
        with open(out_json) as fh:
            prev = json.load(fh)
        if prev.get("params") == p and prev.get("kv") == kv:
            for arm, r in prev.get("arms", {}).items():
                if arm not in results and "error" not in r:
                    results[arm] = r
                    log(f"{arm}: kept from the earlier run in {out_json}")
    except (OSError, ValueError):
        pass
    results = {arm: results[arm] for arm in ARMS if arm in results}
    write_json(out_json, {"params": p, "kv": kv, "skipped": skipped, "arms": results})
    ok = {k: v for k, v in results.items() if "error" not in v}
    plot(ok, kv, a.plot or os.path.join(a.out, "gpu_offload_idle.png"))

    def f(x: Optional[float], fmt: str = "{:.3f}") -> str:
        return "n/a" if x is None else fmt.format(x)

    print(f"\nA: {p['prompts']} prompts sharing a {p['prefix']}-token prefix, idle, B's burst of {p['burst']}, "
          f"A asked again; KV {format_size(kv)}")  # fmt: skip
    print(f"{'arm':<10} {'1st TTFT':>9} {'again 1st':>10} {'again p50':>10} {'prefix hits':>12} "
          f"{'host hits':>10} {'loaded':>9} {'A gave back':>12} {'B gave back':>12}")  # fmt: skip
    for arm, r in ok.items():
        ag = r["again"]
        loaded = ag["offload_load_bytes"]
        print(
            f"{arm:<10} {f(r['first']['first_ttft_s']):>9} {f(ag['first_ttft_s']):>10} {f(ag['p50_ttft_s']):>10} "
            f"{f(ag['prefix_hit_rate'], '{:.0%}'):>12} {f(ag['external_hit_rate'], '{:.0%}'):>10} "
            f"{'n/a' if loaded is None else format_size(int(loaded)):>9} {f(r['give_back_s'], '{:.2f} s'):>12} "
            f"{f(r['b_give_back_s'], '{:.2f} s'):>12}"
        )
    print("prefix hits: vLLM's GPU prefix cache over the second round's prompt tokens; host hits: its offload tier's")
    print("A/B gave back: from B's burst (A asked again) to the first sample where idle A (B) maps less")
    for arm, r in results.items():
        if "error" in r:
            print(f"{arm}: {r['error']}")
    for arm in skipped:
        print(f"{arm}: not run here (needs a GPU)")
    print(f"{failed} requests failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
