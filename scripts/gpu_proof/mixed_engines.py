"""Two engines, one KV budget (issue 28, step 5): a vLLM server and an SGLang server on one
device lend each other memory through kvcached; against a static split of the same memory.

    python scripts/gpu_proof/mixed_engines.py --model DIR --out DIR [--kv 6G] [--plot PNG] [--cpu]
        [--vllm-python PY] [--vllm-path PYTHONPATH] [--sglang-python PY] [--sglang-path PYTHONPATH]

Four servers are resident at once: vLLM's OpenAI server and SGLang's ``launch_server`` with
kvcached, sharing ``--kv`` of KV (the device budget of every kvcached instance), and the same
two natively with half of it each. Bursts of streamed requests alternate between the engines,
vLLM, SGLang, vLLM, SGLang, first on the kvcached pair and then on the static one, so memory
has to move both ways twice. Reports TTFT p50/p99 per burst for both setups, how long each
want took to be served by the other engine (from the first sample where the loaded instance
wants memory to the first where the idle one maps less), and plots mapped KV of both over time.

The engines' packages clash (transformers, flashinfer), so each runs with its own interpreter
and PYTHONPATH (on the H200: ``/tmp/sc-vllm`` and ``/tmp/sc-sglang`` from
scripts/gpu_device_install.sh; here the CPU venvs). Exits 1 when a request failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_engine_args,
    budget_env,
    log,
    percentile,
    start_server,
    start_sglang_server,
    wait_all,
    write_json,
)
from three_models import burst, give_back_time, plot  # noqa: E402

from kvcached.testing import sglang_server as ss  # noqa: E402
from kvcached.testing import vllm_server as vs  # noqa: E402
from kvcached.testing.record_sampler import RecordSampler  # noqa: E402
from kvcached.units import format_size, parse_size  # noqa: E402

ORDER = ("vllm", "sglang", "vllm", "sglang")


def start_pair(a: argparse.Namespace, kvcached: bool, kv: int, tag: int) -> Dict[str, vs.Server]:
    """One vLLM and one SGLang server, with kvcached sharing ``kv`` or natively with half each."""
    size = kv if kvcached else kv // 2
    extra = budget_env(kv, a.cpu) if kvcached else {}
    kind = "shared" if kvcached else "static"
    vllm_env = {"PYTHONPATH": a.vllm_path} if a.vllm_path else {}
    sglang_env = {"PYTHONPATH": a.sglang_path} if a.sglang_path else {}
    return {
        "vllm": start_server(
            a.model, f"mixed_vllm_{kind}_{tag}", kvcached, a.out, cpu=a.cpu, kv_bytes=size,
            python=a.vllm_python, **extra, **vllm_env,
        ),
        "sglang": start_sglang_server(
            a.model, f"mixed_sglang_{kind}_{tag}", kvcached, a.out, cpu=a.cpu, kv_bytes=size,
            python=a.sglang_python, **extra, **sglang_env,
        ),
    }  # fmt: skip


STREAM = {"vllm": vs.stream, "sglang": ss.stream}


def run_bursts(
    pair: Dict[str, vs.Server], rec: RecordSampler, n: int, plen: int, gen: int
) -> Tuple[List[Dict[str, float]], List[Tuple[str, float, float]]]:
    """The bursts of ORDER on ``pair``: one result row each, and (record name, start, end) per burst."""
    rows: List[Dict[str, float]] = []
    phases: List[Tuple[str, float, float]] = []
    for i, engine in enumerate(ORDER):
        srv = pair[engine]
        t0 = rec.now()
        ttfts, failed = burst(srv, n, plen, gen, seed=10 + i, stream=STREAM[engine])
        phases.append((srv.name, t0, rec.now()))
        rows.append(
            {
                "engine": engine,
                "p50_ttft_s": percentile(ttfts, 50),
                "p99_ttft_s": percentile(ttfts, 99),
                "failed": failed,
                "seconds": rec.now() - t0,
            }
        )
        log(
            f"{srv.name}: {n} requests, p50 TTFT {percentile(ttfts, 50):.2f} s, p99 {percentile(ttfts, 99):.2f} s, "
            f"{failed} failed, {rec.now() - t0:.1f} s"
        )
        time.sleep(3.0)  # idle between bursts: the idle engine gives back what the next one wants
    return rows, phases


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv", default=None, help="KV memory of the two together (default 6G; --cpu 24M)")
    ap.add_argument("--burst", type=int, default=None, help="requests per burst (default 192; --cpu 12)")
    ap.add_argument("--plot", default=None, help="PNG of mapped KV over time (default OUT/gpu_mixed_engines.png)")
    add_engine_args(ap)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    kv = parse_size(a.kv or ("24M" if a.cpu else "6G"))
    n = a.burst or (12 if a.cpu else 192)
    plen, gen = (64, 48) if a.cpu else (1024, 512)
    tag = os.getpid()
    pairs: Dict[str, Dict[str, vs.Server]] = {}
    results: Dict[str, List[Dict[str, float]]] = {}
    rec = None
    try:
        pairs["kvcached"] = start_pair(a, True, kv, tag)
        pairs["static"] = start_pair(a, False, kv, tag)
        every = [s for p in pairs.values() for s in p.values()]
        log(f"four servers up after {wait_all(every, 1200):.0f} s")
        for engine, srv in ((e, s) for p in pairs.values() for e, s in p.items()):
            burst(srv, 2, plen, 8, seed=99, stream=STREAM[engine])  # warm-up: compile and allocate
        labels = {s.name: e for e, s in pairs["kvcached"].items()}
        rec = RecordSampler(list(labels), period=0.02)
        rec.start()
        time.sleep(1.0)
        results["kvcached"], phases = run_bursts(pairs["kvcached"], rec, n, plen, gen)
        results["static"], _ = run_bursts(pairs["static"], rec, n, plen, gen)
        rec.stop()
    finally:
        if rec is not None:
            rec.stop()
        for pair in pairs.values():
            for srv in pair.values():
                srv.stop()
    # From the second burst on, the loaded engine wants what the other one holds.
    give = {f"{ORDER[i - 1]} -> {ORDER[i]}": give_back_time(rec, *phases[i]) for i in range(1, len(phases))}
    peaks = {labels[nm]: rec.peak(nm) for nm in labels}
    write_json(
        os.path.join(a.out, "mixed_engines.json"),
        {
            "results": results,
            "give_back_s": give,
            "peaks": peaks,
            "series": {labels[k]: [tuple(p) for p in v] for k, v in rec.series.items()},
        },
    )
    plot(
        rec, phases, kv, labels, a.plot or os.path.join(a.out, "gpu_mixed_engines.png"),
        title="kvcached: a vLLM and an SGLang server on one GPU share one KV budget", split=2,
    )  # fmt: skip
    print(
        f"\nvLLM and SGLang, bursts of {n} requests ({plen} in / {gen} out) alternating {' -> '.join(ORDER)}; "
        f"KV {format_size(kv)} shared (kvcached) vs {format_size(kv // 2)} each (static)"
    )
    print(f"{'burst':<10} {'kvcached p50':>13} {'p99':>8} {'static p50':>11} {'p99':>8}")
    for i, (k, st) in enumerate(zip(results["kvcached"], results["static"])):
        print(
            f"{i + 1} {k['engine']:<8} {k['p50_ttft_s']:>12.2f}s {k['p99_ttft_s']:>7.2f}s "
            f"{st['p50_ttft_s']:>10.2f}s {st['p99_ttft_s']:>7.2f}s"
        )
    print(f"peak mapped: vLLM {format_size(peaks['vllm'])}, SGLang {format_size(peaks['sglang'])}")
    ms = {w: "no want" if x is None else f"{x * 1000:.0f} ms" for w, x in give.items()}
    print("want -> memory given back by the other engine: " + ", ".join(f"{w}: {v}" for w, v in ms.items()))
    failed = sum(r["failed"] for rows in results.values() for r in rows)
    print(f"{failed} requests failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
