"""What the router adds to a request: ``kvcached serve`` in front of an engine
against the same engine reached directly, in one run.

``python -m kvcached.bench router [--requests N] [--events E] [--clients C] [--json]``

The engine is ``kvcached.bench.echo_engine`` (answers at once, no model), so
the difference between the two rows of a pair is the router's own cost: its
parsing, checks, the upstream connection and the copy of the answer. The
router runs as users run it (``python -m kvcached.router serve CONFIG``, its
own process); clients keep their connection alive, as OpenAI clients do.

  json      one non-streamed completion per request, one client: latency
  stream    E server-sent events per request, one client: time to the first
            event (what a user waits for) and to the last
  parallel  C clients at once, non-streamed: requests per second
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from kvcached.bench._table import print_table
from kvcached.router.supervisor import free_port

START_TIMEOUT_S = 60.0


def _pct(samples: List[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class _Client:
    """One keep-alive connection; ``post`` returns (first byte of an event, whole answer) seconds."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, body: bytes, stream: bool) -> Tuple[float, float]:
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        if not stream:
            r.read()
            t = time.perf_counter() - t0
            return t, t
        first = r.read1(65536)
        t_first = time.perf_counter() - t0
        rest = first + r.read()
        if not rest.rstrip().endswith(b"[DONE]"):
            raise RuntimeError("a stream ended without [DONE]")
        return t_first, time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()


def _serial(port: int, n: int, events: int, stream: bool) -> Tuple[List[float], List[float]]:
    body = json.dumps({"model": "echo", "prompt": "hi", "max_tokens": events, "stream": stream}).encode()
    c = _Client(port)
    try:
        for _ in range(max(10, n // 10)):  # warm-up: connections, the router's first-request paths
            c.post(body, stream)
        out = [c.post(body, stream) for _ in range(n)]
    finally:
        c.close()
    return [a for a, _ in out], [b for _, b in out]


def _parallel(port: int, n: int, clients: int) -> float:
    body = json.dumps({"model": "echo", "prompt": "hi", "max_tokens": 1}).encode()
    per = max(1, n // clients)
    errors: List[BaseException] = []

    def run() -> None:
        c = _Client(port)
        try:
            for _ in range(per):
                c.post(body, False)
        except BaseException as e:  # reported below: a failed request voids the row
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=run) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {clients} clients failed: {errors[0]}")
    return per * clients / (time.perf_counter() - t0)


class _Router:
    """``python -m kvcached.router serve`` over one echo engine on a known port."""

    def __init__(self, workdir: str) -> None:
        self.engine_port, self.port = free_port(), free_port()
        py = os.path.join(workdir, "echo-python")
        with open(py, "w") as f:
            f.write(f'#!/bin/sh\nexec {sys.executable} -m kvcached.bench.echo_engine "$@"\n')
        os.chmod(py, 0o700)
        cfg = {
            "port": self.port,
            "log_dir": os.path.join(workdir, "logs"),
            "health_interval_s": 0.5,
            "models": [
                {
                    "name": "echo",
                    "engine": "vllm",
                    "model": workdir,
                    "python": py,
                    "port": self.engine_port,
                    "kvcached": False,
                }
            ],
        }
        path = os.path.join(workdir, "router.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.log = open(os.path.join(workdir, "router.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcached.router", "serve", path], stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self) -> None:
        """Until a completion goes through the router (the engine is up behind it)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        body = json.dumps({"model": "echo", "prompt": "hi", "max_tokens": 1}).encode()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited ({self.proc.returncode}); see {self.log.name}")
            try:
                c = _Client(self.port)
                try:
                    c.post(body, False)
                    return
                finally:
                    c.close()
            except (OSError, RuntimeError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no answer through the router in {START_TIMEOUT_S:g} s; see {self.log.name}"
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def measure(requests: int, events: int, clients: int) -> List[Dict[str, object]]:
    rows: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-router-") as workdir:
        router = _Router(workdir)
        try:
            router.wait_ready()
            paths = (("direct", router.engine_port), ("router", router.port))
            for mode, stream, ev in (("json", False, 1), ("stream", True, events)):
                base: Dict[str, float] = {}
                for path, port in paths:
                    first, whole = _serial(port, requests, ev, stream)
                    row: Dict[str, object] = {
                        "mode": mode if not stream else f"stream x{ev}",
                        "path": path,
                        "p50_ms": statistics.median(first) * 1e3,
                        "p99_ms": _pct(first, 0.99) * 1e3,
                    }
                    if stream:
                        row["last_p50_ms"] = statistics.median(whole) * 1e3
                    if path == "direct":
                        base = {"p50": row["p50_ms"], "p99": row["p99_ms"]}  # type: ignore[dict-item]
                    else:
                        row["added_p50_ms"] = row["p50_ms"] - base["p50"]  # type: ignore[operator]
                        row["added_p99_ms"] = row["p99_ms"] - base["p99"]  # type: ignore[operator]
                    rows.append(row)
            direct_rps = None
            for path, port in paths:
                rps = _parallel(port, requests, clients)
                row = {"mode": f"parallel x{clients}", "path": path, "req_per_s": rps}
                if direct_rps:
                    row["of_direct"] = rps / direct_rps
                direct_rps = direct_rps or rps
                rows.append(row)
        finally:
            router.stop()
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcached.bench router", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000, help="requests per row (default 1000)")
    p.add_argument("--events", type=int, default=16, help="events per streamed answer (default 16)")
    p.add_argument("--clients", type=int, default=8, help="clients of the parallel rows (default 8)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("requests", "events", "clients"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    rows = measure(args.requests, args.events, args.clients)
    meta = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs), Python {platform.python_version()}",
        "engine": "kvcached.bench.echo_engine (answers at once): the difference is the router's",
        "command": "python -m kvcached.bench router " + " ".join(argv if argv is not None else sys.argv[2:]),
    }
    cols = ["mode", "path", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "last_p50_ms", "req_per_s", "of_direct"]
    print_table(rows, cols, args.json, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
