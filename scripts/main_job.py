"""The main job: two real vLLM engines share one KV budget, and memory follows the load.

    python scripts/main_job.py [--out docs/main_job.png] [--budget 6M] [--keep-logs DIR]

Run by ``bash scripts/main.sh`` with the vLLM venv's python (kvcached installed
there as a wheel). It builds the tiny Llama, starts two OpenAI servers ("A" and
"B", kvcached on, one shared KV budget smaller than both peaks together),
drives load at A, lets it idle, then at B, and samples both instance records
(what ``kvctl list`` shows) every 50 ms. It prints ``kvctl list`` snapshots
between the phases and writes a PNG of mapped KV per instance over time.

With a static split each engine would get half the budget, less than either
needs at its peak; with kvcached each takes the budget while it is loaded and
gives it back when idle.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

from kvcached.testing import vllm_server as vs
from kvcached.testing.record_sampler import RecordSampler
from kvcached.testing.tiny_model import build_tiny_llama
from kvcached.units import format_size, parse_size

PAGE = 128 << 10  # small pages so the tiny model's load moves many of them
MAX_SEQS = 16


def log(msg: str) -> None:
    print(f"[main {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kvctl_list(title: str) -> None:
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "kvctl"), "list"], capture_output=True, text=True
    )
    print(f"\n--- kvctl list: {title}\n{out.stdout.rstrip() or out.stderr.rstrip()}\n", flush=True)


def drive(srv: vs.Server, n: int, concurrency: int, prompt_len: int, max_tokens: int, seed: int) -> Tuple[int, float]:
    prompts = vs.token_prompts(n, prompt_len, seed)
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda p: vs.complete(srv, p, max_tokens), prompts))
    return sum(len(o) for o in outs), time.monotonic() - t0


def plot(
    rec: RecordSampler, phases: List[Tuple[str, float, float]], budget: int, out: str, labels: Dict[str, str]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    colors = {"A": "tab:blue", "B": "tab:orange"}
    for name, pts in rec.series.items():
        if pts:
            t = [p[0] for p in pts]
            mib = [p[1] / (1 << 20) for p in pts]
            ax.step(t, mib, where="post", label=f"instance {labels[name]} ({name})", color=colors[labels[name]], lw=2)
    if rec.series:
        a, b = (list(rec.series.values()) + [[]])[:2]
        pairs = dict((round(p[0], 2), p[1]) for p in a)
        total = [(p[0], (p[1] + pairs.get(round(p[0], 2), 0)) / (1 << 20)) for p in b if round(p[0], 2) in pairs]
        if total:
            ax.step(
                [x for x, _ in total], [y for _, y in total], where="post", color="gray", lw=1, ls=":", label="A + B"
            )
    ax.axhline(budget / (1 << 20), color="red", ls="--", lw=1, label=f"shared budget {format_size(budget)}")
    ax.axhline(budget / 2 / (1 << 20), color="red", ls=":", lw=1, alpha=0.5, label="a static half")
    for label, t0, t1 in phases:
        ax.axvspan(t0, t1, color="green", alpha=0.08)
        ax.text((t0 + t1) / 2, budget / (1 << 20) * 1.02, label, ha="center", va="bottom", fontsize=9)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("mapped KV (MiB)")
    ax.set_ylim(0, budget / (1 << 20) * 1.15)
    ax.set_title("kvcached: two vLLM engines (tiny Llama, CPU) share one KV budget; memory follows the load")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/main_job.png", help="PNG to write (default docs/main_job.png)")
    ap.add_argument("--budget", default="6M", help="shared KV budget of both engines (default 6M)")
    ap.add_argument("--requests", type=int, default=96, help="requests per load phase")
    ap.add_argument("--keep-logs", help="write server logs here (default: a temp dir, removed)")
    a = ap.parse_args(argv)
    budget = parse_size(a.budget)

    work = a.keep_logs or tempfile.mkdtemp(prefix="kvcached_main_")
    os.makedirs(work, exist_ok=True)
    log(f"building the tiny Llama in {work}")
    model = build_tiny_llama(os.path.join(work, "tiny_llama"))
    tag = os.getpid()
    names = {f"main_A_{tag}": "A", f"main_B_{tag}": "B"}
    from kvcached.limits.records import list_records

    others = [r.name for r in list_records() if r.alive and r.device == "cpu"]
    if others:
        log(f"note: {len(others)} other kvcached instance(s) on this host share the budget: {', '.join(others)}")
    servers: List[vs.Server] = []
    try:
        for i, (name, label) in enumerate(names.items()):
            env = vs.engine_env(
                True,
                name,
                KVCACHED_HOST_MEMORY_BUDGET=budget,
                KVCACHED_PAGE_SIZE=PAGE,
                KVCACHED_MIN_RESERVED_PAGES=0,
                KVCACHED_MAX_RESERVED_PAGES=2,
                KVCACHED_MAX_CACHED_TOKENS=512,  # a bounded prefix cache: idle engines give memory back
                VLLM_CPU_OMP_THREADS_BIND=str(i % max(1, os.cpu_count() or 1)),
            )
            servers.append(vs.start_server(model, name, env, work, max_num_seqs=MAX_SEQS))
            log(f"starting vLLM server {label} ({name}) on port {servers[-1].port}; log {servers[-1].log_path}")
        t_start = time.monotonic()
        for s in servers:
            while True:
                try:
                    vs.wait_healthy(s, timeout=15)
                    break
                except RuntimeError:
                    if s.proc.poll() is not None or time.monotonic() - t_start > 600:
                        raise
                    log(
                        f"waiting for {names[s.name]} to start ({time.monotonic() - t_start:.0f} s; engines take "
                        f"~30-60 s each here)"
                    )
            log(f"server {names[s.name]} is up after {time.monotonic() - t_start:.0f} s")
        kvctl_list("both engines idle (only the null block's page is mapped)")

        rec = RecordSampler(list(names))
        rec.start()
        time.sleep(2)
        phases = []
        for i, s in enumerate(servers):
            label = names[s.name]
            t0 = rec.now()
            holder: Dict[str, Tuple[int, float]] = {}
            th = threading.Thread(target=lambda: holder.update(r=drive(s, a.requests, MAX_SEQS, 200, 48, seed=10 + i)))
            th.start()
            time.sleep(1.0)
            kvctl_list(f"during the load at {label}")
            th.join()
            toks, dt = holder["r"]
            phases.append((f"load at {label}", t0, rec.now()))
            log(f"load at {label}: {a.requests} requests, {toks} tokens in {dt:.1f} s")
            time.sleep(3)
            kvctl_list(f"after the load at {label}")
        rec.stop()

        peaks = {names[n]: max((p[1] for p in pts), default=0) for n, pts in rec.series.items()}
        plot(rec, phases, budget, a.out, names)
        log(
            "peaks: "
            + ", ".join(f"{k} {format_size(v)}" for k, v in peaks.items())
            + f"; shared budget {format_size(budget)} (a static split would give each {format_size(budget // 2)})"
        )
        log(f"plot written to {os.path.abspath(a.out)}")
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
