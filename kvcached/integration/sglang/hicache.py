"""Hierarchical cache seam: SGLang's ``HiCacheController`` copies join kvcached's release fence.

``--enable-hierarchical-cache`` gives SGLang a host KV pool and a controller that
copies token slots between the device pool and the host pool on its own streams,
outside the scheduler's steps (SGLang 0.5.15-0.5.23, the same controller API in
each, read from the 0.5.15 and 0.5.23 sources):

* ``write(device_indices)`` queues a device -> host backup and ``start_writing``
  submits every queued one as one merged copy, appending a ``HiCacheAck`` whose
  ``finish_event`` completes when the copy has read the device slots;
* ``load(host_indices)`` allocates device slots and ``start_loading`` submits the
  host -> device copy of every queued load, appending an ack to ``ack_load_queue``.

The radix cache (0.5.15: ``HiRadixCache.writing_check``/``loading_check``; 0.5.23:
``UnifiedRadixCache``) pops the acks once their events completed and only then
unlocks the nodes; write-back eviction synchronises its writes before it frees
the device slots. So SGLang itself never *reuses* a slot under a copy; what it
does not know is that, with kvcached, a freed slot's page may be *unmapped*
(another engine, a lowered limit), and a copy reading an unmapped page faults.
Some frees happen while a copy may still run (``reset``/``flush_cache`` clears
the ack queues without waiting; an aborted load).

So every submitted copy holds the kvcached blocks (SGLang pages) of its device
slots (``kvcached.elastic.transfers.TransferHolds``) until its ``finish_event``
has completed; a block the allocator frees meanwhile does not go back to the
manager (its page stays mapped) until then; after that the page empties as
usual and the step fence releases it. The completion is the copy's own event,
polled (``query``) before every free, at every batch result and idle turn: it
does not depend on which radix cache pops the acks. A copy that never completes
keeps its pages mapped (fail closed), named once in one error line after
``KVCACHED_TRANSFER_TIMEOUT``; a flush waits for the copies in flight before
the allocator clears.

The controller must copy through one of kvcached's elastic token/paged
allocators; hybrid pools (sliding-window, Mamba state) with the hierarchical
cache are refused at start-up (their side-pool copies are not held).
"""

from __future__ import annotations

import itertools
import logging
from types import ModuleType
from typing import Any, Callable, Dict, Hashable, List

from kvcached.config import transfer_timeout_s
from kvcached.elastic.transfers import TransferHolds
from kvcached.integration.patch_base import call_after, wrap_method

logger = logging.getLogger("kvcached.integration.sglang")

_ATTR = "_kvcached_hicache"


def event_done(event: Any) -> bool:
    """Whether a copy's finish event has completed (no event: the copy was synchronous)."""
    if event is None:
        return True
    query = getattr(event, "query", None)
    return True if query is None else bool(query())


class HiCacheFence:
    """The holds of one HiCacheController's copies on its elastic allocator's blocks."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.holds = TransferHolds(transfer_timeout_s(), name=allocator.kvcached_group.name)
        self._events: Dict[Hashable, Any] = {}  # job -> finish event, oldest first
        self._ids = itertools.count()

    @property
    def in_flight(self) -> int:
        return len(self._events)

    def begin(self, kind: str, device_indices: List[Any], finish_event: Any) -> None:
        """A copy of ``device_indices`` (token slots) was submitted; it ends with ``finish_event``."""
        blocks = blocks_of(device_indices, self.allocator.page_size)
        if not blocks:
            return
        job = (kind, next(self._ids))
        self.holds.begin(job, blocks, 1, kind)
        self._events[job] = finish_event

    def poll(self) -> List[int]:
        """Ends the holds of every copy whose event completed; returns the blocks now free
        (already handed to the manager). Names overdue copies (one error line each)."""
        if not self._events:
            return []
        free: List[int] = []
        for job in [j for j, ev in self._events.items() if event_done(ev)]:
            del self._events[job]
            free += self.holds.finished(job)
        if free:
            self.allocator.kvcached_release_held(free)
        self.holds.overdue()
        return free

    def defer(self, blocks: List[int]) -> List[int]:
        """The allocator frees ``blocks``: those free now (the rest wait for their copies)."""
        if not self._events:
            return blocks
        self.poll()
        return self.holds.defer(blocks)

    def deferred(self) -> int:
        """Blocks freed by SGLang and kept mapped for a copy in flight (free in SGLang's count)."""
        return self.holds.freed_count if self._events else 0

    def wait_all(self) -> None:
        """Before the allocator clears (flush): every copy in flight finishes first, then the
        holds are dropped (the clear gives every block back)."""
        for ev in list(self._events.values()):
            sync = getattr(ev, "synchronize", None)
            if sync is not None:
                sync()
        self._events.clear()
        self.holds = TransferHolds(self.holds.timeout_s, name=self.holds.name)


def blocks_of(device_indices: List[Any], page_size: int) -> List[int]:
    """The manager blocks (SGLang pages) of the token slots a copy reads or writes."""
    import torch

    ids = [t.reshape(-1).to(torch.int64).cpu() for t in device_indices if t is not None and t.numel()]
    return torch.unique(torch.cat(ids) // page_size).tolist() if ids else []


def wait_transfers(allocator: Any) -> None:
    """Before an allocator clears (flush): every copy in flight finishes first (its pages stay mapped)."""
    fence = getattr(allocator, "kvcached_transfers", None)
    if fence is not None:
        fence.wait_all()


def _fence_of(controller: Any) -> Any:
    return getattr(controller, _ATTR, None)


def attach(controller: Any) -> None:
    """After ``HiCacheController.__init__``: its copies hold its allocator's blocks, when that
    allocator is one of kvcached's; a hybrid pool kvcached backs is refused (start-up)."""
    if _fence_of(controller) is not None:
        return
    from kvcached.integration.sglang.conflicts import refuse
    from kvcached.integration.sglang.pool import is_elastic_pool

    alloc = getattr(controller, "mem_pool_device_allocator", None)
    kvcache = alloc.get_kvcache() if hasattr(alloc, "get_kvcache") else None
    hybrid = type(kvcache).__name__ == "HybridLinearKVPool"
    # kvcached's token/paged allocators (allocator.py) take the fence; the SWA composite has none.
    if hasattr(alloc, "kvcached_transfers") and hasattr(alloc, "kvcached_group") and not hybrid:
        fence = HiCacheFence(alloc)
        setattr(controller, _ATTR, fence)
        alloc.kvcached_transfers = fence
        logger.info(
            "kvcached: %s: hierarchical cache copies fenced: a page is unmapped only after they finish",
            alloc.kvcached_group.name,
        )
        return
    if is_elastic_pool(kvcache):
        raise refuse(
            f"--enable-hierarchical-cache with {type(alloc).__name__} (a hybrid pool): its side-pool copies "
            "are not fenced by kvcached",
            "drop --enable-hierarchical-cache",
        )


def _ops_indices(queue: Any) -> List[Any]:
    return [op.device_indices for op in list(queue or ())]


def _submitted(kind: str, queue_name: str, ack_name: str) -> Callable[[Callable], Callable]:
    def make(orig: Callable) -> Callable:
        def start(self: Any, *a: Any, **k: Any) -> Any:
            fence = _fence_of(self)
            if fence is None:
                return orig(self, *a, **k)
            fence.poll()
            indices = _ops_indices(getattr(self, queue_name, None))
            acks = getattr(self, ack_name)
            before = len(acks)
            out = orig(self, *a, **k)
            if indices and len(acks) > before:
                fence.begin(kind, indices, getattr(acks[-1], "finish_event", None))
            return out

        return start

    return make


def patch_cache_controller(module: ModuleType) -> None:
    """``HiCacheController``: each submitted write/load holds its device slots' blocks until its
    finish event completes (a hybrid controller subclass runs the same methods)."""
    cls = module.HiCacheController
    call_after(cls, "__init__", lambda self, _out, *a, **k: attach(self))
    wrap_method(cls, "start_writing", _submitted("write", "write_queue", "ack_write_queue"))
    wrap_method(cls, "start_loading", _submitted("load", "load_queue", "ack_load_queue"))


def poll_allocator(alloc: Any) -> None:
    """Scheduler hooks (batch results, idle turns): copies that finished end their holds."""
    fence = getattr(alloc, "kvcached_transfers", None)
    if fence is not None:
        fence.poll()
