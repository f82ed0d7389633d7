"""SGLang with and without kvcached, in the same run: throughput and TTFT.

    python -m kvcached.bench sglang [--model DIR] [--device cpu] [--page-size 16]
                                    [--num-prompts 64] [--input-len 64] [--output-len 64]
                                    [--ttft-requests 16] [--rounds 6] [--json]

Two engines run side by side, each in its own process (kvcached patches
SGLang at import time): ``baseline`` is SGLang as installed, ``kvcached`` the
same engine with ``ENABLE_KVCACHED=true``. Both sleep when idle
(``sleep_on_idle``), so the one not measuring does not compete. Measurements
alternate between them (A B, B A, A B, ...), each round being

* throughput: one offline batch of ``--num-prompts`` distinct prompts of
  ``--input-len`` tokens, ``--output-len`` new tokens each (greedy,
  ``ignore_eos``): generated tokens per second of wall time;
* TTFT: ``--ttft-requests`` single streamed requests, one after another
  (fresh prompts, no prefix-cache hit): time to the first streamed chunk;
* the scheduler process's CPU time per generated token during the batch (it
  also runs the model).

Each round gives a kvcached/baseline ratio from two measurements taken
seconds apart; the table reports the median ratio (drift on a shared machine
hits both sides of a pair), the medians per mode, and the best round per mode.
A second table times the scheduler-side KV path alone (allocator calls and
kvcached's hooks), SGLang's classes vs ours, in this process.

Without ``--model`` a tiny random Llama is built (CPU-friendly; the numbers
then stress the engine's per-step overhead, where kvcached's allocator and
mapping costs would show). Needs an environment with SGLang (e.g. the venv of
scripts/setup_sglang_venv.sh; on the CPU the test-only ``vllm._custom_ops``
stub must be on PYTHONPATH, see tests/engines/sglang_stubs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from kvcached.bench._table import print_table

MODES = ("baseline", "kvcached")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvcached.bench sglang", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: build a tiny Llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", default=None, help="default: torch_native on cpu, SGLang's choice on cuda")
    ap.add_argument("--page-size", type=int, default=16, help="SGLang page size (tokens)")
    ap.add_argument(
        "--max-total-tokens", type=int, default=16384, help="pool size for both modes (0: SGLang/kvcached decide)"
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ttft-requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6, help="measurement pairs (engines start once)")
    ap.add_argument(
        "--kv-page-size",
        default=None,
        help="KVCACHED_PAGE_SIZE for the kvcached mode (default: 64K on cpu, the library default on cuda)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    return ap


def _prompts(tag: str, n: int, length: int) -> List[str]:
    # One word per token with the tiny model's tokenizer (plus BOS); other
    # tokenizers give a similar length.
    return [" ".join(f"{tag}{i}w{j}" for j in range(length - 1)) for i in range(n)]


def _serve(a: argparse.Namespace) -> None:
    """One engine; answers ``batch``/``ttft``/``quit`` lines on stdin with JSON lines on stdout."""
    import psutil
    import sglang

    kw: Dict[str, Any] = dict(device=a.device, page_size=a.page_size, log_level="error", sleep_on_idle=True)
    if a.device == "cpu":
        kw.update(
            attention_backend=a.attention_backend or "torch_native", sampling_backend="pytorch", disable_cuda_graph=True
        )
    elif a.attention_backend:
        kw["attention_backend"] = a.attention_backend
    if a.max_total_tokens:
        kw["max_total_tokens"] = a.max_total_tokens
    out = sys.stdout
    sys.stdout = sys.stderr  # the engine's prints stay off the protocol
    t0 = time.perf_counter()
    engine = sglang.Engine(model_path=a.model, **kw)
    start_s = time.perf_counter() - t0
    params = {"temperature": 0.0, "max_new_tokens": a.output_len, "ignore_eos": True}
    one = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    sched = psutil.Process(engine.get_all_child_pids()[0])
    info = engine.get_server_info()
    mtt = info.get("max_total_num_tokens") or (info.get("internal_states") or [{}])[0].get("max_total_num_tokens")
    engine.generate(prompt=_prompts("warm", 8, a.input_len), sampling_params=params)

    def reply(obj: Dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True, "start_s": start_s, "max_total_num_tokens": mtt})
    n = 0
    try:
        for line in sys.stdin:
            cmd = line.strip()
            n += 1
            if cmd == "batch":
                engine.flush_cache()
                c0 = sched.cpu_times()
                t1 = time.perf_counter()
                outs = engine.generate(prompt=_prompts(f"tp{n}x", a.num_prompts, a.input_len), sampling_params=params)
                dt = time.perf_counter() - t1
                c1 = sched.cpu_times()
                gen = sum(len(o["output_ids"]) for o in outs)
                cpu = (c1.user + c1.system) - (c0.user + c0.system)
                reply({"throughput_tok_s": gen / dt, "sched_cpu_ms_per_tok": 1000 * cpu / gen})
            elif cmd == "ttft":
                ts = []
                for p in _prompts(f"ttft{n}x", a.ttft_requests, a.input_len):
                    t1 = time.perf_counter()
                    for _chunk in engine.generate(prompt=p, sampling_params=one, stream=True):
                        ts.append(time.perf_counter() - t1)
                        break
                reply({"ttft_ms": 1000 * statistics.median(ts)})
            else:
                break
    finally:
        engine.shutdown()


def _alloc_path(a: argparse.Namespace, repeats: int = 9) -> List[Dict[str, Any]]:
    """The scheduler-side KV path alone, SGLang's classes vs ours, in this process.

    One cycle is what the scheduler does for a batch of ``--num-prompts``
    requests: one extend allocation, ``--output-len`` decode steps (a capacity
    check, ``alloc_decode`` and, for kvcached, the release-marker hooks of
    each batch), then the finished requests freed in one free group. Engine
    runs on a shared machine move by far more than the few microseconds this
    path costs; this number does not.
    """
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvcached.integration.sglang import allocator as ea
    from kvcached.integration.sglang import scheduler_hooks
    from kvcached.integration.sglang.pool import ElasticMHATokenToKVPool, shutdown_all

    os.environ.setdefault("KVCACHED_IPC_NAME", f"kvcached_bench_sglang_{os.getpid()}")
    ps, bs, n_in, n_out = a.page_size, a.num_prompts, a.input_len, a.output_len
    size = max(a.max_total_tokens or 0, 2 * bs * (n_in + n_out + ps))
    size -= size % ps
    dev = "cpu" if a.device == "cpu" else "cuda"
    kw = dict(
        page_size=ps, dtype=torch.float16, head_num=8, head_dim=128, layer_num=4, device=dev, enable_memory_saver=False
    )

    def build(elastic: bool):
        pool = (ElasticMHATokenToKVPool if elastic else MHATokenToKVPool)(size, **kw)
        if ps == 1:
            cls = ea.ElasticTokenToKVPoolAllocator if elastic else TokenToKVPoolAllocator
            return cls(size, torch.float16, dev, pool, False)
        cls = ea.ElasticPagedTokenToKVPoolAllocator if elastic else PagedTokenToKVPoolAllocator
        return cls(size, ps, torch.float16, dev, pool, False)

    class _Result:
        pass

    def cycle(alloc, elastic: bool, release: bool) -> None:
        lens = torch.full((bs,), n_in, dtype=torch.int64)
        zeros = torch.zeros(bs, dtype=torch.int64)
        if ps == 1:
            rows = alloc.alloc(bs * n_in).view(bs, n_in)
        else:
            out = alloc.alloc_extend(
                zeros.to(dev), zeros, lens.to(dev), lens, torch.full((bs,), -1, device=dev), bs * n_in
            )
            rows = out.view(bs, n_in)
        cols = [rows]
        last = rows[:, -1]
        for step in range(n_out):
            r = _Result()
            if elastic:
                scheduler_hooks.after_launch(r)
            assert (
                alloc.check_decode_capacity(num_tokens=bs * ps, tree_cache=None)
                if elastic
                else alloc.available_size() >= bs * ps
            )
            if ps == 1:
                new = alloc.alloc(bs)
            else:
                sl = lens + step + 1
                new = alloc.alloc_decode(sl.to(dev), sl, last)
            cols.append(new.view(bs, 1))
            last = new
            if elastic:
                scheduler_hooks.after_result(None, r)
        rows = torch.cat(cols, dim=1)
        alloc.free_group_begin()
        for i in range(bs):
            alloc.free_segments([(rows[i], 0)])
        alloc.free_group_end()
        if release:
            scheduler_hooks.release_all()  # idle: emptied pages go to the reserve, or are unmapped beyond it

    # kvcached twice: serving steadily (the next batch follows at once: freed
    # slots and pages are reused, emptied pages beyond the mapped reserve are
    # released one batch later), and idle between batches (every spare slot
    # handed back, every emptied page beyond the reserve unmapped, then mapped
    # again by the next batch: this includes the backend's map cost).
    modes = {
        "baseline": (False, False),
        "kvcached, serving steadily": (True, False),
        "kvcached, idle between batches": (True, True),
    }
    allocs = {
        "baseline": build(False),
        "kvcached, serving steadily": build(True),
        "kvcached, idle between batches": build(True),
    }
    times: Dict[str, List[float]] = {m: [] for m in modes}
    for m, (el, rel) in modes.items():  # warm-up: first maps, kernels
        cycle(allocs[m], el, rel)
    names = list(modes)
    for r in range(repeats):
        for m in names if r % 2 == 0 else list(reversed(names)):
            el, rel = modes[m]
            t0 = time.perf_counter()
            cycle(allocs[m], el, rel)
            times[m].append(time.perf_counter() - t0)
    shutdown_all()
    # The fastest repeat: on a shared machine the others measure its neighbours.
    steps = n_out + 1
    base = 1e6 * min(times["baseline"]) / steps
    rows = []
    for m in names:
        us = 1e6 * min(times[m]) / steps
        rows.append({"mode": m, "us per batch step": us, "vs base": us / base})
    return rows


class _Engine:
    """A ``--serve`` process of one mode."""

    def __init__(self, a: argparse.Namespace, mode: str, model: str, log: str) -> None:
        env = dict(os.environ)
        for k in list(env):
            if k == "ENABLE_KVCACHED" or k.startswith("KVCACHED_"):
                del env[k]
        if mode == "kvcached":
            env.update(ENABLE_KVCACHED="true", KVCACHED_AUTOPATCH="1")
            page = a.kv_page_size or ("64K" if a.device == "cpu" else None)
            if page:
                from kvcached.limits import parse_size

                env["KVCACHED_PAGE_SIZE"] = str(parse_size(page))
        if a.device == "cpu":
            env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [
            sys.executable,
            "-m",
            "kvcached.bench",
            "sglang",
            "--serve",
            mode,
            "--model",
            model,
            "--device",
            a.device,
            "--page-size",
            str(a.page_size),
            "--max-total-tokens",
            str(a.max_total_tokens),
            "--num-prompts",
            str(a.num_prompts),
            "--input-len",
            str(a.input_len),
            "--output-len",
            str(a.output_len),
            "--ttft-requests",
            str(a.ttft_requests),
        ]
        if a.attention_backend:
            cmd += ["--attention-backend", a.attention_backend]
        self.mode, self.log = mode, log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self.info = self._read()

    def _read(self) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{self.mode} engine exited (rc={self.proc.returncode}); see {self.log}")
        return json.loads(line)

    def ask(self, cmd: str) -> Dict[str, Any]:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except Exception:
            self.proc.kill()
        self._log.close()


def main(argv: List[str]) -> int:
    a = _parser().parse_args(argv)
    if a.serve:
        _serve(a)
        return 0
    work = tempfile.mkdtemp(prefix="kvcached_bench_sglang_")
    model = a.model
    if model is None:
        from kvcached.testing.tiny_model import build_tiny_llama

        model = build_tiny_llama(
            os.path.join(work, "tiny-llama"),
            seed=0,
            vocab_size=512,
            hidden_size=64,
            max_position_embeddings=max(512, a.input_len + a.output_len + 16),
        )
    engines = {m: _Engine(a, m, model, os.path.join(work, f"{m}.log")) for m in MODES}
    res: Dict[str, List[Dict[str, Any]]] = {m: [] for m in MODES}
    try:
        for r in range(a.rounds):
            for m in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                got = engines[m].ask("batch")
                got.update(engines[m].ask("ttft"))
                res[m].append(got)
    finally:
        for e in engines.values():
            e.close()
    base_rs, kv_rs = res["baseline"], res["kvcached"]
    ratios = {
        "tok/s": [k["throughput_tok_s"] / b["throughput_tok_s"] for b, k in zip(base_rs, kv_rs)],
        "TTFT": [k["ttft_ms"] / b["ttft_ms"] for b, k in zip(base_rs, kv_rs)],
        "CPU": [k["sched_cpu_ms_per_tok"] / b["sched_cpu_ms_per_tok"] for b, k in zip(base_rs, kv_rs)],
    }
    rows = []
    for m in MODES:
        rs = res[m]
        row: Dict[str, Any] = {
            "mode": m,
            "tok/s median": statistics.median(x["throughput_tok_s"] for x in rs),
            "TTFT ms median": statistics.median(x["ttft_ms"] for x in rs),
            "sched CPU ms/tok median": statistics.median(x["sched_cpu_ms_per_tok"] for x in rs),
            "tok/s best": max(x["throughput_tok_s"] for x in rs),
            "start s": engines[m].info["start_s"],
            "pool tokens": engines[m].info["max_total_num_tokens"],
            "tok/s per round": " ".join(f"{x['throughput_tok_s']:.0f}" for x in rs),
        }
        for k, v in ratios.items():
            row[f"{k} ratio (median of pairs)"] = 1.0 if m == "baseline" else statistics.median(v)
        rows.append(row)
    meta = {
        "model": a.model or "tiny Llama (2 layers, 64 hidden, built here)",
        "device": a.device,
        "page_size": a.page_size,
        "workload": (
            f"{a.num_prompts} prompts x {a.input_len} in / {a.output_len} out; "
            f"TTFT over {a.ttft_requests} streamed requests"
        ),
        "rounds": f"{a.rounds} (each: baseline and kvcached back to back, order alternating)",
        "goal": "kvcached within 3% of baseline (tok/s ratio >= 0.97, TTFT ratio <= 1.03)",
    }
    cols = [
        "mode",
        "tok/s median",
        "tok/s ratio (median of pairs)",
        "TTFT ms median",
        "TTFT ratio (median of pairs)",
        "sched CPU ms/tok median",
        "CPU ratio (median of pairs)",
        "tok/s best",
        "start s",
        "pool tokens",
        "tok/s per round",
    ]
    # The allocator path runs at the library's page size (or --kv-page-size):
    # its model rows (8 KV heads x 128, fp16) are a real model's.
    os.environ.pop("KVCACHED_PAGE_SIZE", None)
    if a.kv_page_size:
        from kvcached.limits import parse_size

        os.environ["KVCACHED_PAGE_SIZE"] = str(parse_size(a.kv_page_size))
    path = _alloc_path(a)
    if a.json:
        print(json.dumps({"meta": meta, "engine": rows, "alloc_path": path}, indent=2))
        return 0
    print_table(rows, cols, False, meta)
    print()
    print_table(
        path,
        ["mode", "us per batch step", "vs base"],
        False,
        {
            "scheduler-side KV path": f"{a.num_prompts} requests x {a.output_len} decode steps, page size "
            f"{a.page_size}, in this process (fastest of 9)"
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
