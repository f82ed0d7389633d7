"""Round trip of one MAP fanned out to TP worker processes.

``python -m kvcached.bench ipc [--tp 1,2,4] [--offsets 1,64] [--repeats N] [--rounds R] [--json]``

Backend time is excluded by construction: the workers run with a no-op executor
(``kvcached.ipc.executor.NullExecutor``), so a row measures exactly the
coordinator -> every worker -> coordinator path (framing, sockets, wake-ups,
dispatch), from ``TPCoordinator.map`` call to return. Rows beside it, from the
same run:

  ping        an empty request/reply to every rank: the floor of this channel
  map         the goal rows (median <= 100 us at TP=1, <= 250 us at TP=4)
  map/conn    the same MAP on a new connection per call (connect, HELLO, MAP):
              what a connection-per-message design pays, before any pickling
  map+host    informational: real host-backend workers (2 layers, K and V),
              MAP round trip including the backend's work
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

from kvcached.bench._table import print_table

PAGE = 64 * 1024
GOAL_US = {1: 100.0, 4: 250.0}


def _percentiles(samples: List[float]) -> Dict[str, float]:
    s = sorted(samples)
    return {
        "median_us": statistics.median(s) * 1e6,
        "p90_us": s[int(0.9 * (len(s) - 1))] * 1e6,
        "p99_us": s[int(0.99 * (len(s) - 1))] * 1e6,
    }


def _time(fn: Callable[[], None], repeats: int, warmup: int, after: Optional[Callable[[], None]] = None) -> List[float]:
    for _ in range(warmup):
        fn()
        if after:
            after()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if after:
            after()
    return out


def _measure_tp(
    tp: int, sizes: Sequence[int], repeats: int, warmup: int, rounds: int, with_backend: bool
) -> List[dict]:
    """Rows for one TP size. Each path is measured in ``rounds`` interleaved rounds
    and the samples pooled, so a burst of interference from a noisy neighbour lands
    on every path alike instead of on one row."""
    from kvcached.ipc.coordinator import TPCoordinator
    from kvcached.testing.ipc_worker import WorkerGroup

    per_round = max(1, repeats // rounds)
    samples: Dict[tuple, List[float]] = {}
    name = f"bench-ipc-{os.getpid()}-tp{tp}"
    with WorkerGroup(name, tp, noop=True) as _:
        with TPCoordinator(tp, ipc_name=name, timeout=10.0) as c:
            c.ping()

            def fresh() -> None:
                with TPCoordinator(tp, ipc_name=name, timeout=10.0) as c2:
                    c2.map([0])

            for _round in range(rounds):
                samples.setdefault(("ping", 0), []).extend(_time(c.ping, per_round, warmup))
                for n in sizes:
                    offs = [i * PAGE for i in range(n)]
                    samples.setdefault(("map", n), []).extend(_time(lambda: c.map(offs), per_round, warmup))
                samples.setdefault(("map/conn", 1), []).extend(_time(fresh, max(10, per_round // 10), 2))
    if with_backend:
        name = f"bench-ipc-{os.getpid()}-tp{tp}-host"
        with WorkerGroup(name, tp, pages=max(sizes) + 1) as _:
            with TPCoordinator(tp, ipc_name=name, timeout=10.0) as c:
                for _round in range(rounds):
                    for n in sizes:
                        offs = [i * PAGE for i in range(n)]
                        samples.setdefault(("map+host", n), []).extend(
                            _time(lambda: c.map(offs), max(10, per_round // 10), 2, after=lambda: c.unmap(offs))
                        )
    rows = []
    for (path, n), ss in samples.items():
        r = {"tp": tp, "path": path, "offsets": n, "samples": len(ss), **_percentiles(ss)}
        if path == "map" and tp in GOAL_US:
            r["goal_us"] = GOAL_US[tp]
            r["met"] = "yes" if r["median_us"] <= GOAL_US[tp] else "NO"
        rows.append(r)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcached.bench ipc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2,4", help="comma-separated TP sizes")
    ap.add_argument("--offsets", default="1,64", help="comma-separated offsets per MAP")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls before each round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds the repeats are split into")
    ap.add_argument("--no-backend", action="store_true", help="skip the informational map+host rows")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(list(argv) if argv is not None else None)
    tps = [int(x) for x in args.tp.split(",") if x]
    sizes = [int(x) for x in args.offsets.split(",") if x]
    rows: List[dict] = []
    for tp in tps:
        rows.extend(_measure_tp(tp, sizes, args.repeats, args.warmup, max(1, args.rounds), not args.no_backend))
    meta = {
        "benchmark": "ipc: MAP round trip coordinator -> TP workers -> coordinator",
        "backend_time": "excluded (workers use a no-op executor) except rows map+host",
        "repeats": f"{args.repeats} per path in {args.rounds} interleaved rounds (map/conn and map+host: 1/10 of that)",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    print_table(
        rows, ["tp", "path", "offsets", "samples", "median_us", "p90_us", "p99_us", "goal_us", "met"], args.json, meta
    )
    missed = [r for r in rows if r.get("met") == "NO"]
    return 1 if missed else 0
