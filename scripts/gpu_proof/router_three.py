"""The router on a GPU: models behind ``kvcached serve`` (one endpoint, one shared KV
budget), bursty load that moves from model to model with idle gaps long enough for
the idle policy to put the others to sleep.

    python scripts/gpu_proof/router_three.py --model DIR --out DIR [--kv 6G] [--plot PNG] [--cpu]
        [--models A=vllm:kv,B=sglang:kv] [--vllm-python PY] [--vllm-path P] [--sglang-python PY] [--sglang-path P]

By default three vLLM models: A and B sleep by giving their KV back (``sleep: kv``:
weights stay, wake restores the limit), C by stopping (``sleep: stop``: everything
freed, wake = a restart); bursts go A, B, C, then A and C again, each to a model that
is asleep by then. ``--models`` names other models (engine and sleep each; bursts
go through them twice), e.g. a vLLM and an SGLang model behind one endpoint, each
engine with its own interpreter and PYTHONPATH (their packages clash).
Reports per burst the model's state before it, TTFT p50/p99 and the first
request's TTFT (it waited for the wake), the router's own wake latencies
(``kvcached_router_wake_seconds``), and plots mapped KV per model over time.
Exits 1 when a request failed or the router did not stop cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_engine_args,
    log,
    percentile,
    router_budget,
    router_config,
    router_model,
    router_states,
    start_router,
    write_json,
)
from three_models import burst  # noqa: E402

from kvcached.router.supervisor import free_port  # noqa: E402
from kvcached.testing.record_sampler import RecordSampler  # noqa: E402
from kvcached.units import format_size, parse_size  # noqa: E402

DEFAULT_MODELS = "A=vllm:kv,B=vllm:kv,C=vllm:stop"
DEFAULT_ORDER = ("A", "B", "C", "A", "C")


def parse_models(text: str) -> Dict[str, Tuple[str, str]]:
    """``A=vllm:kv,B=sglang:stop`` -> {name: (engine, sleep)}."""
    out: Dict[str, Tuple[str, str]] = {}
    for item in text.split(","):
        name, _, rest = item.partition("=")
        engine, _, sleep = rest.partition(":")
        if engine not in ("vllm", "sglang") or not name or not sleep:
            raise SystemExit(f"--models: {item!r} is not NAME=vllm|sglang:SLEEP (e.g. A=vllm:kv)")
        out[name] = (engine, sleep)
    return out


def wake_seconds(port: int) -> Dict[str, Tuple[float, float]]:
    """{model: (wakes, seconds)} from the router's kvcached_router_wake_seconds histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Dict[str, List[float]] = {}
    for line in text.splitlines():
        for part, i in (("_count", 0), ("_sum", 1)):
            if line.startswith(f"kvcached_router_wake_seconds{part}{{"):
                model = line.split('model="', 1)[1].split('"', 1)[0]
                out.setdefault(model, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
    return {m: (v[0], v[1]) for m, v in out.items()}


def config(a: argparse.Namespace, kv: int, port: int) -> Dict:
    models = [
        router_model(
            m,
            engine,
            a.model,
            cpu=a.cpu,
            kv=kv,
            max_model_len=512 if a.cpu else 4096,
            sleep=sleep,
            idle=a.idle,
            python=a.vllm_python if engine == "vllm" else a.sglang_python,
            path=a.vllm_path if engine == "vllm" else a.sglang_path,
            vllm_gpu_args=["--gpu-memory-utilization", "0.2"],  # explicit KV bytes: only the start-up check reads it
        )
        for m, (engine, sleep) in a.models.items()
    ]
    return router_config(a.out, port, router_budget(kv, a.cpu), models)


def plot(rec: RecordSampler, phases, budget: int, path: str, models: Dict[str, Tuple[str, str]]) -> None:  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed: no plot (the series are in the JSON beside it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (name, pts) in enumerate(rec.series.items()):
        m = name.rsplit("_", 1)[1]
        # No samples while an engine is stopped (its record is gone): a gap, not its last value.
        runs: List[list] = []
        for p in pts:
            if not runs or p.t - runs[-1][-1].t > 1.0:
                runs.append([])
            runs[-1].append(p)
        for k, run in enumerate(runs):
            label = None
            if k == 0:
                engine, sleep = models[m]
                label = f"model {m} ({engine})" + (" (sleep: stop; no line: stopped)" if sleep == "stop" else "")
            ts, gib = [p.t for p in run], [p.mapped / (1 << 30) for p in run]
            ax.step(ts, gib, where="post", lw=2, color=f"C{i}", label=label)
    ax.axhline(budget / (1 << 30), color="red", ls="--", lw=1, label=f"shared KV budget {format_size(budget)}")
    for m, t0, t1 in phases:
        ax.axvspan(t0, t1, color="green", alpha=0.07)
        ax.text((t0 + t1) / 2, budget / (1 << 30) * 1.02, f"burst at {m}", ha="center", fontsize=8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("mapped KV (GiB)")
    ax.set_ylim(0, budget / (1 << 30) * 1.15)
    engines = " and ".join(sorted({e for e, _ in models.values()}))
    ax.set_title(f"kvcached serve: {len(models)} models ({engines}), one endpoint; idle ones sleep, requests wake them")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv", default=None, help="KV budget of the three together (default 6G; --cpu 24M)")
    ap.add_argument("--burst", type=int, default=None, help="requests per burst (default 128; --cpu 8)")
    ap.add_argument("--idle", type=float, default=5.0, help="idle_seconds of every model")
    ap.add_argument("--plot", default=None, help="PNG of mapped KV over time (default OUT/gpu_router_three.png)")
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"NAME=ENGINE:SLEEP,... (default {DEFAULT_MODELS})")
    add_engine_args(ap)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)
    a.models = parse_models(a.models)
    names = list(a.models)
    order = DEFAULT_ORDER if a.models == parse_models(DEFAULT_MODELS) else tuple(names + names)
    os.makedirs(a.out, exist_ok=True)
    kv = parse_size(a.kv or ("24M" if a.cpu else "6G"))
    n = a.burst or (8 if a.cpu else 128)
    plen, gen = (64, 32) if a.cpu else (1024, 512)
    port = free_port()
    router = start_router(config(a, kv, port), a.out)
    rec = RecordSampler([f"kvcached_router_{m}" for m in names], period=0.05)
    results: List[Dict[str, object]] = []
    phases: List[Tuple[str, float, float]] = []
    wakes: Dict[str, Tuple[float, float]] = {}
    try:
        t0 = time.monotonic()
        st: Dict[str, str] = {}
        while True:
            try:
                st = router_states(port)
                if st and all(s == "ready" for s in st.values()):
                    break
            except OSError:
                pass
            if router.poll() is not None or time.monotonic() - t0 > 1200:
                raise RuntimeError(f"router or engines not ready (states {st}); see {a.out}")
            time.sleep(1)
        log(f"{len(names)} engines ready behind the router after {time.monotonic() - t0:.0f} s")
        for m in names:  # warm-up: the first requests compile and allocate
            burst(SimpleNamespace(port=port, model=m), 2, plen, 8, seed=99)
        rec.start()
        for i, m in enumerate(order):
            # Long enough without requests that every idle model is asleep.
            deadline = time.monotonic() + a.idle + 60
            while time.monotonic() < deadline:
                st = router_states(port)
                if all(s == "asleep" for s in st.values()):
                    break
                time.sleep(0.5)
            before = router_states(port)[m]
            t1 = rec.now()
            ttfts, failed = burst(SimpleNamespace(port=port, model=m), n, plen, gen, seed=10 + i)
            phases.append((m, t1, rec.now()))
            res = {
                "model": m,
                "engine": a.models[m][0],
                "sleep": a.models[m][1],
                "state_before": before,
                "p50_ttft_s": percentile(ttfts, 50),
                "p99_ttft_s": percentile(ttfts, 99),
                "max_ttft_s": max(ttfts, default=None),
                "failed": failed,
                "seconds": rec.now() - t1,
            }
            results.append(res)
            log(
                f"burst {i + 1} at {m} ({before}, sleep {a.models[m][1]}): {n} requests, p50 TTFT "
                f"{res['p50_ttft_s']:.2f} s, p99 {res['p99_ttft_s']:.2f} s, max {res['max_ttft_s']:.2f} s, "
                f"{failed} failed, {res['seconds']:.1f} s"
            )
        wakes = wake_seconds(port)
        rec.stop()
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            rc = router.wait(120)
        except subprocess.TimeoutExpired:
            router.kill()
            rc = -9
    write_json(
        os.path.join(a.out, "router_three.json"),
        {
            "results": results,
            "phases": phases,
            "wakes": wakes,
            "router_rc": rc,
            "series": {k: [tuple(p) for p in v] for k, v in rec.series.items()},
        },
    )
    plot(rec, phases, kv, a.plot or os.path.join(a.out, "gpu_router_three.png"), a.models)
    print(
        f"\nrouter, {len(names)} models, bursts of {n} requests ({plen} in / {gen} out); "
        f"KV budget {format_size(kv)} shared"
    )
    print(
        f"{'burst':<6} {'model':<6} {'engine':<7} {'sleep':<6} {'state before':<13} {'p50 TTFT':>9} {'p99':>8} "
        f"{'max':>8} {'failed':>7}"
    )
    for i, r in enumerate(results):
        print(
            f"{i + 1:<6} {r['model']:<6} {r['engine']:<7} {r['sleep']:<6} {r['state_before']:<13} "
            f"{r['p50_ttft_s']:>8.2f}s {r['p99_ttft_s']:>7.2f}s {r['max_ttft_s']:>7.2f}s {r['failed']:>7}"
        )
    for m, (count, secs) in sorted(wakes.items()):
        print(f"router wakes of {m} ({a.models[m][1]}): {count:.0f}, mean {secs / count if count else 0:.2f} s")
    failed = sum(int(r["failed"]) for r in results)
    print(f"{failed} requests failed; router exit status {rc} after SIGTERM")
    return 1 if failed or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
