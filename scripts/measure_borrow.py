"""How long a borrow of N pages from an idle engine's prefix cache takes, on the host backend.

    cd tests && PYTHONPATH=.. ../.venvs/kvcached/bin/python ../scripts/measure_borrow.py

The engine is tests/borrowing/borrow_engine.py (the elastic runtime with a prefix cache, 256 KiB
of budget per page) in its own process on a budget of N + 10 pages, scoped to this run;
each round it caches N pages, goes idle, and this process times ``reserve(N pages)``
until it returns (want published, peers woken, the cache evicted, the bytes held).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, os.path.join(TESTS, "helpers"))  # limits_helpers

from kvcached.borrowing import reserve  # noqa: E402
from kvcached.limits import DeviceBudget  # noqa: E402
from limits_helpers import remove_records, unique_prefix  # noqa: E402

BPP = 256 << 10
ROUNDS = 7


def measure(pages: int) -> list:
    prefix = unique_prefix()
    budget_bytes = (pages + 10) * BPP
    cfg = dict(name=prefix + "e", scope=prefix, budget_bytes=budget_bytes, blocks=4 * (pages + 12))
    engine = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "borrowing", "borrow_engine.py"), json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )

    def call(**kw: object) -> dict:
        engine.stdin.write(json.dumps(kw) + "\n")
        engine.stdin.flush()
        return json.loads(engine.stdout.readline())

    engine.stdout.readline()
    budget = DeviceBudget("cpu", budget_bytes, scope=prefix)
    times = []
    try:
        for _ in range(ROUNDS):
            assert call(op="cache", pages=pages)["ok"]
            time.sleep(0.7)  # idle, past its periodic peer check
            t = time.monotonic()
            r = reserve(pages * BPP, budget=budget, name=prefix + "job", timeout_s=30)
            times.append(time.monotonic() - t)
            r.release()
        call(op="exit")
        engine.wait(10)
    finally:
        if engine.poll() is None:
            engine.kill()
        remove_records(prefix)
    return times


def main() -> None:
    for pages in (30, 120):
        t = measure(pages)
        print(
            f"{pages} pages ({pages * BPP / (1 << 20):.1f} MiB) from an idle cache: median "
            f"{statistics.median(t) * 1e3:.1f} ms, min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f} over {len(t)}"
        )


if __name__ == "__main__":
    main()
