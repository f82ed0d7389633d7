"""Time kvcached spends on SGLang's scheduler thread, step by step.

Everything kvcached does for SGLang (allocations that map pages, the release fence and the
prefix-cache bound in the scheduler hooks) runs on the scheduler thread, between GPU steps:
time spent there delays every running request's next token and every waiting request's
first one. This module adds it up per step (from one processed batch result to the next)
and says so when a step spent more than ``SLOW_S`` inside kvcached: one log line at most
every ``LOG_EVERY_S`` with how many such steps there were and what the worst one did. The
totals are in ``kvcached_report`` (``scheduler_hooks.report``).

Single-threaded by construction (the scheduler thread); no locking.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import contextmanager
from typing import Dict, Iterator

logger = logging.getLogger("kvcached.integration.sglang")

SLOW_S = 0.05
LOG_EVERY_S = 10.0


class StepTimer:
    """Seconds inside kvcached, by part, for the step under way and in total."""

    def __init__(self) -> None:
        self.step: Counter = Counter()  # part -> seconds, this step
        self.total: Counter = Counter()  # part -> seconds, since start
        self.steps = 0
        self.slow_steps = 0
        self.worst_s = 0.0
        self._unlogged = 0
        self._worst_unlogged: Dict[str, float] = {}
        self._next_log = 0.0

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.step[name] += time.perf_counter() - t0

    def end_step(self) -> None:
        """A batch result was processed: closes the step's account."""
        spent = sum(self.step.values())
        self.total.update(self.step)
        self.steps += 1
        self.worst_s = max(self.worst_s, spent)
        if spent > SLOW_S:
            self.slow_steps += 1
            self._unlogged += 1
            if spent > sum(self._worst_unlogged.values()):
                self._worst_unlogged = dict(self.step)
        self.step.clear()
        now = time.monotonic()
        if self._unlogged and now >= self._next_log:
            worst = self._worst_unlogged
            parts = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sorted(worst.items(), key=lambda kv: -kv[1]))
            logger.warning(
                "kvcached: %d scheduler step(s) spent over %.0f ms inside kvcached (worst %.0f ms: %s)",
                self._unlogged,
                SLOW_S * 1000,
                sum(worst.values()) * 1000,
                parts,
            )
            self._unlogged, self._worst_unlogged, self._next_log = 0, {}, now + LOG_EVERY_S

    def stats(self) -> Dict[str, float]:
        out: Dict[str, float] = {f"{k}_s": round(v, 6) for k, v in self.total.items()}
        out.update(steps=self.steps, slow_steps=self.slow_steps, worst_step_s=round(self.worst_s, 6))
        return out


_timer = StepTimer()


def step_timer() -> StepTimer:
    """This scheduler process's timer."""
    return _timer
