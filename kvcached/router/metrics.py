"""The router's ``/metrics``: its own counters and the kvcached records, in
Prometheus text format (version 0.0.4), without a client library.

Router series (label ``model``): requests by status code, requests waiting
for an engine (queue) and in flight, the engine's state, sleeps (and those
``max_awake`` forced), wakes, wake latency (histogram, and the last wake's
seconds with the way it woke: ``engine``, ``stop``, ``kv``), restarts. kvcached series (labels ``name``, the record's
name as the exporter labels it, and, for the router's engines, ``model``):
limit, used, preallocated, mapped and virtual bytes of every valid record in
/dev/shm, as ``kvctl list`` shows them. (Not ``instance``: Prometheus sets that
label to the scrape target and would overwrite it.)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

from kvcached.router.supervisor import STATES, ModelEngine

WAKE_BUCKETS = (0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**kv: object) -> str:
    return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in kv.items()) + "}"


class RouterMetrics:
    """Counters the proxy and the transitions update (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Dict[Tuple[str, int], int] = defaultdict(int)
        self.sleeps: Dict[str, int] = defaultdict(int)
        self.wakes: Dict[str, int] = defaultdict(int)
        self.wake_failures: Dict[str, int] = defaultdict(int)
        self.wake_hist: Dict[str, List[int]] = {}
        self.wake_sum: Dict[str, float] = defaultdict(float)
        self.last_wake: Dict[str, Tuple[str, float]] = {}  # model -> (how it woke, seconds)
        self.evictions: Dict[str, int] = defaultdict(int)

    def request(self, model: str, status: int) -> None:
        with self._lock:
            self.requests[(model, status)] += 1

    def slept(self, model: str) -> None:
        with self._lock:
            self.sleeps[model] += 1

    def evicted(self, model: str) -> None:
        """``max_awake`` put ``model`` to sleep to make room for another."""
        with self._lock:
            self.evictions[model] += 1

    def woke(self, model: str, seconds: float, ok: bool, mode: str = "") -> None:
        with self._lock:
            if not ok:
                self.wake_failures[model] += 1
                return
            self.wakes[model] += 1
            self.last_wake[model] = (mode, seconds)
            self.wake_sum[model] += seconds
            h = self.wake_hist.setdefault(model, [0] * len(WAKE_BUCKETS))
            for i, b in enumerate(WAKE_BUCKETS):
                if seconds <= b:
                    h[i] += 1

    def render(self, engines: Iterable[ModelEngine], records: bool = True) -> str:
        engines = list(engines)
        out: List[str] = []

        def family(name: str, kind: str, help_: str, samples: Iterable[Tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {value:g}" for labels, value in samples)

        with self._lock:
            family(
                "kvcached_router_requests_total",
                "counter",
                "requests routed, by model and HTTP status",
                [(_labels(model=m, code=c), n) for (m, c), n in sorted(self.requests.items())],
            )
            family(
                "kvcached_router_sleeps_total",
                "counter",
                "times a model was put to sleep",
                [(_labels(model=e.name), self.sleeps[e.name]) for e in engines],
            )
            family(
                "kvcached_router_wakes_total",
                "counter",
                "times a sleeping model was woken",
                [(_labels(model=e.name), self.wakes[e.name]) for e in engines],
            )
            family(
                "kvcached_router_evictions_total",
                "counter",
                "times max_awake put a model to sleep to make room for another",
                [(_labels(model=e.name), self.evictions[e.name]) for e in engines],
            )
            family(
                "kvcached_router_last_wake_seconds",
                "gauge",
                "seconds the model's last wake took, by how it woke (engine, stop, kv)",
                [
                    (_labels(model=e.name, sleep=self.last_wake[e.name][0]), self.last_wake[e.name][1])
                    for e in engines
                    if e.name in self.last_wake
                ],
            )
            family(
                "kvcached_router_wake_failures_total",
                "counter",
                "wakes that failed (the engine is restarted)",
                [(_labels(model=e.name), self.wake_failures[e.name]) for e in engines],
            )
            hist: List[Tuple[str, float]] = []
            for e in engines:
                h = self.wake_hist.get(e.name, [0] * len(WAKE_BUCKETS))
                hist += [(_labels(model=e.name, le=f"{b:g}"), n) for b, n in zip(WAKE_BUCKETS, h)]
                hist.append((_labels(model=e.name, le="+Inf"), self.wakes[e.name]))
            out.append("# HELP kvcached_router_wake_seconds time from a wake's start until the model serves")
            out.append("# TYPE kvcached_router_wake_seconds histogram")
            out.extend(f"kvcached_router_wake_seconds_bucket{lab} {v:g}" for lab, v in hist)
            for e in engines:
                out.append(f"kvcached_router_wake_seconds_sum{_labels(model=e.name)} {self.wake_sum[e.name]:g}")
                out.append(f"kvcached_router_wake_seconds_count{_labels(model=e.name)} {self.wakes[e.name]}")
        family(
            "kvcached_router_queued",
            "gauge",
            "requests waiting for the model's engine (starting, waking, restarting)",
            [(_labels(model=e.name), e.waiting) for e in engines],
        )
        family(
            "kvcached_router_in_flight",
            "gauge",
            "requests being served by the model's engine",
            [(_labels(model=e.name), e.inflight) for e in engines],
        )
        family(
            "kvcached_router_model_state",
            "gauge",
            "1 for the state the model's engine is in",
            [(_labels(model=e.name, state=s), 1 if e.state == s else 0) for e in engines for s in STATES],
        )
        family(
            "kvcached_router_restarts_total",
            "counter",
            "engine restarts after a crash or hang",
            [(_labels(model=e.name), e.restarts) for e in engines],
        )
        if records:
            out.extend(kvcached_record_lines({e.spec.instance: e.name for e in engines if e.spec.kvcached}))
        return "\n".join(out) + "\n"


def kvcached_record_lines(models_by_instance: Dict[str, str]) -> List[str]:
    """The kvcached records (every valid one), one gauge family per field."""
    try:
        from kvcached.limits.records import list_records

        recs = [r for r in list_records() if r.valid and r.alive]
    except Exception as e:  # records unreadable: say so, do not fail the scrape
        return [f"# kvcached records unavailable: {' '.join(str(e).split())}"]
    fields = (
        ("limit", "limit_bytes", "bytes the instance may map"),
        ("used", "used_bytes", "bytes of pages holding KV blocks"),
        ("prealloc", "prealloc_bytes", "bytes mapped ahead of demand"),
        ("mapped", "mapped_bytes", "bytes mapped (used + preallocated)"),
        ("total", "virtual_bytes", "virtual KV capacity"),
    )
    out: List[str] = []
    for attr, suffix, help_ in fields:
        name = f"kvcached_instance_{suffix}"
        out.append(f"# HELP {name} {help_} (kvcached record)")
        out.append(f"# TYPE {name} gauge")
        for r in sorted(recs, key=lambda r: r.name):
            lab = _labels(name=r.name, model=models_by_instance.get(r.name, ""), device=r.device)
            out.append(f"{name}{lab} {int(getattr(r, attr))}")
    return out
