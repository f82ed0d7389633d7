"""PageRelease: what becomes of a page of a BlockManager whose last block was freed.

One of three things, decided in ``emptied()``:

* retired (``defer_physical_release``): the page stays held, mapped and
  reusable until ``release_through(marker)`` with a marker captured after it
  emptied (``capture_marker()``): the engine's proof that no queued batch can
  still read it. A retired page reused since is kept; if it empties again it
  waits for a later marker.
* parked (otherwise, while fewer than ``max_parked`` pages are parked and the
  allocator is not over its cap): the page stays held for a grace, so a lone
  request that frees its only block and allocates again reuses it without a
  C++ call. ``GraceTimer`` (below) ends the grace one to two ``grace_s`` later
  also when no call comes; ``release_parked()`` ends it at once (``trim()``,
  idle give-back), and so does ``reclaim()`` (a limit lowered below what is
  mapped, a peer short of budget), which also stops parking while the
  allocator maps more than its cap.
* released: unshelved from the index, handed to ``PageAllocator.free_pages``
  (into the mapped reserve while it is below its cap, else unmapped) after the
  release barrier (e.g. a device sync), then ``limits.on_free()``.

Every method runs under the manager's lock except the GraceTimer thread's
loop, which takes it in ``tick()``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from kvcached.block_index import BlockIndex, Page
from kvcached.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class GraceTimer:
    """A daemon thread calling ``tick()`` every ``period_s`` while pages are parked
    (``PageSupply`` runs one too, to expire the manager's capacity count).

    Nothing on the alloc/free path reads a clock: the thread counts ticks, and
    a page parked at tick ``t`` is released at tick ``t + 2``. ``tick()`` itself
    reads the clock and counts no tick sooner than 0.9 periods after the last,
    so an early wake-up (a wake() racing the wait) cannot shorten the grace.
    The thread runs
    only while pages are parked: ``tick()`` sets ``idle`` under the manager lock
    when nothing is left, so a page parked later (also under the lock) sees it
    and calls ``wake()``; no wake-up is lost. It holds its owner through a weak
    reference and ends at ``stop()`` or when ``tick()`` returns None.
    """

    def __init__(self, tick: Callable[[], Optional[bool]], period_s: float, name: str) -> None:
        self.period_s = float(period_s)
        self.name = name
        self.idle = True  # the thread sleeps without a timeout (or is not started)
        self._event = threading.Event()
        # Its owner gone, an idle thread wakes and ends (it would wait forever otherwise).
        self._tick = weakref.WeakMethod(tick, lambda _ref, ev=self._event: ev.set())
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def wake(self) -> None:
        """A page was parked while idle: start ticking (call under the manager lock)."""
        self.idle = False
        self._event.set()
        if self._thread is None or not self._thread.is_alive():  # first park, or a forked child
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def asleep(self) -> bool:
        """Idle, or no thread (never started, or this is a forked child): ``wake()`` is due."""
        t = self._thread
        return self.idle or t is None or not t.is_alive()

    def stop(self) -> None:
        """Ends the thread and waits for it (call without the manager lock)."""
        self._stopping = True
        self._event.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def _run(self) -> None:
        ev = self._event
        while not self._stopping:
            ev.clear()  # a wake() from here on ends the wait below at once
            tick = self._tick()
            if tick is None:
                return
            try:
                if tick() is None:
                    return
            except Exception:  # keep the grace running: parked pages must still go
                logger.exception("kvcached: releasing parked pages failed (%s)", self.name)
            del tick  # no strong reference to the owner while sleeping
            ev.wait(None if self.idle else self.period_s)


class PageRelease:
    """Retires, parks or releases emptied pages of one manager (see the module doc).

    Args:
        index: the manager's BlockIndex.
        page_allocator: the manager's ``_C.PageAllocator``.
        lock: the manager's lock (taken by the grace thread only).
        defer: retire emptied pages until a release marker.
        grace_s: the parking grace; 0 (or ``defer``) disables parking.
        max_parked: at most this many pages parked at a time.
        barrier: called before pages are handed back, or None.
        name: for the grace thread's name.
    """

    def __init__(
        self,
        index: BlockIndex,
        page_allocator: Any,
        lock: threading.Lock,
        *,
        defer: bool,
        grace_s: float,
        max_parked: int,
        barrier: Optional[Callable[[], None]],
        name: str,
    ) -> None:
        self._index = index
        self._pa = page_allocator
        self._lock = lock
        self._defer = defer
        self._barrier = barrier
        self.limits: Any = None  # the manager's InstanceLimits, set once built
        self.on_release: Optional[Callable[[], None]] = None  # called after pages are dropped
        self.closed = False
        self.version = 0  # bumped on every release (the manager's capacity cache watches it)
        # Deferred release: pages retired at epoch E wait for a marker >= E.
        self.epoch = 0
        self.retired: Dict[int, int] = {}
        self._retired_q: Deque[Tuple[int, int]] = deque()
        # Parked pages: pid -> grace tick at which it (last) emptied; may hold
        # pages reused since (forgotten by _still_parked).
        self.parked: Dict[int, int] = {}
        self.max_parked = 0 if defer or grace_s <= 0 else int(max_parked)
        self._blocked = False  # over the allocator's cap: park nothing until back under
        self._tick_no = 0
        self._grace_s = float(grace_s)
        self._last_tick = -math.inf
        self._timer = GraceTimer(self.tick, grace_s, f"kvcached-grace-{name}")

    # ------------------------------------------------------------- emptied

    def emptied_one(self, page: Page) -> None:
        """The free fast path's emptied page (one dict store when it is parked)."""
        if page.open and len(self.parked) < self.max_parked and not self._blocked:
            self.parked[page.pid] = self._tick_no
            if self._timer.idle:
                self._timer.wake()
        else:
            self.emptied([page])

    def emptied(self, pages: List[Page]) -> None:
        """Pages whose last block was just freed: retired, parked or released."""
        if self._defer:
            e = self.epoch
            for page in pages:
                self.retired[page.pid] = e
                self._retired_q.append((e, page.pid))
            return
        if self._blocked and not self.over_cap():
            self._blocked = False
        release = []
        parked = self.parked
        for page in pages:
            if page.open and not self._blocked and (page.pid in parked or len(parked) < self.max_parked):
                parked[page.pid] = self._tick_no
                if self._timer.idle:
                    self._timer.wake()
            else:
                release.append(page)
        self.release(release)

    def release(self, pages: List[Page]) -> None:
        """Hands empty pages back to the page allocator (reserve, else unmap)."""
        if not pages:
            return
        for page in pages:
            self._index.unshelve(page)
            self.retired.pop(page.pid, None)
            self.parked.pop(page.pid, None)
        pids = self._index.drop(pages)
        self.version += 1
        if self.on_release is not None:
            self.on_release()  # the manager's capacity count (PageSupply.changed)
        if self._barrier is not None:
            self._barrier()  # e.g. queued kernels may still read these pages
        self._pa.free_pages(pids)
        if self.limits is not None:
            self.limits.on_free()  # gives unused device budget back to peers

    # ------------------------------------------------------------- parking

    def _still_parked(self) -> List[Page]:
        """Parked pages that are still empty (reused ones are forgotten)."""
        held = self._index.held
        out = []
        for pid in list(self.parked):
            page = held.get(pid)
            if page is None or len(page) != page.cap or not page.open:
                del self.parked[pid]
            else:
                out.append(page)
        return out

    def parked_pids(self) -> List[int]:
        """The pages parked now (entries of pages reused since are skipped, not dropped)."""
        held = self._index.held
        return sorted(pid for pid in self.parked if len(held[pid]) == held[pid].cap)

    def tick(self) -> Optional[bool]:
        """The grace thread's tick: releases pages parked two ticks ago; None once closed."""
        with self._lock:
            if self.closed:
                return None
            now = time.monotonic()
            if now - self._last_tick >= 0.9 * self._grace_s:  # else an early wake-up: no tick
                self._last_tick = now
                self._tick_no += 1
                due = self._tick_no - 2
                self.release([p for p in self._still_parked() if self.parked[p.pid] <= due])
            if not self.parked:
                self._timer.idle = True  # under the lock: a later park wakes the timer
            return True

    def release_parked(self) -> int:
        """Releases every parked page now; returns how many."""
        pages = self._still_parked()
        self.release(pages)
        return len(pages)

    def over_cap(self) -> bool:
        """The allocator maps more than its cap (a lowered limit not yet reached)."""
        cap = self._pa.mem_limit()
        return 0 <= cap < self._pa.get_num_mapped_pages() * self._pa.bytes_per_page

    def reclaim(self) -> int:
        """Mapped pages without a block are wanted now: parked ones go, and none
        is parked while the allocator is over its cap. Returns how many went."""
        self._blocked = self.over_cap()
        return self.release_parked()

    def stop(self) -> None:
        """Forgets every page (the manager frees them) and ends the grace thread; call without the lock."""
        self._timer.stop()

    def close(self) -> None:
        """Under the lock at shutdown: nothing is retired or parked any more."""
        self.closed = True
        self.retired.clear()
        self._retired_q.clear()
        self.parked.clear()

    # ----------------------------------------------------- deferred release

    def capture_marker(self) -> int:
        marker = self.epoch
        self.epoch += 1
        return marker

    def release_through(self, marker: int) -> int:
        if marker >= self.epoch:
            raise InvalidArgumentError(
                f"marker {marker} was not captured yet (next is {self.epoch}); "
                "use the value returned by capture_physical_release_marker()"
            )
        q = self._retired_q
        ready = []
        while q and q[0][0] <= marker:
            e, pid = q.popleft()
            if self.retired.get(pid) != e:
                continue  # reused and emptied again later: a newer entry covers it
            page = self._index.held[pid]
            del self.retired[pid]
            if len(page) == page.cap:
                ready.append(page)
        self.release(ready)
        return len(ready)

    def may_keep_empty(self, pid: int) -> bool:
        """An empty held page is allowed: retired (waiting for a marker) or parked."""
        return pid in self.retired or pid in self.parked
