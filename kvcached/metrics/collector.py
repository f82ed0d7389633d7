"""The ``kvcached_*`` Prometheus series, read from the shared instance records
on every scrape (kvcached.limits.records), so any process of the user (the
standalone exporter, an engine's API server) shows the same numbers as
``kvctl list --json`` without any state of its own.

Every metric and its meaning: docs/OBSERVABILITY.md.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvcached.limits.records import RecordView, list_records

# Not "instance": Prometheus sets that label to the scrape target (host:port).
INSTANCE_LABELS = ["name", "engine", "device"]
STATES = ("alive", "pending", "dead", "busy", "invalid", "damaged")

# (metric suffix, help, value of a record); the value is read only for
# records whose numbers are trusted (valid ones).
_BYTE_GAUGES: List[Tuple[str, str, Callable[[RecordView], int]]] = [
    ("limit_bytes", "KV memory limit of the instance (all layers, K and V).", lambda r: r.limit),
    ("granted_bytes", "Device-budget bytes the instance holds (0: no budget).", lambda r: r.granted),
    ("held_bytes", "Bytes counted against the device budget: max(granted, mapped); 0 when dead.", lambda r: r.held),
    ("mapped_bytes", "Physical KV memory mapped now (used + reserved).", lambda r: r.mapped),
    ("used_bytes", "Mapped bytes of pages holding KV blocks.", lambda r: r.used),
    ("reserved_bytes", "Mapped bytes of unused pages in the reserve pool (prealloc).", lambda r: r.prealloc),
    ("virtual_bytes", "Virtual KV capacity of the instance.", lambda r: r.total),
    ("quarantined_bytes", "Bytes that could not be released (failed driver call), held until exit.",
     lambda r: r.quarantined),
]  # fmt: skip


# The record's counters (version 2): (metric stem, help, record counter name).
# Every process holding the record adds to them, so they are per instance.
_COUNTERS: List[Tuple[str, str, str]] = [
    ("pages_mapped", "Pages mapped (a page spans every layer and K/V buffer).", "pages_mapped"),
    ("pages_unmapped", "Pages unmapped.", "pages_unmapped"),
    ("map_failures", "Map calls that failed (rolled back: nothing mapped).", "map_failures"),
    ("unmap_failures", "Unmap calls that failed (rolled back, or the pages quarantined).", "unmap_failures"),
    ("quarantined_pages", "Pages lost to an unmap whose rollback failed (held until exit).", "pages_quarantined"),
    ("idle_give_backs", "Give-backs that returned memory (idle, or at a peer's request).", "give_backs"),
    ("given_back_bytes", "Bytes those give-backs unmapped.", "given_back_bytes"),
]  # fmt: skip
_REFUSALS = (("limit", "refused_limit"), ("budget", "refused_budget"))
_HISTOGRAMS: List[Tuple[str, str]] = [
    ("map_seconds", "Duration of one map call (a batch of pages, every layer and rank), successful ones."),
    ("unmap_seconds", "Duration of one unmap call, successful ones."),
    ("want_served_seconds", "From a want's publication (the device budget stopped the load) to its withdrawal "
     "(the load got its memory: peers gave back, or it ended)."),
]  # fmt: skip


def _current_want(r: RecordView, now_ns: int) -> int:
    from kvcached.limits.budget import WANT_TTL_S

    return r.wants(WANT_TTL_S, now_ns)


class KvcachedCollector(Collector):
    """A prometheus_client collector over the records of this user.

    ``select``: which instance names to show (None: every record). Device
    totals always cover every live, valid record of this user on the device
    (the device budget is shared by all of them), ``prefix`` narrows both to
    names starting with it (a budget scope).
    """

    def __init__(self, select: Optional[Callable[[str], bool]] = None, prefix: str = "", guarded: bool = False) -> None:
        """``guarded``: a failing collection yields nothing (logged once) instead of
        raising, for registries that also serve an engine's own series."""
        self._select = select
        self._prefix = prefix
        self._guarded = guarded
        self._warned = False
        self._stats_warned: set = set()  # (name, problem) logged once

    def _records(self) -> List[RecordView]:
        return [r for r in list_records() if r.name.startswith(self._prefix)]

    def collect(self) -> Iterator[Metric]:
        if not self._guarded:
            yield from self._collect()
            return
        # In an engine's /metrics: a failure here must not fail the engine's own series.
        try:
            families = list(self._collect())
        except Exception as e:  # noqa: BLE001 - logged once; the scrape goes on without ours
            if not self._warned:
                self._warned = True
                logging.getLogger(__name__).warning("kvcached: metrics not collected (%s: %s)", type(e).__name__, e)
            return
        yield from families

    def _collect(self) -> Iterator[Metric]:
        now = time.time_ns()
        uid = os.geteuid()
        records = self._records()
        shown = [r for r in records if self._select is None or self._select(r.name)]
        trusted = [r for r in shown if r.valid]

        def family(suffix: str, doc: str, recs: Iterable[RecordView], value: Callable[[RecordView], float]):
            g = GaugeMetricFamily(f"kvcached_{suffix}", doc, labels=INSTANCE_LABELS)
            for r in recs:
                g.add_metric([r.name, r.engine, r.device], float(value(r)))
            return g

        for suffix, doc, value in _BYTE_GAUGES:
            yield family(suffix, doc, trusted, value)
        yield family(
            "wanted_bytes",
            "Bytes the instance's load lacks because the device budget stops it (a current want; 0: none).",
            trusted,
            lambda r: _current_want(r, now),
        )
        yield family(
            "wanted_timestamp_seconds",
            "Unix time of the instance's last want renewal (0: never wanted).",
            trusted,
            lambda r: r.wanted_ns / 1e9 if r.wanted > 0 else 0.0,
        )
        yield family(
            "limit_pending",
            "1 while the owner has not yet enforced the latest limit write.",
            trusted,
            lambda r: 1 if r.pending else 0,
        )
        yield family("limit_revision", "Revision of the limit (bumped by every limit write).", trusted,
                     lambda r: r.revision)  # fmt: skip
        yield family("record_updated_timestamp_seconds", "Unix time of the owner's last usage update.", trusted,
                     lambda r: r.updated_ns / 1e9)  # fmt: skip

        state = GaugeMetricFamily(
            "kvcached_instance_state",
            "1 for the record's current state (alive, pending, dead, busy, invalid), 0 for the others.",
            labels=INSTANCE_LABELS + ["state"],
        )
        for r in shown:
            for s in STATES:
                state.add_metric([r.name, r.engine, r.device, s], 1.0 if r.state == s else 0.0)
        yield state

        wakes = CounterMetricFamily(
            "kvcached_give_back_requests",
            "Times a peer short of device budget woke this instance to give unused memory back.",
            labels=INSTANCE_LABELS,
        )
        for r in trusted:
            if r.alive:
                n = _wake_count(r.name)
                if n is not None:
                    wakes.add_metric([r.name, r.engine, r.device], float(n))
        yield wakes

        yield from self._stats_families(trusted)
        yield from _device_families(records, uid, now)

    def _stats_families(self, trusted: List[RecordView]) -> Iterator[Metric]:
        """The record statistics (version-2 records); a block that fails its
        checks shows as ``kvcached_stats_valid`` 0 and is logged once."""
        valid = GaugeMetricFamily(
            "kvcached_stats_valid",
            "1: the record's statistics block passed its checks; 0: it did not (see kvctl list); "
            "absent: a version-1 record (an older kvcached) has none.",
            labels=INSTANCE_LABELS,
        )
        with_stats = []
        for r in trusted:
            if r.stats_problem:
                valid.add_metric([r.name, r.engine, r.device], 0.0)
                if (r.name, r.stats_problem) not in self._stats_warned:
                    self._stats_warned.add((r.name, r.stats_problem))
                    logging.getLogger(__name__).warning("kvcached: record %s: %s", r.name, r.stats_problem)
            elif r.counters:
                valid.add_metric([r.name, r.engine, r.device], 1.0)
                with_stats.append(r)
        yield valid
        for stem, doc, key in _COUNTERS:
            c = CounterMetricFamily(f"kvcached_{stem}", doc, labels=INSTANCE_LABELS)
            for r in with_stats:
                c.add_metric([r.name, r.engine, r.device], float(r.counters.get(key, 0)))
            yield c
        refused = CounterMetricFamily(
            "kvcached_refused_allocations",
            "Requests the engine could not place, by cause: the instance's own limit, or the device budget "
            "(preemptions and waits kvcached caused).",
            labels=INSTANCE_LABELS + ["reason"],
        )
        for r in with_stats:
            for reason, key in _REFUSALS:
                refused.add_metric([r.name, r.engine, r.device, reason], float(r.counters.get(key, 0)))
        yield refused
        for stem, doc in _HISTOGRAMS:
            h = HistogramMetricFamily(f"kvcached_{stem}", doc, labels=INSTANCE_LABELS)
            for r in with_stats:
                v = r.histograms.get(stem)
                if v is None:
                    continue
                les = [floatToGoString(b) for b in v.bounds_s] + ["+Inf"]
                h.add_metric([r.name, r.engine, r.device], list(zip(les, map(float, v.buckets))), v.sum_s)
            yield h


def _wake_count(name: str) -> Optional[int]:
    from kvcached import _C

    try:
        return int(_C.MemInfoTracker.open(name).wake_count())
    except _C.KvcachedError:
        return None  # removed meanwhile


# The per-device gauges: kvcached_device_<key>, and their help.
_DEVICE_GAUGES: Dict[str, str] = {
    "budget_bytes": "Usable bytes of the device as its instances' owners computed them (KVCACHED_GPU_UTILIZATION).",
    "held_bytes": "Bytes all instances hold on the device.",
    "mapped_bytes": "Bytes all instances map on the device.",
    "free_bytes": "Budget bytes no instance holds (budget - held; < 0 after the budget was lowered).",
    "wanted_bytes": "Bytes instances want and cannot get.",
    "instances": "Live instances on the device.",
}


def _device_families(records: List[RecordView], uid: int, now_ns: int) -> Iterator[Metric]:
    """Per-device sums over the live, valid records of this user (the budget's members)."""
    members: Dict[str, List[RecordView]] = {}
    for r in records:
        if r.alive and r.valid and r.owner_uid == uid:
            members.setdefault(r.device, []).append(r)
    fams = {
        key: GaugeMetricFamily(f"kvcached_device_{key}", doc, labels=["device"]) for key, doc in _DEVICE_GAUGES.items()
    }
    for dev, recs in sorted(members.items()):
        held = sum(r.held for r in recs)
        budget = max(r.device_bytes for r in recs)
        if budget > 0:
            fams["budget_bytes"].add_metric([dev], float(budget))
            fams["free_bytes"].add_metric([dev], float(budget - held))
        fams["held_bytes"].add_metric([dev], float(held))
        fams["mapped_bytes"].add_metric([dev], float(sum(r.mapped for r in recs)))
        fams["wanted_bytes"].add_metric([dev], float(sum(_current_want(r, now_ns) for r in recs)))
        fams["instances"].add_metric([dev], float(len(recs)))
    yield from fams.values()
