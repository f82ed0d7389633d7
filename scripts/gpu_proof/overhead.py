"""Step 2 of the GPU proof: serving overhead of kvcached, measured with the engine's own
benchmark (``vllm bench serve`` against vLLM's OpenAI server, ``python -m
sglang.bench_serving`` against SGLang's ``launch_server``), native vs kvcached in paired
alternating rounds.

    python scripts/gpu_proof/overhead.py --model DIR --out DIR [--engine vllm|sglang]
        [--rates 4,16,64,inf] [--rounds 2] [--cpu]

The servers run side by side on one device with the same explicit KV capacity
(vLLM's defaults otherwise): native, kvcached, and one more kvcached server per
``--variant`` (an env to try, e.g. a pre-mapped pool); only one is under load at
a time. At each rate, each round runs every server, each first in turn, on fresh
prompts (the same for all servers in that round), and the table gives the
median over rounds and server/native. Goal on the H200:
throughput within 2%, p99 TTFT and TPOT within 3% at every rate. A second table
gives each vLLM run as the engine saw it (kvcached.bench.engine_view: steps, tokens and ms per
step, preemptions, time to reach the engine, queueing), which tells a slower step
from another schedule or a slower front end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import log, start_server, start_sglang_server, wait_all, write_json  # noqa: E402
from limits import check_limit, sglang_complete  # noqa: E402

from kvcached.bench.engine_view import COLUMNS, scrape, view  # noqa: E402
from kvcached.testing import vllm_server as vs  # noqa: E402
from kvcached.units import parse_size  # noqa: E402

# `vllm bench serve` itself (its CLI wrapper needs the `vllm` distribution name,
# which the CPU wheel does not have).
BENCH = (
    "import sys, argparse; from vllm.benchmarks.serve import add_cli_args, main; "
    "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
METRICS = (
    "duration",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def bench_command(srv: vs.Server, rate: float, n: int, a: argparse.Namespace, path: str, seed: int) -> List[str]:
    """The engine's own benchmark on the random dataset (``n`` requests drawn with ``seed``,
    ``a.input_len`` in / ``a.output_len`` out, EOS ignored) at ``rate``, its result to ``path``."""
    url = f"http://127.0.0.1:{srv.port}"
    common = ["--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]
    common += ["--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed), "--disable-tqdm"]
    if a.engine == "sglang":
        # random-ids: random token ids sent as ids (`random` samples ShareGPT, a download).
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url]
        cmd += ["--model", srv.model, "--tokenizer", srv.model, "--dataset-name", "random-ids", "--tokenize-prompt"]
        return cmd + ["--random-range-ratio", "1", *common, "--output-file", path]
    cmd = [sys.executable, "-c", BENCH, "--backend", "vllm", "--base-url", url]
    cmd += ["--endpoint", "/v1/completions", "--model", srv.model, "--dataset-name", "random", "--ignore-eos", *common]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    return cmd + ["--save-result", "--result-dir", os.path.dirname(path), "--result-filename", os.path.basename(path)]


def bench(srv: vs.Server, rate: float, n: int, a: argparse.Namespace, tag: str, seed: int) -> Dict[str, Any]:
    """One benchmark run (random dataset drawn with ``seed``) against ``srv``: its METRICS,
    and under ``engine`` what vLLM's /metrics say it did meanwhile."""
    path = os.path.join(a.out, f"{tag}.json")
    cmd = bench_command(srv, rate, n, a, path, seed)
    before = scrape(srv.port) if a.engine == "vllm" else {}
    with open(os.path.join(a.out, "bench.log"), "a") as logf:
        rc = subprocess.run(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=vs.engine_env(False, **_keep_path())
        ).returncode
    if rc != 0:
        raise RuntimeError(f"{a.engine}'s benchmark failed ({rc}); see {a.out}/bench.log")
    with open(path) as f:
        res = json.loads(f.read().strip().splitlines()[-1])  # SGLang appends one JSON line per run
    failed = res.get("failed", res.get("completed", n) != n)
    if failed:
        raise RuntimeError(f"requests failed in {tag}: {failed}")
    out: Dict[str, Any] = {k: float(res[k]) for k in METRICS}
    if a.engine == "vllm":
        out["engine"] = view(before, scrape(srv.port), out["duration"], res["mean_ttft_ms"] / 1e3)
    return out


def page_calls(srv: vs.Server) -> Dict[str, float]:
    """The kvcached server's map/unmap calls and the seconds they took (its own
    /metrics), to set against the runs' durations: page mapping on the step's path."""
    from kvcached.testing.engine_metrics import kvcached_samples

    try:
        samples = kvcached_samples(f"http://127.0.0.1:{srv.port}")
    except Exception as e:  # noqa: BLE001 - reported, not required
        return {"error": repr(e)}  # type: ignore[dict-item]
    out: Dict[str, float] = {}
    for (name, _labels), v in samples.items():
        for op in ("map", "unmap"):
            for part in ("sum", "count"):
                if name == f"kvcached_{op}_seconds_{part}":
                    out[f"{op}_{part}"] = out.get(f"{op}_{part}", 0.0) + v
    return out


def print_engine_view(runs: Dict[str, Dict[float, List[Dict[str, Any]]]], rates: List[float]) -> None:
    """Per rate and server, the medians over rounds of what the engine did (kvcached.bench.engine_view):
    a slower step shows as more ms per step at the same tokens per step, a different
    schedule as other tokens per step and queueing."""
    print("\nthe engine's view (its /metrics around each run; median over rounds)")
    print(f"{'rate':>6} {'server':<10} " + " ".join(f"{h:>10}" for _, h, _ in COLUMNS))
    for rate in rates:
        for label, per_rate in runs.items():
            cells = [fmt.format(statistics.median(x["engine"][k] for x in per_rate[rate])) for k, _, fmt in COLUMNS]
            print(f"{rate:>6g} {label:<10} " + " ".join(f"{c:>10}" for c in cells))


def _keep_path() -> Dict[str, str]:
    return {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rates", default="4,16,64,inf", help="request rates (req/s; inf: all at once)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=12.0, help="target length of one run at a finite rate")
    ap.add_argument("--inf-requests", type=int, default=400, help="requests sent at once at rate inf")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--kv", default=None, help="KV capacity of both servers (default 40G; --cpu 256M)")
    ap.add_argument("--limits", action="store_true", help="then step 4 (limits.py) on the kvcached server")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:K=V[,K=V]",
        help="one more kvcached server with this env, measured beside the others (e.g. premapped:"
        "KVCACHED_MIN_RESERVED_PAGES=700,KVCACHED_MAX_RESERVED_PAGES=700)",
    )
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    a = ap.parse_args(argv)
    variants = {"kvcached": {}}
    for v in a.variant:
        label, _, env = v.partition(":")
        variants[label] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    a.input_len = a.input_len or (64 if a.cpu else 512)
    a.output_len = a.output_len or (16 if a.cpu else 128)
    os.makedirs(a.out, exist_ok=True)
    kv = parse_size(a.kv or ("256M" if a.cpu else "40G"))
    rates = [float(r) for r in a.rates.split(",")]
    tag = os.getpid()
    start = start_sglang_server if a.engine == "sglang" else start_server
    servers = {"native": start(a.model, f"ovh_native_{tag}", False, a.out, cpu=a.cpu, kv_bytes=kv)}
    for label, env in variants.items():
        servers[label] = start(
            a.model, f"ovh_{label}_{tag}", True, a.out, cpu=a.cpu, kv_bytes=kv, budget_fraction=0.9, **env
        )
    try:
        log(f"servers up after {wait_all(list(servers.values()), 900):.0f} s")
        for label, srv in servers.items():  # warm-up: first requests compile and allocate
            bench(srv, float("inf"), 32, a, f"warmup_{label}", seed=0)
        runs: Dict[str, Dict[float, List[Dict[str, Any]]]] = {k: {r: [] for r in rates} for k in servers}
        for rnd in range(a.rounds):
            for i, rate in enumerate(rates):
                n = a.inf_requests if rate == float("inf") else max(64, int(rate * a.seconds))
                if a.cpu:
                    n = min(n, 48)
                k = (rnd + i) % len(servers)  # each server first in turn
                order = list(servers)[k:] + list(servers)[:k]
                # Fresh prompts in every run (the same for both servers): prompts seen in an
                # earlier run would be prefix-cache hits, and each engine keeps a different
                # cache, so the two would not do the same work.
                seed = 1 + rnd * len(rates) + i
                for label in order:
                    t0 = time.monotonic()
                    runs[label][rate].append(bench(servers[label], rate, n, a, f"r{rnd}_{rate}_{label}", seed))
                    log(f"round {rnd + 1} rate {rate:g} {label}: {n} requests in {time.monotonic() - t0:.0f} s")
        save = {"rates": rates, "runs": {k: {str(r): v for r, v in d.items()} for k, d in runs.items()}}
        save["page_calls"] = {label: page_calls(servers[label]) for label in variants}
        write_json(os.path.join(a.out, "overhead.json"), save)  # kept whatever the limits step does
        limits_ok = True
        if a.limits:
            try:
                complete = sglang_complete if a.engine == "sglang" else vs.complete
                limits_ok = bool(check_limit(servers["kvcached"], a.cpu, a.out, complete)["pass"])
            except Exception as e:  # noqa: BLE001 - the overhead table still prints
                log(f"limits step failed: {e}")
                limits_ok = False
    finally:
        for s in servers.values():
            s.stop()
    tool = "sglang.bench_serving" if a.engine == "sglang" else "vllm bench serve"
    print(
        f"\n{tool}, random {a.input_len} in / {a.output_len} out, {a.rounds} rounds (median); "
        "ratio = kvcached / native; paired = the median of the rounds' own ratios [their range]"
    )
    worst = {"throughput": 1.0, "p99": 1.0, "paired throughput": 1.0, "paired p99": 1.0}
    for label in variants:
        print(f"\n{'rate':>6} {'metric':<20} {'native':>10} {label:>10} {'ratio':>7} {'paired':>7}  range")
        for rate in rates:
            for m in METRICS:
                nat = statistics.median(x[m] for x in runs["native"][rate])
                kvc = statistics.median(x[m] for x in runs[label][rate])
                ratio = kvc / nat if nat else float("nan")
                # Rounds alternate the servers, so a round's ratio cancels what drifted between rounds.
                pairs = [y[m] / x[m] for x, y in zip(runs["native"][rate], runs[label][rate]) if x[m]]
                if not pairs:
                    continue
                paired = statistics.median(pairs)
                print(
                    f"{rate:>6g} {m:<20} {nat:>10.2f} {kvc:>10.2f} {ratio:>7.3f} {paired:>7.3f}  "
                    f"{min(pairs):.2f}-{max(pairs):.2f}"
                )
                if label == "kvcached" and m == "output_throughput":
                    worst["throughput"] = min(worst["throughput"], ratio)
                    worst["paired throughput"] = min(worst["paired throughput"], paired)
                if label == "kvcached" and m.startswith("p99"):
                    worst["p99"] = max(worst["p99"], ratio)
                    worst["paired p99"] = max(worst["paired p99"], paired)
    if a.engine == "vllm":
        print_engine_view(runs, rates)
    busy = {lab: sum(x["duration"] for r in rates for x in runs[lab][r]) for lab in variants}
    for label, calls in save["page_calls"].items():
        print(
            f"{label}: {calls.get('map_count', 0):.0f} map calls, {calls.get('map_sum', 0):.2f} s; "
            f"{calls.get('unmap_count', 0):.0f} unmap calls, {calls.get('unmap_sum', 0):.2f} s; "
            f"since start (warm-up included), beside {busy[label]:.1f} s of measured runs"
        )
    print(
        f"worst kvcached throughput ratio {worst['throughput']:.3f} (paired {worst['paired throughput']:.3f}; "
        f"goal >= 0.98); worst p99 ratio {worst['p99']:.3f} (paired {worst['paired p99']:.3f}; goal <= 1.03)"
    )
    return 0 if limits_ok else 1


if __name__ == "__main__":
    sys.exit(main())
