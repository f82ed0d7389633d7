"""ReleaseFence: physical release ordered after execution.

Execution lifetime (docs/DESIGN.md): ``cuMemUnmap`` does not wait for running
kernels, and with asynchronous / overlap scheduling step N+1 is submitted
before step N's output is processed, so a block freed now may still be read by
a submitted step. The managers therefore run with deferred release: an emptied
page stays mapped (and reusable) until ``release_retired_pages_through(marker)``
with a marker captured after it emptied.

The fence numbers steps in launch order; engines finish them in the same order
(vLLM's batch queue and SGLang's result queue are FIFO). A marker is captured
right after each step's block table is final (end of ``schedule()``, or right
after launch). When step S has finished, every step <= S is done, and step
S+1 was built from blocks that were live when it was built; so every page
emptied before S+1's marker can no longer be read: release through it. With
no step in flight, everything emptied so far can go.

``grace_s`` keeps released-eligible pages mapped a little longer while busy
(the next requests usually take them back; remapping costs far more than
keeping a page for a moment). ``idle()`` and ``after_free()`` outside a step
release at once.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Iterable, Optional, Sequence, Tuple

Markers = Tuple[int, ...]


class ReleaseFence:
    """Releases emptied pages of ``managers`` only when no launched step can read them.

    ``managers`` is a sequence of objects with ``capture_physical_release_marker()``
    and ``release_retired_pages_through(marker)`` (a ``KVCacheManager`` with
    deferred release, or an ``ElasticPool``), or a callable returning one (pools
    that appear after the fence was built).
    """

    def __init__(self, managers: Sequence[Any] | Callable[[], Sequence[Any]], grace_s: float = 0.0) -> None:
        self._managers = managers if callable(managers) else (lambda m=tuple(managers): m)
        self.grace_s = float(grace_s)
        self.launched_steps = 0
        self.finished_steps = 0
        self.depth = 0  # > 0 while inside a step's scheduling or output processing
        self.closed = False
        self._markers: Deque[Tuple[int, Markers]] = collections.deque()  # (step, markers) not yet finished
        self._safe: Deque[Tuple[float, Tuple[Any, ...], Markers]] = collections.deque()  # (since, managers, markers)
        self.released_pages = 0

    @property
    def in_flight(self) -> int:
        return self.launched_steps - self.finished_steps

    def _capture(self) -> Tuple[Tuple[Any, ...], Markers]:
        ms = tuple(self._managers())
        return ms, tuple(m.capture_physical_release_marker() for m in ms)

    def launched(self) -> int:
        """After step S's block table is final (S is about to run); returns S."""
        self.launched_steps += 1
        ms, markers = self._capture()
        self._markers.append((self.launched_steps, markers))
        if self.finished_steps == self.launched_steps - 1:
            # Nothing earlier is in flight, and S does not reference a page
            # that is empty now: what emptied so far can go.
            self._make_safe(ms, markers)
        return self.launched_steps

    def finished(self, step: Optional[int] = None) -> None:
        """Step ``step`` (default: the oldest in flight) and every earlier one finished."""
        self.finished_steps = min(
            self.launched_steps, self.finished_steps + 1 if step is None else max(step, self.finished_steps)
        )
        while self._markers and self._markers[0][0] <= self.finished_steps:
            self._markers.popleft()
        if self._markers:
            ms = tuple(self._managers())
            self._make_safe(ms, self._markers[0][1])
        else:
            self._make_safe(*self._capture())

    def settle(self) -> None:
        """After a step's output was processed: with nothing in flight, what it freed can go."""
        if self.in_flight <= 0:
            self._make_safe(*self._capture())

    def idle(self) -> int:
        """Nothing is in flight: releases every emptied page now; returns pages released."""
        self.launched_steps = self.finished_steps
        self._markers.clear()
        self._safe.clear()
        return self._release(*self._capture())

    def after_free(self) -> None:
        """After blocks were freed outside a step (abort, reset, cache trim)."""
        if self.depth == 0 and self.in_flight <= 0:
            self._release(*self._capture())

    def release_due(self, now: Optional[float] = None, grace_s: Optional[float] = None) -> int:
        """Releases what became safe at least ``grace_s`` ago (default the fence's)."""
        grace = self.grace_s if grace_s is None else grace_s
        due = (time.monotonic() if now is None else now) - grace
        n = 0
        last = None
        while self._safe and self._safe[0][0] <= due:
            last = self._safe.popleft()
        if last is not None:
            n = self._release(last[1], last[2])
        return n

    def _make_safe(self, managers: Tuple[Any, ...], markers: Markers) -> None:
        if self.grace_s <= 0:
            self._release(managers, markers)
        else:
            self._safe.append((time.monotonic(), managers, markers))
            self.release_due()

    def _release(self, managers: Iterable[Any], markers: Markers) -> int:
        if self.closed:
            return 0
        n = 0
        for m, marker in zip(managers, markers):
            n += int(m.release_retired_pages_through(marker) or 0)
        self.released_pages += n
        return n
