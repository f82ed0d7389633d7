"""Step 4 of the GPU proof: ``kvctl limit`` lowered while an engine decodes.

    python scripts/gpu_proof/limits.py --model DIR --out DIR [--cpu]

One kvcached server under a steady decoding load. The limit is lowered to half
of what it maps; the engine must be at or under it within a second, and stay
there, with no request failing (requests it cannot hold are preempted and
resumed, not lost). Then the limit is raised and the engine must grow past the
lowered limit again. Exits 1 when any of that fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GIB, kvctl, log, start_server, wait_all, write_json  # noqa: E402

from kvcached.limits.units import format_size  # noqa: E402
from kvcached.testing import vllm_server as vs  # noqa: E402
from kvcached.testing.record_sampler import RecordSampler  # noqa: E402


def check_limit(srv: vs.Server, cpu: bool, out: str) -> Dict[str, object]:
    """Runs the lower/raise sequence against a running kvcached server ``srv``."""
    conc, plen, gen, seconds = (8, 64, 96, 20.0) if cpu else (96, 512, 1024, 20.0)
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
                got = vs.complete(srv, prompt, gen, timeout=600)
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
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    srv = start_server(
        a.model, f"limits_{os.getpid()}", True, a.out, cpu=a.cpu, kv_bytes=(256 << 20) if a.cpu else 40 * GIB
    )
    try:
        wait_all([srv], 900)
        return 0 if check_limit(srv, a.cpu, a.out)["pass"] else 1
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
