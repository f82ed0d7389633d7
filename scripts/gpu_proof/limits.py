"""Step 4 of the GPU proof: ``kvctl limit`` lowered while an engine decodes.

    python scripts/gpu_proof/limits.py --model DIR --out DIR [--engine vllm|sglang] [--cpu]

One kvcached server (vLLM's OpenAI server or SGLang's ``launch_server``) under
a steady decoding load. The limit is lowered to half of what it maps; the engine
must be at or under it within a second, and stay there, with no request failing
(requests it cannot hold are preempted and resumed, not lost). Then the limit is
raised and the engine must grow past the lowered limit again. Exits 1 when any
of that fails.

On the CPU the load is cache-dominated unless the prefix cache is bounded; to see
running requests hold the pages (as on a GPU)::

    python scripts/gpu_proof/limits.py --engine sglang --cpu --model DIR --out DIR --gen 440 --clients 96 \
        --engine-env KVCACHED_PAGE_SIZE=65536 --engine-env KVCACHED_MAX_CACHED_TOKENS=256
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GIB, kvctl, log, start_server, start_sglang_server, wait_all, write_json  # noqa: E402

from kvcached.testing import sglang_server as ss  # noqa: E402
from kvcached.testing import vllm_server as vs  # noqa: E402
from kvcached.testing.record_sampler import RecordSampler  # noqa: E402
from kvcached.units import format_size  # noqa: E402

Complete = Callable[[vs.Server, List[int], int, float], List[int]]


def sglang_complete(srv: vs.Server, prompt: List[int], gen: int, timeout: float) -> List[int]:
    return ss.generate(srv, [prompt], [gen], timeout=timeout)[0][0]


def check_limit(
    srv: vs.Server, cpu: bool, out: str, complete: Complete = vs.complete, gen: int = 0, clients: int = 0
) -> Dict[str, object]:
    """Runs the lower/raise sequence against a running kvcached server ``srv`` under
    ``clients`` clients (0: 8 on the CPU, 96 on a GPU); ``complete`` sends one greedy request
    of ``gen`` tokens (0: 96 on the CPU, 1024 on a GPU) and returns the output ids."""
    plen, seconds = (64, 20.0) if cpu else (512, 20.0)
    conc = clients or (8 if cpu else 96)
    gen = gen or (96 if cpu else 1024)
    rec = RecordSampler([srv.name], period=0.02)
    rec.start()
    failures: List[str] = []
    done = [0]
    stop = threading.Event()

    def client(i: int) -> None:
        k = 0
        while not stop.is_set():
            prompt = vs.token_prompts(1, plen, seed=1000 * i + k)[0]
            k += 1
            try:
                got = complete(srv, prompt, gen, 600)
                if len(got) != gen:
                    failures.append(f"client {i}: {len(got)} of {gen} tokens")
                done[0] += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported
                failures.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(conc)]
    for t in threads:
        t.start()
    time.sleep(seconds / 2)  # load reaches its steady footprint
    before = rec.series[srv.name][-1].mapped
    prev_limit = rec.series[srv.name][-1].limit
    low = max(before // 2, 64 << 20 if not cpu else 2 << 20)
    t_set = rec.now()
    kvctl("limit", srv.name, str(low))
    log(f"limit lowered to {format_size(low)} while mapping {format_size(before)}")
    time.sleep(seconds / 2)
    shrunk_at = rec.first_time(srv.name, lambda s: s.mapped <= low, after=t_set)
    after_low = [s.mapped for s in rec.series[srv.name] if shrunk_at is not None and s.t >= shrunk_at]
    t_raise = rec.now()
    kvctl("limit", srv.name, str(prev_limit))  # back to what it was
    log("limit raised")
    time.sleep(seconds / 2)
    grew_at = rec.first_time(srv.name, lambda s: s.mapped > low, after=t_raise)
    stop.set()
    for t in threads:
        t.join(timeout=900)
    rec.stop()
    res = {
        "mapped_before": before,
        "limit": low,
        "shrink_s": None if shrunk_at is None else shrunk_at - t_set,
        "max_mapped_after_shrink": max(after_low, default=None),
        "grow_s": None if grew_at is None else grew_at - t_raise,
        "requests_done": done[0],
        "failures": failures[:20],
        "n_failures": len(failures),
    }
    write_json(os.path.join(out, "limits.json"), res)
    ok = res["shrink_s"] is not None and res["shrink_s"] <= 1.0 and not failures and res["grow_s"] is not None
    ok = ok and (res["max_mapped_after_shrink"] or 0) <= low
    print(
        f"\nlimit lowered while decoding: {format_size(before)} mapped -> limit {format_size(low)}: "
        f"at or under it after {res['shrink_s'] if res['shrink_s'] is None else round(res['shrink_s'], 3)} s "
        f"(goal <= 1 s), stayed under: {(res['max_mapped_after_shrink'] or 0) <= low}; raised: grew past it after "
        f"{res['grow_s'] if res['grow_s'] is None else round(res['grow_s'], 3)} s; "
        f"{done[0]} requests done, {len(failures)} failed -> {'PASS' if ok else 'FAIL'}"
    )
    res["pass"] = ok
    return res


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument(
        "--gen",
        type=int,
        default=0,
        help="tokens per request (default 96 on the CPU, 1024 on a GPU): "
        "requests that outlast the test hold their pages unless the engine preempts them",
    )
    ap.add_argument("--clients", type=int, default=0, help="concurrent clients (default 8 on the CPU, 96 on a GPU)")
    ap.add_argument("--engine-env", action="append", default=[], metavar="K=V", help="more environment for the server")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    kv = (256 << 20) if a.cpu else 40 * GIB
    name = f"limits_{os.getpid()}"
    env = dict(e.split("=", 1) for e in a.engine_env)
    if a.engine == "sglang":
        srv, complete = start_sglang_server(a.model, name, True, a.out, cpu=a.cpu, kv_bytes=kv, **env), sglang_complete
    else:
        srv, complete = start_server(a.model, name, True, a.out, cpu=a.cpu, kv_bytes=kv, **env), vs.complete
    try:
        wait_all([srv], 900)
        return 0 if check_limit(srv, a.cpu, a.out, complete, a.gen, a.clients)["pass"] else 1
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
