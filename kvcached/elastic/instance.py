"""ElasticInstance: the kvcached side of one engine instance, engine-neutral.

It holds the instance's pools (one per KV group), the release fence, and the
two ways memory moves between instances sharing a device budget:

* **Wants.** A step that could not place a request because the device budget
  (not the instance's own limit) is exhausted publishes the bytes it lacks in
  the instance's record (``note_shortage``; rate-limited by the limits). A step
  that placed everything it tried withdraws the want (``end_step``). A want not
  renewed for 2 s is ignored by peers (a stuck or killed owner).
* **Idle give-back.** A busy engine returns memory from its own steps. An idle
  one runs no step, yet its prefix cache may hold pages a loaded peer wants,
  or a lowered limit may not be enforced yet. ``idle_action()`` says what to
  do: nothing, shrink to the limit, or give the cache back to wanting peers.
  The engine adapter does the engine-specific part (evicting its prefix
  cache), then calls ``give_back()``. Engines whose idle loop runs no code
  start ``IdleWatcher``, which wakes every ``peer_check_s`` and at once when a
  peer's want wakes one of this instance's records.
* **The engine's own sleep.** vLLM's sleep mode and SGLang's
  ``release_memory_occupation`` drop the KV contents. Once the adapter has
  freed every block (the prefix cache too) and nothing runs, ``sleep()``
  releases every emptied page and caps every pool at 0, so nothing is mapped
  but the null blocks' pages (which an idle give-back releases too); ``wake()``
  gives the pools their limits back and pages are mapped on demand again. What
  the engine does with its weights is the engine's.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Callable, Iterator, List, Optional

from kvcached import trace
from kvcached.elastic.fence import ReleaseFence
from kvcached.elastic.pool import ElasticPool

logger = logging.getLogger("kvcached.elastic")

# How often an idle instance reads its peers' records for a want (at once when poked).
PEER_CHECK_S = 0.5
# How soon a watcher poked while its engine was busy looks again.
_POKED_RECHECK_S = 0.01
# An idle give-back's chunks after the pages peers lack: from this many pages, doubling.
GIVE_CHUNK_PAGES = 16


class IdleAction(enum.Flag):
    NONE = 0
    SHRINK_TO_LIMIT = enum.auto()  # a pool maps more than its limit
    GIVE_TO_PEERS = enum.auto()  # a peer sharing the device budget wants memory


def give_chunks(first: int, least: int) -> Iterator[int]:
    """The sizes of an idle give-back's chunks (pages, or tokens on SGLang): ``first``
    (what the wanting peers lack) or, without a want, ``least``; then doubling, at least
    ``least``. The adapter releases each chunk's budget before it evicts the next: on a
    GPU a page's unmap costs ~0.2 ms and an idle engine may cache a thousand pages, so
    the wanting engine maps within its next steps, not after the whole cache is gone."""
    size = first if first > 0 else least
    while True:
        yield size
        size = max(2 * size, least)


class ElasticInstance:
    """Pools, fence and want state of one engine instance."""

    def __init__(
        self,
        name: str,
        pools: Optional[List[ElasticPool]] = None,
        *,
        grace_s: float = 0.0,
        peer_check_s: float = PEER_CHECK_S,
    ) -> None:
        self.name = name
        self.pools: List[ElasticPool] = []
        self.fence = ReleaseFence(lambda: self.pools, grace_s=grace_s)
        self.peer_check_s = float(peer_check_s)
        # Set by wake_idle_loop() (a peer published a want, a limit was applied) and by close().
        self.poke = threading.Event()
        self._wakers: List[Callable[[], None]] = []  # engine loops asleep in a poll (add_waker)
        self.closed = False
        self.asleep = False  # between sleep() and wake()
        self._missed_in_step = False
        self._missed_at_ns = 0  # traced only (KVCACHED_TRACE): the first miss not yet followed by an allocation
        self._next_peer_check = 0.0
        self._watcher: Optional[IdleWatcher] = None
        for p in pools or ():
            self.add_pool(p)

    def add_pool(self, pool: ElasticPool) -> ElasticPool:
        self.pools.append(pool)
        if pool.limits is not None:
            pool.limits.on_peer_short = self.wake_idle_loop
            pool.limits.on_limit_applied = self.wake_idle_loop
        return pool

    def add_waker(self, wake: Callable[[], None]) -> None:
        """``wake()`` ends the poll an idle engine loop sleeps in (SGLang's ``--sleep-on-idle``),
        so its idle hooks run at once; called from any thread, it must not block."""
        self._wakers.append(wake)

    def wake_idle_loop(self) -> None:
        """Work for the idle engine arrived (a peer's want, a newly applied limit): the idle
        watcher looks at once, and an engine loop asleep in a poll wakes."""
        self.poke.set()
        for wake in self._wakers:
            wake()

    # ---- wants ------------------------------------------------------------------

    def note_shortage(self, need_tokens: int = 0) -> None:
        """A request needing ``need_tokens`` more tokens (0: one page) could not get
        memory in this step: tell peers if the budget is why."""
        self._missed_in_step = True
        if trace.ON and not self._missed_at_ns:
            self._missed_at_ns = time.monotonic_ns()
            trace.event("missed", self.name, tokens=int(need_tokens))
        for p in self.pools:
            p.note_shortage(need_tokens)

    def traced_allocation(self, blocks: int) -> None:
        """Tracing only (callers test ``trace.ON``): ``blocks`` were handed out (SGLang: 1, a
        batch launched); the first allocation after a miss is when the stalled load is admitted."""
        if self._missed_at_ns and blocks > 0:
            waited = (time.monotonic_ns() - self._missed_at_ns) / 1e6
            self._missed_at_ns = 0
            trace.event("admitted", self.name, blocks=int(blocks), waited_ms=round(waited, 3))

    def end_step(self) -> None:
        """After each step: a step without a shortage withdraws the want, so idle peers keep their cache."""
        if self._missed_in_step:
            self._missed_in_step = False
        else:
            for p in self.pools:
                p.clear_want()

    def peers_wanting(self) -> List[str]:
        names: List[str] = []
        for p in self.pools:
            names += [n for n in p.peers_wanting() if n not in names]
        return names

    # ---- idle give-back -----------------------------------------------------------

    def pages_over_limit(self) -> int:
        return sum(p.pages_over_limit() for p in self.pools)

    def idle_action(self, check_peers: bool = True, rate_limited: bool = True) -> IdleAction:
        """What an idle instance should do now. Peers' records are read at most
        every ``peer_check_s`` (unless ``rate_limited`` is False: the caller is
        the rate limit) or when a peer's want poked this instance."""
        act = IdleAction.NONE
        if self.pages_over_limit() > 0:
            act |= IdleAction.SHRINK_TO_LIMIT
        if check_peers:
            now = time.monotonic()
            if not rate_limited or now >= self._next_peer_check or self.poke.is_set():
                self._next_peer_check = now + self.peer_check_s
                self.poke.clear()
                if self.peers_wanting():
                    act |= IdleAction.GIVE_TO_PEERS
        return act

    def give_back(self) -> int:
        """Idle, after the adapter evicted what it wanted to: releases every
        emptied page and, when nothing else is left, the null block's (when no
        step is in flight), the mapped reserve and unused budget. Returns the
        pages given back."""
        t0 = trace.start()
        before = [p.mapped_pages() for p in self.pools]
        drained = self.fence.in_flight <= 0
        if drained:
            self.fence.idle()
        for p in self.pools:
            p.give_back(null_page=drained)
        returned = 0
        for p, b in zip(self.pools, before):
            n = b - p.mapped_pages()
            returned += n
            if p.limits is not None:
                p.limits.stats.gave_back(n * p.bytes_per_page)  # the record's give-back counters
        trace.end("unmapped", t0, self.name, pages=returned)
        return returned

    # ---- the engine's own sleep -----------------------------------------------------

    def mapped_bytes(self) -> int:
        return sum(p.mapped_pages() * p.bytes_per_page for p in self.pools)

    def sleep(self) -> int:
        """The engine sleeps and its KV contents are gone. Call with every block
        freed but the null blocks and no step in flight (the engine's pause and
        device synchronisation are the proof). Caps every pool at 0, releases
        every emptied page, unmaps the reserve and parked pages, and the null
        block's page too (no step runs before a wake and an allocation, which
        maps it first; ``KVCACHED_KEEP_NULL_PAGE=true`` keeps it); returns the
        bytes still mapped (pages that still hold a block). Idempotent."""
        if self.closed:
            return 0
        self.asleep = True
        for p in self.pools:
            p.sleep()  # cap 0 first: the pages released below are unmapped, not kept in the reserve
        self.fence.idle()
        for p in self.pools:
            p.manager.trim()
            p.manager.release_null_page()
            p.clear_want()
        left = self.mapped_bytes()
        logger.debug("kvcached: %s asleep, %d KiB of KV still mapped (pages holding a block)", self.name, left >> 10)
        return left

    def wake(self) -> None:
        """The engine is awake again: every pool's cap back to its limit (one
        written while asleep included); pages are mapped on demand. Idempotent."""
        if self.closed or not self.asleep:
            return
        for p in self.pools:
            p.wake()
        self.asleep = False

    def start_idle_watch(
        self, busy: Callable[[], bool], has_memory: Callable[[], bool], schedule: Callable[[IdleAction], None]
    ) -> IdleWatcher:
        """Starts a thread for engines whose idle loop runs none of our code."""
        self._watcher = IdleWatcher(self, busy, has_memory, schedule)
        self._watcher.start()
        return self._watcher

    def close(self) -> None:
        """Stops the watcher; later releases are no-ops. Records and managers are
        closed by their owners (the adapter)."""
        if self.closed:
            return
        self.closed = True
        self.fence.closed = True
        self.poke.set()


class IdleWatcher(threading.Thread):
    """Wakes every ``peer_check_s`` (or when poked); when the engine is idle,
    holds memory and ``idle_action()`` asks for something, hands the action to
    ``schedule`` (which runs it on the engine's own thread) and waits until the
    previous one ran (``done()``)."""

    def __init__(
        self,
        inst: ElasticInstance,
        busy: Callable[[], bool],
        has_memory: Callable[[], bool],
        schedule: Callable[[IdleAction], None],
    ) -> None:
        super().__init__(name=f"kvcached-idle-{inst.name}", daemon=True)
        self.inst = inst
        self.busy = busy
        self.has_memory = has_memory
        self.schedule = schedule
        self.queued = False
        self._warned = False

    def done(self) -> None:
        """The scheduled action ran (call from the engine thread)."""
        self.queued = False

    def run(self) -> None:
        inst = self.inst
        while True:
            inst.poke.wait(inst.peer_check_s)
            if inst.closed:
                return
            try:
                if self.queued or inst.asleep or self.busy() or not self.has_memory():
                    # A busy engine gives memory back from its own steps. A poke stays set
                    # (the engine may turn idle soon): look again shortly, without spinning.
                    if inst.poke.is_set():
                        time.sleep(_POKED_RECHECK_S)
                    continue
                act = inst.idle_action(rate_limited=False)  # this thread's wait is the rate limit
                if act:
                    self.queued = True
                    trace.event("idle_queued", inst.name, act=act.value)  # the hop to the engine's thread starts
                    self.schedule(act)
            except Exception as e:  # keep watching; say it once
                if not self._warned:
                    self._warned = True
                    logger.warning("kvcached: idle memory watcher of %s: %s: %s", inst.name, type(e).__name__, e)
