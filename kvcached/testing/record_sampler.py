"""Samples instance records (what ``kvctl list`` shows) on a thread, for jobs
that plot memory over time or time how fast it moves (main job, GPU proof)."""

from __future__ import annotations

import threading
import time
from typing import Dict, List, NamedTuple, Optional

from kvcached.limits.records import read_record


class Sample(NamedTuple):
    t: float  # seconds since the sampler was made
    mapped: int  # bytes the instance holds mapped (used + prealloc)
    limit: int
    wanted: int  # bytes it currently wants from its peers (0: none)


class RecordSampler(threading.Thread):
    """Every ``period`` seconds, one ``Sample`` per named instance whose record
    can be read (a missing or unreadable record is skipped, not fatal)."""

    def __init__(self, names: List[str], period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.names = list(names)
        self.period = period
        self.t0 = time.monotonic()
        self.series: Dict[str, List[Sample]] = {n: [] for n in self.names}
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            t = self.now()
            for n in self.names:
                try:
                    r = read_record(n)
                except Exception:
                    continue
                self.series[n].append(Sample(t, r.used + r.prealloc, r.limit, r.wants(2.0)))
            self._stop_evt.wait(self.period)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()

    def peak(self, name: str) -> int:
        return max((s.mapped for s in self.series[name]), default=0)

    def first_time(self, name: str, cond, after: float = 0.0) -> Optional[float]:  # type: ignore[no-untyped-def]
        """Time of the first sample of ``name`` at or after ``after`` for which ``cond(sample)``."""
        return next((s.t for s in self.series[name] if s.t >= after and cond(s)), None)
