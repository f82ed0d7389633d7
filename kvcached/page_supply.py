"""PageSupply: where the fresh pages of a BlockManager come from.

It builds the group's C++ ``PageAllocator`` (the mapped reserve's bounds from
``KVCACHED_MIN/MAX_RESERVED_PAGES``, pre-mapping where this process maps),
holds the pool's limits (the ``InstanceLimits`` whose device budget admits
every fresh page) and answers two questions for the manager:

* ``acquire(n)``: fresh pages for ``n`` blocks, all or none; the budget admits
  them before the allocator maps them, and a failure anywhere returns the
  pages taken so far (``OutOfMemoryError`` when memory is short).
* ``mappable_pages(version)``: how many pages an allocation could get now
  (the reserve, the resize target, the limit, the device's free memory). The
  answer is reused until this supply maps (``changed()``), the caller's
  release ``version`` moves, or ``KVCACHED_CAPACITY_TTL_MS`` passes: it is
  asked on every scheduling step, and asking the data plane costs a call.

It also keeps the manager's count for ``available_size`` (``rest``: reserved
blocks plus blocks on mappable pages, -1 when it must be counted again), which
the manager reads without its lock or a clock. Why that is as fresh as the
TTL'd reading it replaces:

* every change made in this process clears it before the manager's lock is
  released: a map (``acquire``), a released page (``changed()``, called by
  ``PageRelease.release``), a cap, target, trim or wake (``changed()``), and
  the reserved blocks and the null block (``recount()``);
* a cap moved by the limits' watcher thread (a limit written by ``kvctl
  limit``, a grant given to a peer) clears it there (``on_cap_change``);
* what changes elsewhere (peers' budget; the device's free memory; the
  pre-mapping thread's reserve) is seen within the TTL, as before: ``keep()``
  arms a ``GraceTimer`` thread that clears ``rest`` one TTL later (plus the
  wait for the GIL), and goes idle when no count was kept in a whole TTL, so
  an idle engine wakes nothing. The timer's last act on each tick is the
  store of -1, so a count kept before it is cleared by it, and one kept
  after it sees the timer's idle state of that tick (``keep()`` wakes an
  idle timer): no count outlives a TTL by more than one tick's wait;
* a forked child drops the count it inherited (``os.register_at_fork``) and
  ``keep()`` starts its own timer thread there.

While the instance wants memory (its load lacks what the device budget could
not give), no count is kept and no reading reused: a peer's give-back is admitted
by the next step, not a TTL later.

``KVCACHED_CAPACITY_TTL_MS=0`` keeps no count: every call counts anew.

The manager's emptied pages go the other way (``page_release.py``). Every
method runs under the manager's lock, except ``_expire`` (the timer thread's)
and ``changed`` when the limits call it (two stores, as ``_expire`` makes).
"""

from __future__ import annotations

import math
import os
import time
import weakref
from typing import Any, Callable, List, Optional

from kvcached import _C, config, trace
from kvcached.block_geometry import BlockGeometry
from kvcached.errors import InvalidArgumentError, OutOfMemoryError
from kvcached.manager_setup import Mapper, reserve_bounds
from kvcached.page_release import GraceTimer

# Supplies that keep a count: a forked child counts again (the parent's timer
# thread, which would clear the count it inherited, does not run there).
_keeping: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for supply in list(_keeping):
        supply.rest = -1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class PageSupply:
    """The PageAllocator of one KV group, its limits and its fresh-page capacity.

    ``allocator`` maps through ``mapper`` (None: this process's data plane,
    ``local``), ``num_layers`` x ``num_kv_buffers`` buffers of ``mem_size``
    bytes in ``geometry``'s pages on ``device``.
    """

    def __init__(
        self,
        geometry: BlockGeometry,
        mem_size: int,
        num_layers: int,
        num_kv_buffers: int,
        group_id: int,
        mapper: Optional[Mapper],
        device: Optional[str],
    ) -> None:
        self.local = mapper is None
        self._device = device
        min_res, max_res = reserve_bounds()
        # Pre-mapping starts only after the null block took page 0 (the free set
        # hands out the lowest id first; a pre-mapped reserve would not).
        self.want_prealloc = self.local and config.page_prealloc_enabled() and min_res > 0
        self.allocator = _C.PageAllocator(
            num_layers, mem_size, geometry.page_size, num_kv_buffers, group_id, min_res, max_res, False,
            None if mapper is None else mapper.map, None if mapper is None else mapper.unmap,
        )  # fmt: skip
        self.bytes_per_page = self.allocator.bytes_per_page
        self.per_page = geometry.max_blocks_per_page
        self.limits: Any = None
        self._ttl = config.capacity_ttl_s()
        self._stamp = -math.inf
        self._version = 0
        self._pages = 0
        # available_size's count (see the module doc); -1: count again.
        self.rest = -1
        self.closed = False
        self._kept = False  # a count was kept since the timer's last tick
        self._woken = -math.inf  # when keep() last woke the timer
        self._expiry = GraceTimer(self._expire, self._ttl, f"kvcached-capacity-g{group_id}") if self._ttl > 0 else None
        if self._expiry is not None:
            _keeping.add(self)

    def attach_limits(self, factory: Callable[[Any], Any]) -> Any:
        """Builds the pool's limits with ``factory(allocator)`` (before anything is mapped); returns them."""
        self.limits = factory(self.allocator)
        # A limit written by kvctl or a grant moved by a peer is applied on the limits'
        # watcher thread: it clears the kept count at once, not one TTL later.
        self.limits.on_cap_change = self.changed
        return self.limits

    def take(self, n_pages: int) -> List[int]:
        """``n_pages`` fresh page ids, admitted by the budget first; OutOfMemoryError when short."""
        if self.limits is not None:
            self.limits.admit_pages(n_pages)  # device budget; OutOfMemoryError when short
        t0 = trace.start()
        pids = self.allocator.alloc_pages(n_pages)
        if t0:  # pages from the mapped reserve cost no map: say how many were fresh
            trace.end("map", t0, self.limits.name if self.limits is not None else "", pages=len(pids))
        return pids

    def take_page_zero(self, strict: bool = True) -> bool:
        """Page 0, the null block's: True when taken, False when memory is short (ask again later).
        Another page handed out instead is given back; ``strict``: then InvalidArgumentError
        (at the start nothing else can hold page 0), else False (a reserve page whose unmap
        was rolled back came first: the next try trims it again)."""
        try:
            pids = self.take(1)
        except OutOfMemoryError:
            return False
        if pids[0] != 0:
            self.allocator.free_pages(pids)
            if not strict:
                return False
            raise InvalidArgumentError(f"the null block needs page 0 first, but the page allocator gave page {pids[0]}")
        return True

    def acquire(self, need_blocks: int, caps: List[int]) -> List[int]:
        """Maps enough fresh pages for ``need_blocks`` blocks (``caps``: blocks per page id), all or none."""
        pids: List[int] = []
        got = 0
        self._stamp = -math.inf
        self.rest = -1
        try:
            while got < need_blocks:
                new = self.take(-(-(need_blocks - got) // self.per_page))
                pids.extend(new)
                for pid in new:
                    got += caps[pid]
        except BaseException:
            if pids:
                self.allocator.free_pages(pids)  # still empty: back to the reserve (or unmapped) as after a free
            raise
        return pids

    def changed(self) -> None:
        """What can be mapped changed here (a map, a release, a cap, a target): the next count asks the data plane."""
        self._stamp = -math.inf
        self.rest = -1

    def recount(self) -> None:
        """What ``rest`` counts changed on the manager's side (reserved blocks, the null block)."""
        self.rest = -1

    def keep(self, rest: int) -> None:
        """The manager's count, for its lock-free ``available_size`` until a change or the TTL clears it."""
        timer = self._expiry
        if timer is None or self.closed or self._wanting():
            return  # wanting: each step counts anew, so a peer's give-back is admitted at once
        self.rest = rest
        self._kept = True
        if timer.asleep():  # also in a forked child, where the parent's timer thread does not run
            self._woken = time.monotonic()
            timer.wake()

    def _expire(self) -> Optional[bool]:
        """The timer's tick (its thread, no lock; see the module doc for the order); None once closed."""
        if self.closed:
            return None
        if time.monotonic() - self._woken < 0.5 * self._ttl:
            return True  # the tick of the wake-up itself: the count is fresh, the next tick is a TTL away
        if not self._kept:
            self._expiry.idle = True  # type: ignore[union-attr]
        self._kept = False
        self._stamp = -math.inf  # the next count reads the data plane, not a reading of before this tick
        self.rest = -1
        return True

    def close(self) -> None:
        """Under the manager's lock at shutdown: no count is kept any more."""
        self.closed = True
        self.rest = -1

    def stop(self) -> None:
        """Ends the timer thread (call without the manager's lock)."""
        if self._expiry is not None:
            self._expiry.stop()

    def mappable_pages(self, version: int) -> int:
        """Pages an allocation could get from the data plane now: reserve, target, limit, device."""
        now = time.monotonic()
        if now - self._stamp <= self._ttl and self._version == version and not self._wanting():
            return self._pages
        self._version = version
        pa = self.allocator
        pages = self.limits.num_free_pages() if self.limits is not None else pa.get_num_free_pages()
        if self.local and pages:
            reserved = pa.get_num_reserved_pages()
            fresh = pages - reserved
            if fresh > 0:
                pages = reserved + min(fresh, self.device_free_pages())
        self._stamp, self._pages = now, pages
        return pages

    def _wanting(self) -> bool:
        return self.limits is not None and self.limits.wanting

    def device_free_pages(self) -> int:
        """Pages the device's free memory could hold now (this process maps)."""
        return int(_C.backend_info(self._device)["free_bytes"]) // self.bytes_per_page
