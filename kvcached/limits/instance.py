"""InstanceLimits: the owner side of one instance's record.

It creates the record of one KV group (``kvctl list`` shows it), attaches it to
the group's PageAllocator (which then publishes used/prealloc bytes after every
change), and runs a watcher thread that sleeps in a futex wait on the record's
revision. When ``kvctl limit`` (or ``kvcached.control``) writes a limit, the
watcher wakes at once and applies it:

  grow    the PageAllocator's cap rises at once (within the device budget);
  shrink  the cap drops at once, so no new page is mapped past it; unused
          mapped pages (the reserve) are unmapped at once; pages holding live
          blocks are unmapped only when the manager frees them (gradual).

While the engine sleeps (``set_asleep(True)``: vLLM's sleep mode, SGLang's
``release_memory_occupation``) the cap is 0 whatever the limit: nothing new is
mapped, the reserve goes, unused budget goes back to the device. A limit
written meanwhile is recorded and takes effect at the wake.

InstanceLimits is the only caller of ``PageAllocator.set_mem_limit`` for the
allocator it is attached to; the cap it sets is ``min(limit, grant)`` where the
grant is this instance's share of the device budget (see ``budget.py``).

Why this module is long: limit, grant, cap and want of one record form one
state machine under one lock (the watcher, the budget gate and the shortage
path all change it); split, that lock would be shared across modules. What
only counts (the record's statistics) lives in ``record_stats.py``.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Union

from kvcached import _C, trace
from kvcached.errors import InvalidArgumentError, OutOfMemoryError
from kvcached.limits.budget import DeviceBudget
from kvcached.limits.owned_record import create_record, record_trusted
from kvcached.limits.record_stats import REFUSED_BUDGET, REFUSED_LIMIT, RecordStats
from kvcached.limits.records import RecordView, parse_device
from kvcached.naming import group_name as group_record_name
from kvcached.naming import instance_name, validate_name
from kvcached.units import format_size

logger = logging.getLogger(__name__)

FROM_ENV = "env"
# The watcher is woken by every limit write and by close(); this timeout only
# bounds how long unused budget stays held by an idle instance.
_IDLE_WAKE_MS = 10_000

# How long a sum of what the other instances hold may be reused by
# num_free_pages(): it is called on every scheduling step and reads every record
# (not reused while this instance wants memory: the sum falls when a peer gives back).
_PEER_SUM_TTL_S = 0.05

# At most one log line per this many seconds for the give-backs peers ask for.
_GIVE_BACK_LOG_S = 10.0

# How often note_shortage() may read the budget; in between it repeats its
# last answer (it is called on every allocation miss of a scheduling step).
_SHORTAGE_CHECK_S = 0.25

# Instances owned by this process, for kvcached.control's default target.
_live: weakref.WeakValueDictionary[str, InstanceLimits] = weakref.WeakValueDictionary()


def owned_instances() -> Dict[str, InstanceLimits]:
    """Records this process owns and has not closed, by name."""
    return dict(_live)


class InstanceLimits:
    """Owns the record of one instance (one KV group) and enforces its limit.

    Life cycle: construct (creates the record; a dead owner's record of the
    same name is reclaimed, a live one refused) -> ``attach(pa)`` (publishes
    usage, applies the limit, starts the watcher) -> the manager calls
    ``admit_pages(n)`` before ``pa.alloc_pages(n)`` -> ``close()`` (or process
    exit) stops the watcher and unlinks the record.

    Args:
        engine: ``vllm``/``sglang``/any short tag shown by kvctl.
        device: ``cpu``, ``cuda:N`` or ``hip:N`` (the device the pages live on).
        total_bytes: virtual capacity of the group over all layers and K/V.
        name: record name of the instance; default ``KVCACHED_IPC_NAME`` or
            ``kvcached_<engine>_<pgid>``. Group ``g > 0`` gets ``<name>_g<g>``.
        group_id: the KV group this record covers.
        limit_bytes: initial limit; default the smaller of ``total_bytes`` and
            the device budget.
        budget: a DeviceBudget, ``"env"`` (default: from the environment) or
            None (no device budget: only this instance's limit caps it).
        quantum_bytes: how much budget to take at a time beyond the immediate
            need (so the reserve pool can pre-map); default 1/64 of the budget,
            at least one page.
    """

    def __init__(
        self,
        *,
        engine: str,
        device: str,
        total_bytes: int,
        name: Optional[str] = None,
        group_id: int = 0,
        limit_bytes: Optional[int] = None,
        budget: Union[DeviceBudget, str, None] = FROM_ENV,
        quantum_bytes: Optional[int] = None,
    ) -> None:
        if total_bytes <= 0:
            raise InvalidArgumentError(f"total_bytes must be > 0, got {total_bytes}")
        base = validate_name(name) if name else instance_name(engine)
        self.name = group_record_name(base, group_id)
        self.group_id = group_id
        self.engine = engine
        dev_type, dev_index = parse_device(device)
        if budget == FROM_ENV:
            budget = DeviceBudget.from_env(device)
        elif isinstance(budget, str):
            raise InvalidArgumentError(f"budget must be a DeviceBudget, 'env' or None, got {budget!r}")
        self.budget: Optional[DeviceBudget] = budget
        if budget is not None:
            device_bytes = budget.budget_bytes
        else:
            device_bytes = int(_C.backend_info(device)["total_bytes"])
        if limit_bytes is None:
            limit_bytes = min(int(total_bytes), device_bytes) if device_bytes > 0 else int(total_bytes)
        if limit_bytes <= 0:
            raise InvalidArgumentError(f"limit_bytes must be > 0, got {limit_bytes}")
        if device_bytes > 0 and limit_bytes > device_bytes:
            raise InvalidArgumentError(
                f"limit {format_size(limit_bytes)} exceeds the usable memory of {device} "
                f"({format_size(device_bytes)}); give a smaller limit_bytes"
            )
        self._quantum_req, self._device_bytes = quantum_bytes, device_bytes
        self.name, self._tracker = create_record(
            self.name, engine, dev_type, dev_index, int(total_bytes), int(limit_bytes)
        )
        self._tracker.set_device_bytes(device_bytes)
        self._warned: set = set()  # what was logged once already
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()  # guards limit/grant/cap and the PageAllocator cap
        self._limit = int(limit_bytes)
        self._grant = 0 if budget is not None else -1  # -1: no budget
        self._cap = -1
        self._asleep = False  # the engine sleeps: cap 0 whatever the limit (set_asleep)
        self._published = 0  # the `granted` bytes last written to the record
        self._pa: Any = None
        self._bpp = 1
        self._below_page_said = -_GIVE_BACK_LOG_S  # when a limit under one page was last logged
        self._quantum = 1
        self._applied_revision = 0
        self._peer_sum = (-1.0, 0)  # (monotonic time, bytes held by the other members)
        self._shortage_check = (-1.0, False)  # (monotonic time, want published)
        self._wanting = False  # the record shows a want
        self._give_backs = (-_GIVE_BACK_LOG_S, 0, 0, 0)  # (last line, give-backs, bytes, unmapped bytes) unlogged
        # The record's refusal (batched) and give-back counters.
        self.stats = RecordStats(self._tracker)
        # Called on the watcher thread when a peer short of budget wakes this
        # instance (the engine looks for cache to give back: see budget.py).
        self.on_peer_short: Optional[Callable[[], None]] = None
        # Called on the watcher thread, with no lock of this object held, when
        # mapped pages that hold no block must go now: a limit lowered below
        # what is mapped, or a peer short of budget. The BlockManager sets it
        # to release its parked pages (which the allocator counts as in use).
        self.reclaim_unused: Optional[Callable[[], object]] = None
        # Called on the watcher thread, no lock held, after a limit write that changed the
        # limit was applied (ElasticInstance.wake_idle_loop: the idle engine meets it at once).
        self.on_limit_applied: Optional[Callable[[], None]] = None
        # Called under this object's lock (on whichever thread moved it) when the
        # limit or the allocator's cap changes: the manager's kept capacity count is stale then.
        # It must not take a lock (PageSupply.changed: two stores).
        self.on_cap_change: Optional[Callable[[], None]] = None
        self._stopping = False
        self._watcher: Optional[threading.Thread] = None
        self._closed = False
        _live[self.name] = self
        # Clean shutdown unlinks the record; a weak reference, so the registry
        # keeps no instance alive that its owner dropped.
        ref = weakref.ref(self)
        self._atexit = lambda: ref() and ref().close()  # noqa: E731
        atexit.register(self._atexit)

    # ---- properties (read-only views of the state the methods below keep) ----
    tracker = property(operator.attrgetter("_tracker"))
    limit = property(operator.attrgetter("_limit"), doc="The operator's limit as last applied (bytes).")
    cap = property(
        operator.attrgetter("_cap"), doc="What the allocator may map now: min(limit, grant); -1 before attach."
    )
    # A want is published: the load lacks memory the budget could not give. Capacity
    # counts are not reused meanwhile (a peer's give-back is seen by the next step).
    wanting = property(operator.attrgetter("_wanting"), doc="A want is published (the budget is short for the load).")
    asleep = property(
        operator.attrgetter("_asleep"), doc="The engine sleeps (set_asleep): the cap is 0 whatever the limit."
    )
    applied_revision = property(operator.attrgetter("_applied_revision"))

    def record(self) -> RecordView:
        return RecordView.from_snapshot(self._tracker.snapshot())

    # ---- attach / watcher --------------------------------------------------
    def attach(self, pa: Any) -> InstanceLimits:
        """Attaches the record to ``pa`` and starts enforcing the limit.

        Attach before the allocator maps anything (pages it mapped earlier are
        counted from now on, never unmapped). Returns self.
        """
        with self._lock:
            if self._closed:
                raise InvalidArgumentError(f"InstanceLimits {self.name!r} is closed")
            if self._pa is not None:
                raise InvalidArgumentError(f"InstanceLimits {self.name!r} is already attached to a PageAllocator")
            self._pa = pa
            self._bpp = int(pa.bytes_per_page)
            if self.budget is not None:
                q = self._quantum_req if self._quantum_req is not None else self.budget.budget_bytes // 64
                self._quantum = max(self._bpp, (int(q) // self._bpp) * self._bpp)
            pa.attach_tracker(self._tracker)
            if self.budget is not None:
                # The first grant: what is already mapped plus one quantum, if free.
                with self.budget.lock():
                    avail = self.budget.headroom(exclude=self.name)
                    mapped = self._mapped_bytes()
                    self._grant = max(mapped, min(self._limit, mapped + self._quantum, max(avail, 0)))
                    self._enforce_locked()
            self._apply_limit()
        self._watcher = threading.Thread(target=self._watch, name=f"kvcached-limits-{self.name}", daemon=True)
        self._watcher.start()
        return self

    @classmethod
    def for_page_allocator(cls, pa: Any, *, engine: str, device: str, **kwargs: Any) -> InstanceLimits:
        """Creates the record for ``pa`` (capacity taken from it) and attaches it."""
        total = int(pa.get_num_virtual_pages()) * int(pa.bytes_per_page)
        return cls(engine=engine, device=device, total_bytes=total, **kwargs).attach(pa)

    def _mapped_bytes(self) -> int:
        # Includes maps in flight: the allocator counts a page before mapping it.
        return int(self._pa.get_num_mapped_pages()) * self._bpp

    def _watch(self) -> None:
        seen = self._applied_revision
        while not self._stopping:
            wakes = self._tracker.wake_count()
            rev = self._tracker.wait_for_change(seen, _IDLE_WAKE_MS)
            if self._stopping:
                return
            try:
                if rev != seen:
                    seen = self._apply_limit()
                elif self.budget is not None:
                    # Woken without a write: a peer is short of budget and asks
                    # for everything unused back, the reserve pool too. On the
                    # idle timeout (or a spurious return) keep one quantum.
                    if self._tracker.wake_count() != wakes:
                        trace.event("peer_woke", self.name, wanted_by=self._tracker.wake_count() - wakes)
                        t0 = trace.start()
                        before, held = self._mapped_bytes(), self._published
                        self._reclaim()
                        self.release_slack(0, trim_reserve=True)
                        unmapped = before - self._mapped_bytes()
                        self.stats.gave_back(unmapped)
                        trace.end("watcher_gave", t0, self.name, bytes=held - self._published, unmapped=unmapped)
                        self._log_give_back(held - self._published, unmapped)
                        hook = self.on_peer_short
                        if hook is not None:
                            hook()
                    else:
                        self.release_slack(self._quantum)
            except Exception:  # keep watching: a failed apply is retried on the next write
                logger.exception("kvcached: applying the limit of %s failed", self.name)

    def _log_give_back(self, released: int, unmapped: int) -> None:
        """One line per give-back to a peer (how much, why), at most one per
        ``_GIVE_BACK_LOG_S``: under contention peers ask every 0.25 s, and what
        is given back in between is summed into the next line."""
        if released <= 0 and unmapped <= 0:
            return
        last, n, total, freed = self._give_backs
        n, total, freed = n + 1, total + max(released, unmapped), freed + max(unmapped, 0)
        now = time.monotonic()
        if now - last < _GIVE_BACK_LOG_S:
            self._give_backs = (last, n, total, freed)
            return
        self._give_backs = (now, 0, 0, 0)
        logger.info(
            "kvcached: %s gave back %s of unused device budget to peers short of it%s%s",
            self.name,
            format_size(total),
            f" ({format_size(freed)} of it mapped pages holding no block, now unmapped)" if freed else "",
            f", over {n} give-backs" if n > 1 else "",
        )

    def _apply_limit(self) -> int:
        """Enforces the record's limit if record_trusted() allows; returns the revision seen."""
        snap = self._tracker.snapshot()
        if not record_trusted(snap, self.name, self._limit, self._device_bytes, self._warned):
            return self._applied_revision if snap.busy else int(snap.revision)
        with self._lock:
            changed = int(snap.limit) != self._limit
            if changed and self.on_cap_change is not None:
                self.on_cap_change()  # what the budget may grant moved, even where the cap did not
            self._limit = int(snap.limit)
            if self.budget is not None and self._grant > self._limit:
                self._grant = max(self._limit, 0)  # budget above the limit is of no use: give it back
            self._enforce_locked()
            over = self._pa is not None and self._mapped_bytes() > self._cap
        if over and self._reclaim():
            with self._lock:
                self._enforce_locked()  # the pages just handed back went to the reserve: trim it
        with self._lock:
            self._applied_revision = int(snap.revision)
        self._tracker.ack_revision(snap.revision)
        hook = self.on_limit_applied
        if changed and hook is not None:
            hook()
        now = time.monotonic()
        if self._pa is not None and 0 < self._limit < self._bpp and now - self._below_page_said >= _GIVE_BACK_LOG_S:
            # Applied as written (the writer cannot see the page size), but an engine held to it
            # admits nothing: say so where its operator looks (at most once per _GIVE_BACK_LOG_S: writes may be many).
            self._below_page_said = now
            logger.warning(
                "kvcached: %s: limit %s is less than one page of this instance (%s: every layer's K and V); "
                "nothing can be mapped until it is at least that: kvctl limit %s %s",
                self.name, format_size(self._limit), format_size(self._bpp), self.name, self._bpp,
            )  # fmt: skip
        return int(snap.revision)

    def _reclaim(self) -> bool:
        """Runs ``reclaim_unused`` (outside the lock: it takes the manager's); True if it ran."""
        hook = self.reclaim_unused
        if hook is None:
            return False
        hook()
        return True

    def _enforce_locked(self) -> None:
        """Sets the allocator's cap to min(limit, grant) and publishes the grant.

        Order matters for peers reading the record: a higher grant is published
        before the cap rises; a lower one after the cap fell (then floored at
        what is mapped, maps in flight included), so the record never shows
        less than the allocator may map.
        """
        if self._pa is None:
            return
        cap = self._limit if self._grant < 0 else min(self._limit, self._grant)
        if self._asleep:
            cap = 0
        if self._grant >= 0 and cap > self._cap:
            self._tracker.set_granted(cap)
            self._published = cap
        self._pa.set_mem_limit(cap)
        if cap != self._cap and self.on_cap_change is not None:
            self.on_cap_change()
        self._cap = cap
        mapped = self._mapped_bytes()
        if mapped > cap:
            # Unused mapped pages go at once; pages with live blocks stay
            # mapped until freed (the allocator unmaps them then).
            self._pa.trim()
            mapped = self._mapped_bytes()
        if self._grant >= 0:
            self._published = max(cap, mapped)
            self._tracker.set_granted(self._published)

    # ---- the device-budget gate -------------------------------------------
    def admit_pages(self, n_pages: int) -> None:
        """Makes room in the device budget for allocating ``n_pages`` pages.

        Call right before ``pa.alloc_pages(n_pages)`` (inside the same
        ``try`` that handles OutOfMemoryError). Cheap when the allocator can
        serve from its reserve or within the grant it holds (no lock, no
        syscall); otherwise it takes the device lock, sums what the other
        instances hold and grows the grant.

        Raises:
            OutOfMemoryError: the device budget cannot cover the fresh pages;
                the shortfall is published as this instance's want and every
                peer woken (unused budget and idle caches come back), so a
                retry later may succeed. Nothing else changed.
        """
        if self.budget is None or self._pa is None or self._asleep:
            return  # the allocator enforces the limit itself (a cap of 0 while asleep)
        fresh = int(n_pages) - int(self._pa.get_num_reserved_pages())
        if fresh <= 0:
            return
        need = self._mapped_bytes() + fresh * self._bpp
        if need <= self._cap or need > self._limit:
            return  # within the grant, or the allocator's own limit check answers
        with self._lock:
            if self._closed:
                return
            t0, grant0 = trace.start(), self._grant
            with self.budget.lock():
                others = self.budget.held_bytes(exclude=self.name)
                avail = self.budget.budget_bytes - others
                need = self._mapped_bytes() + fresh * self._bpp
                if need > avail:
                    short = need - avail
                else:
                    short = 0
                    self._grant = max(self._grant, min(self._limit, need + self._quantum, avail))
                    self._enforce_locked()
                    if self._wanting:
                        self._set_want(0)  # the budget covers the load again
            trace.end("grant", t0, self.name, bytes=self._grant - grant0, short=short, pages=int(n_pages))
            if short:
                self._publish_want(short)
                raise OutOfMemoryError(
                    f"device budget of {self.budget.device} exhausted: other instances hold {format_size(others)} "
                    f"of {format_size(self.budget.budget_bytes)}; {self.name} needs {format_size(short)} more "
                    "(retry after they free memory, or raise KVCACHED_GPU_UTILIZATION / lower their limits)"
                )

    def note_shortage(self, need_bytes: int = 0) -> bool:
        """The owner's load needs ``need_bytes`` (default: one page) more than
        it can map now; call it where the engine fails to place a request.

        When the device budget, not this instance's limit, stands in the way,
        the want is published in the record (idle peers give their cached
        pages back: see ``budget.py``) and peers are asked for budget they
        hold unused. Cheap on every miss: the budget is read at most every
        0.25 s and the last answer repeated in between. Returns whether a
        want is published.
        Each call counts one refused request by the last check's cause
        (kvcached.limits.record_stats), added to the record in batches.
        """
        if self._pa is None or self._closed or self._asleep:
            return False  # asleep: the engine asks for nothing (a want would make peers give back)
        now = time.monotonic()
        t, answer = self._shortage_check
        if now - t < _SHORTAGE_CHECK_S:
            self.stats.refused()  # under the cause of the last check
            return answer
        need = max(int(need_bytes), self._bpp)
        over_limit = int(self._pa.get_num_inuse_pages()) * self._bpp + need > self._limit
        answer, lacking = False, 0
        if self.budget is not None:
            room = self.budget.budget_bytes - self.budget.held_bytes(exclude=self.name)
            # What the limit would allow for this need, minus what the budget allows.
            lacking = min(self._limit, self._mapped_bytes() + need) - room
            answer = lacking > 0
        self.stats.judged(REFUSED_BUDGET if answer else REFUSED_LIMIT if over_limit else "")
        self.stats.refused()
        if answer:
            self._publish_want(lacking)
        elif self._wanting:
            self._set_want(0)
        self._shortage_check = (now, answer)
        return answer

    def clear_want(self) -> None:
        """The owner's load no longer misses memory (call it after a scheduling
        step that placed everything it tried): withdraws a published want and
        adds the batch of refusals to the record. Cheap when neither is there."""
        self.stats.flush()
        if self._wanting:
            self._set_want(0)
            self._shortage_check = (-1.0, False)  # the next miss is checked afresh

    def _publish_want(self, lacking: int) -> None:
        """Publishes ``lacking`` bytes (whole pages) as this instance's want and
        wakes every peer: unused budget comes back at once, idle engines look
        for cache to give back."""
        trace.event("want", self.name, bytes=lacking, new=int(not self._wanting))
        if not self._wanting:  # once per want, not per renewal
            logger.info(
                "kvcached: %s wants %s more than the device budget has room for; asking idle peers",
                self.name,
                format_size(lacking),
            )
        self._set_want(-(-lacking // self._bpp) * self._bpp)
        self.budget.nudge(exclude=self.name, everyone=True)

    def _set_want(self, nbytes: int) -> None:
        if nbytes <= 0 and self._wanting:
            trace.event("want_withdrawn", self.name)
        self._tracker.set_wanted(nbytes)
        self._wanting = nbytes > 0

    def num_free_pages(self) -> int:
        """Pages an allocation could get now: use it where the manager would ask
        ``pa.get_num_free_pages()``.

        The allocator alone answers within the grant this instance holds; this
        adds what the device budget could still grant (a snapshot of what the
        other instances hold, at most 50 ms old). It is a capacity check, not a
        reservation: ``admit_pages()`` may still miss.
        """
        pa = self._pa
        if pa is None or self._asleep:
            return 0
        free_now = int(pa.get_num_free_pages())
        if self.budget is None:
            return free_now
        now = time.monotonic()
        t, others = self._peer_sum
        if self._wanting or now - t > _PEER_SUM_TTL_S:  # wanting: a peer's give-back counts at once
            others = self.budget.held_bytes(exclude=self.name)
            self._peer_sum = (now, others)
        reachable_pages = min(self._limit, self.budget.budget_bytes - others) // self._bpp
        mapped = int(pa.get_num_mapped_pages())
        if reachable_pages <= max(self._cap, 0) // self._bpp:
            return free_now
        # Free pages inside the target, at least: every page not mapped or quarantined.
        unmapped_in_target = int(pa.get_num_total_pages()) - mapped - int(pa.get_num_quarantined_pages())
        est = int(pa.get_num_reserved_pages()) + max(0, min(unmapped_in_target, reachable_pages - mapped))
        return max(free_now, est)

    def release_slack(self, keep_bytes: int = 0, trim_reserve: bool = False) -> None:
        """Gives back budget held beyond what is mapped plus ``keep_bytes``;
        with ``trim_reserve`` beyond the pages holding blocks, the reserve pool
        (mapped pages no block uses) unmapped, so only those pages stay held.

        The watcher calls it when a peer asks (trimming) and when idle.
        """
        if self.budget is None or self._pa is None:
            return
        with self._lock:
            if self._closed:
                return
            t0, held = trace.start(), self._published
            mapped = self._mapped_bytes()
            # Trimming, the cap falls to the pages holding blocks before the reserve
            # is unmapped: unmapped first, the pre-mapping thread refilled it before
            # the cap fell (seen: a peer's ask then served only on its 2nd-8th ask).
            floor = int(self._pa.get_num_inuse_pages()) * self._bpp if trim_reserve else mapped
            target = floor + max(0, int(keep_bytes))
            # The record may also show more than needed after a shrink below
            # what was mapped (the grant is floored at mapped bytes then).
            if self._grant > target or self._published > max(self._cap, mapped):
                self._grant = min(self._grant, target)
                self._enforce_locked()  # unmaps the reserve above the new cap
            if trim_reserve and self._mapped_bytes() > floor:
                self._pa.trim()  # a reserve within a cap that did not fall
            if t0 and self._published < held:  # budget handed back to the device: peers may take it
                trace.end("grant_released", t0, self.name, bytes=held - self._published)

    def set_asleep(self, asleep: bool) -> None:
        """The engine falls asleep (True) or wakes (False).

        Asleep, the cap is 0 whatever the limit: no page is mapped, the mapped
        reserve and parked pages are unmapped at once, and budget held beyond
        the pages still holding blocks goes back to the device (the engine
        frees its blocks first; a page with a live block is never unmapped).
        ``kvctl limit`` written meanwhile is applied as usual, but the cap
        stays 0 until the wake, which restores ``min(limit, grant)``: the grant
        grows again on demand through ``admit_pages``. Idempotent.
        """
        with self._lock:
            if self._closed or self._asleep == bool(asleep):
                return
            self._asleep = bool(asleep)
            if self.budget is None or self._pa is None:
                self._enforce_locked()
            elif self._asleep:
                # Only pages holding blocks stay (the null block's): the reserve goes.
                self._grant = int(self._pa.get_num_inuse_pages()) * self._bpp
                self._enforce_locked()
            else:
                with self.budget.lock():  # as at attach: what is mapped plus one quantum, if free
                    mapped = self._mapped_bytes()
                    avail = self.budget.headroom(exclude=self.name)
                    self._grant = max(mapped, min(self._limit, mapped + self._quantum, max(avail, 0)))
                    self._enforce_locked()
        if asleep and self._reclaim():  # parked pages (counted in use) go too
            with self._lock:
                self._enforce_locked()
        logger.debug(  # the engine adapter logs the sleep once for the instance
            "kvcached: %s %s (%s mapped, limit %s)",
            self.name,
            "asleep: cap 0 until the wake" if asleep else "awake: cap back to the limit",
            format_size(self._mapped_bytes() if self._pa is not None else 0),
            format_size(max(self._limit, 0)),
        )

    def on_free(self) -> None:
        """Cheap hook after frees: gives back slack beyond two quanta, and, after a limit was
        lowered under what was mapped (the grant was floored at it), the grant the freed
        pages held: the record then shows more than may be mapped and more than is."""
        if self.budget is None or self._pa is None:
            return
        mapped = self._mapped_bytes()
        if self._published - mapped > 2 * self._quantum or self._published > max(self._cap, mapped):
            self.release_slack(self._quantum)

    # ---- shutdown ------------------------------------------------------------
    def close(self) -> None:
        """Stops the watcher, detaches the allocator and unlinks the record.

        Idempotent. Only the creating process unlinks (a forked child that
        inherited this object leaves the parent's record alone), and only if the
        name still names this record.
        """
        with self._lock:
            if self._closed:
                return
            self.stats.flush()
            self._closed = True
            self._stopping = True
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            # A wake can race with the watcher entering its wait; repeat until it is out.
            while w.is_alive():
                self._tracker.wake()
                w.join(0.01)
        if os.getpid() != self._owner_pid:
            return
        if self._pa is not None:
            self._pa.attach_tracker(None)
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
        _live.pop(self.name, None)
        # Only the file this tracker maps (a successor may hold the name after a
        # `kvctl delete --force`), damaged or not: a truncated one goes too.
        self._tracker.unlink()

    def __enter__(self) -> InstanceLimits:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"InstanceLimits({self.name!r}, limit={format_size(self._limit)}, cap={format_size(max(self._cap, 0))})"
