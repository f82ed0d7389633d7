"""Reservation: bytes of a device budget held for a process that is not an engine.

A borrower (a fine-tuning loop, a diffusion job, any script) joins the device
budget of kvcached.limits.budget as a participant with a record of its own
(engine ``job``: ``kvctl list`` shows it) and holds ``granted`` bytes there.
Engines grow only under the budget lock after summing what every other member
holds, so a byte held for the borrower is a byte no engine maps until the
borrower lets it go. kvcached maps nothing for it: the job allocates the
memory itself (cudaMalloc, PyTorch) once engines have left it free.

Acquiring (``reserve``):

1. the record is created holding nothing (``kvcached_job_<pid>`` unless a
   name is given; a name held by a live instance is refused);
2. while it lacks bytes, the lack is published as its want (``wanted``,
   renewed every 0.25 s: idle engines evict their prefix cache for it, see
   budget.py "Wants") and every peer is woken (``DeviceBudget.nudge``:
   instances holding more grant than they map give the difference back, their
   mapped reserve too);
3. whatever the budget has free is added to its grant under the budget lock,
   ``headroom(exclude=self)`` read under it (the rule every grant follows),
   so engines cannot grow back into bytes it has gathered;
4. it returns once the grant covers the request. At ``timeout_s``:
   ``on_short="raise"`` gives everything back and raises OutOfMemoryError
   naming who holds the rest; ``"partial"`` keeps what was had (maybe 0).

With ``priority=True`` a borrow still short after the gentle route had
``PRIORITY_GRACE_S`` lowers engines' limits (kvcached.borrowing.priority), so
their running requests are preempted down to them; every limit it lowered is
restored when it ends, also when the borrower is killed (a guardian process).

Releasing (``release()``, the end of ``borrow``'s block, interpreter exit):
grant and want go to 0 and the record is unlinked. Engines are not woken: a
wake asks them to give back, and a loaded engine retries its allocations on
every scheduling step, so it grows into the freed bytes by itself.

Death: a record whose owner died counts 0 in every budget at once (its owner
lock is gone: ``RecordView.held``), so engines may grow into what it held;
``kvctl cleanup`` (or the next engine's start) removes the file.

Nothing is left half-held: any exception while acquiring (KeyboardInterrupt
included) releases grant, want, record and lowered limits before it goes on.

Cost: the borrower polls the budget's records (one read of /dev/shm, no lock
unless there is something to take) every 2-50 ms while it waits; peers change
no state that would wake it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import operator
import os
import threading
import time
import weakref
from typing import Any, Iterator, List, Optional, Set

from kvcached import _C
from kvcached.borrowing.priority import LimitCuts
from kvcached.errors import InvalidArgumentError, OutOfMemoryError, int_arg
from kvcached.limits.budget import DeviceBudget
from kvcached.limits.owned_record import create_record
from kvcached.limits.records import RecordView, parse_device
from kvcached.naming import default_instance_name, validate_name
from kvcached.units import format_size

logger = logging.getLogger("kvcached.borrow")

ENGINE_TAG = "job"
ON_SHORT = ("raise", "partial")
DEFAULT_DEVICE = "cuda"  # the current CUDA device when torch is loaded, else cuda:0
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 86400.0
# A want is current for WANT_TTL_S (2 s) after it is written: renewed well within it.
_RENEW_S = 0.25
# Poll interval while waiting: short right after a nudge (peers answer in ms), then backing off.
_POLL_MIN_S, _POLL_MAX_S = 0.002, 0.05
# How long a priority borrow leaves the gentle route (unused grant, reserve, idle
# caches: an idle engine answers a want within ms, its periodic check 0.5 s) before
# it lowers limits; at most half the timeout.
PRIORITY_GRACE_S = 1.0

# Record names this process holds, so a second borrow of the process gets its own.
_names_lock = threading.Lock()
_names_held: Set[str] = set()


def _check_timeout(timeout_s: object) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise InvalidArgumentError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    t = float(timeout_s)
    if not 0.0 <= t <= MAX_TIMEOUT_S or math.isnan(t):
        raise InvalidArgumentError(f"timeout_s must be in [0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}")
    return t


def _budget_for(device: object, budget: Optional[DeviceBudget]) -> DeviceBudget:
    """The budget to borrow from; InvalidArgumentError (one line) for a device without one."""
    if budget is not None:
        if not isinstance(budget, DeviceBudget):
            raise InvalidArgumentError(f"budget must be a DeviceBudget, got {type(budget).__name__}")
        if device is not None and parse_device(device) != (budget.device_type, budget.device_index):
            raise InvalidArgumentError(f"device {device!r} is not the budget's device {budget.device}; pass one")
        return budget
    device = DEFAULT_DEVICE if device is None else device
    try:
        parse_device(device)
        return DeviceBudget.from_env(device)  # type: ignore[arg-type]
    except InvalidArgumentError:
        raise
    except (_C.KvcachedError, ValueError) as e:  # no such device, no driver, a bad environment value
        raise InvalidArgumentError(f"cannot borrow on device {device!r}: {e}") from None


def _claim_name(name: Optional[str]) -> str:
    """``name`` validated, or ``kvcached_job_<pid>`` (``_<k>`` for this process's next ones)."""
    with _names_lock:
        if name is not None:
            try:
                base = validate_name(name)
            except ValueError as e:
                raise InvalidArgumentError(str(e)) from None
            if base in _names_held:
                raise InvalidArgumentError(f"this process already borrows as {base!r}; pass another name")
        else:
            stem = base = default_instance_name(ENGINE_TAG)
            k = 1
            while base in _names_held:
                k += 1
                base = f"{stem}_{k}"
        _names_held.add(base)
        return base


def _holders(budget: DeviceBudget, me: str, n: int = 3) -> str:
    """The largest holders of ``budget`` but ``me``, for an error message."""
    recs = sorted(budget.members(exclude=me), key=lambda r: r.held, reverse=True)
    parts = [f"{r.name} {format_size(r.held)} ({r.engine}, {format_size(r.mapped)} mapped)" for r in recs[:n]]
    if len(recs) > n:
        parts.append(f"{len(recs) - n} more {format_size(sum(r.held for r in recs[n:]))}")
    damaged = budget.damaged(exclude=me)
    if damaged:
        parts.append(f"{len(damaged)} damaged record(s) counted as the whole budget")
    return ", ".join(parts) or "nobody (the budget changed meanwhile)"


class Reservation:
    """Bytes of a device budget held for this process (see the module doc).

    ``nbytes`` is what is held now, ``requested`` what was asked for; both 0
    once released. A context manager (``with reserve(...) as r``) and safe to
    release twice, from any thread; a forked child never releases its parent's.
    Made by ``reserve``; not constructed directly.
    """

    def __init__(self, budget: DeviceBudget, name: str, tracker: Any, priority: bool) -> None:
        self.budget = budget
        self.device = budget.device
        self.name = name
        self._tracker = tracker
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()
        self._granted = 0
        self._requested = 0
        self._released = False
        self._cuts = LimitCuts(name) if priority else None
        ref = weakref.ref(self)
        self._atexit = lambda: (r := ref()) is not None and r.release()  # noqa: E731
        atexit.register(self._atexit)

    nbytes = property(operator.attrgetter("_granted"), doc="Bytes held for this process now.")
    requested = property(operator.attrgetter("_requested"))
    released = property(operator.attrgetter("_released"))

    @property
    def lowered(self) -> List[str]:
        """Engines whose limit this borrow lowered (priority) and will restore."""
        return [] if self._cuts is None else self._cuts.names

    def record(self) -> RecordView:
        return RecordView.from_snapshot(self._tracker.snapshot())

    # ---- acquiring -------------------------------------------------------------
    def grow(self, extra: int, timeout_s: float = DEFAULT_TIMEOUT_S, on_short: str = "raise") -> int:
        """Asks for ``extra`` bytes more, as ``reserve`` asks for its first.

        Returns the bytes held afterwards. With ``on_short="raise"`` a miss
        raises OutOfMemoryError and keeps what was held before the call (it
        gives back only what this call gathered); ``"partial"`` keeps what it got.
        """
        extra = int_arg("extra", extra, minimum=1)
        timeout = _check_timeout(timeout_s)
        if on_short not in ON_SHORT:
            raise InvalidArgumentError(f"on_short must be 'raise' or 'partial', got {on_short!r}")
        with self._lock:
            if self._released:
                raise InvalidArgumentError(f"borrow {self.name} is released; make a new one")
            target = self._granted + extra
            if target > self.budget.budget_bytes:
                raise InvalidArgumentError(
                    f"{format_size(target)} is more than the whole budget of {self.device} "
                    f"({format_size(self.budget.budget_bytes)}); ask for less"
                )
            before = self._granted
            self._set_requested(target)
            try:
                self._gather(target, time.monotonic() + timeout)
            except BaseException:
                self._shrink_to(before)
                raise
            if self._granted < target and on_short == "raise":
                had = self._granted
                self._shrink_to(before)
                raise OutOfMemoryError(self._short_message(target, had, timeout))
            self._set_requested(self._granted)
            return self._granted

    def _set_requested(self, n: int) -> None:
        # The record's limit and total show what the job asked for (kvctl list: LIMIT).
        self._requested = n
        if n > 0:
            self._tracker.set_total(n)
            self._tracker.set_limit(n)

    def _gather(self, target: int, deadline: float) -> None:
        """Takes free budget until ``target`` is held or ``deadline`` passes;
        meanwhile publishes the lack as a want and wakes peers (module doc)."""
        start = time.monotonic()
        priority_at = start + min(PRIORITY_GRACE_S, max(0.0, deadline - start) / 2)
        next_renew = 0.0
        pause = _POLL_MIN_S
        try:
            while True:
                got = self._take_free(target)
                if got >= target:
                    return
                now = time.monotonic()
                if now >= deadline:
                    return
                if now >= next_renew:
                    self._tracker.set_wanted(target - got)
                    self.budget.nudge(exclude=self.name, everyone=True)
                    if self._cuts is not None and now >= priority_at:
                        self._cuts.cover(target - got, self.budget)
                    next_renew = now + _RENEW_S
                    pause = _POLL_MIN_S
                time.sleep(max(0.0, min(pause, deadline - now, next_renew - now)))
                pause = min(2 * pause, _POLL_MAX_S)
        finally:
            self._tracker.set_wanted(0)

    def _take_free(self, target: int) -> int:
        """Adds what the budget has free (up to ``target``) to the grant; returns the grant."""
        if self.budget.headroom(exclude=self.name) <= self._granted:
            return self._granted  # nothing free: no lock taken
        try:
            with self.budget.lock():
                room = self.budget.headroom(exclude=self.name)
                new = min(target, max(self._granted, room))
                if new > self._granted:
                    self._tracker.set_granted(new)
                    self._granted = new
        except OutOfMemoryError:
            pass  # the lock held 5 s by a stopped process: nothing taken this round
        return self._granted

    def _shrink_to(self, n: int) -> None:
        # Lowering a grant needs no lock (see budget.py).
        if n < self._granted:
            self._granted = n
            self._tracker.set_granted(n)
        self._set_requested(n)

    def _short_message(self, target: int, had: int, timeout: float) -> str:
        return (
            f"could not borrow {format_size(target)} of {self.device} within {timeout:g} s: had "
            f"{format_size(had)} of the {format_size(self.budget.budget_bytes)} budget; the rest is held by "
            f"{_holders(self.budget, self.name)}; wait longer (timeout_s), lower their limits (kvctl limit), "
            "pass priority=True or accept less (on_short='partial')"
        )

    # ---- releasing ---------------------------------------------------------------
    def release(self) -> None:
        """Gives everything back: grant and want to 0, the record unlinked, limits
        this borrow lowered restored. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            if os.getpid() != self._owner_pid:
                return  # a forked child: the parent's record is not ours to remove
            self._granted = self._requested = 0
            # Each step on its own: one failing must not keep the others from running.
            for what, step in (
                ("grant", lambda: self._tracker.set_granted(0)),
                ("want", lambda: self._tracker.set_wanted(0)),
                ("record", self._tracker.unlink),
                ("lowered limits", lambda: self._cuts is not None and self._cuts.restore()),
            ):
                try:
                    step()
                except Exception as e:
                    logger.warning("kvcached: borrow %s: giving back its %s failed: %s", self.name, what, e)
            with _names_lock:
                _names_held.discard(self.name)
            atexit.unregister(self._atexit)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{format_size(self._granted)} of {format_size(self._requested)}"
        return f"Reservation({self.name!r}, {self.device}, {state})"


def reserve(
    nbytes: int,
    device: object = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_short: str = "raise",
    name: Optional[str] = None,
    priority: bool = False,
    budget: Optional[DeviceBudget] = None,
) -> Reservation:
    """Holds ``nbytes`` of ``device``'s kvcached budget for this process.

    Args:
        nbytes: bytes to hold (an int > 0, at most the device budget).
        device: ``"cuda"`` (default: the current CUDA device if torch is
            loaded, else 0), ``"cuda:N"``, ``"cpu"`` (the host budget,
            ``KVCACHED_HOST_MEMORY_BUDGET``) or an int.
        timeout_s: how long to wait for engines to give memory back.
        on_short: ``"raise"`` (OutOfMemoryError at the timeout, nothing held)
            or ``"partial"`` (a Reservation of what could be had, maybe 0).
        name: the record's name (default ``kvcached_job_<pid>``).
        priority: also lower engines' limits, so their running requests are
            preempted, when idle memory does not suffice (restored at release).
        budget: a DeviceBudget to join instead of the device's from the
            environment (tests, scoped tenants).

    Raises:
        InvalidArgumentError: bad input (one line; nothing changed).
        OutOfMemoryError: not held within ``timeout_s`` (``on_short="raise"``).
    """
    n = int_arg("nbytes", nbytes, minimum=1)
    timeout = _check_timeout(timeout_s)
    if on_short not in ON_SHORT:
        raise InvalidArgumentError(f"on_short must be 'raise' or 'partial', got {on_short!r}")
    if not isinstance(priority, bool):
        raise InvalidArgumentError(f"priority must be True or False, got {priority!r}")
    b = _budget_for(device, budget)
    if n > b.budget_bytes:
        raise InvalidArgumentError(
            f"{format_size(n)} is more than the whole budget of {b.device} ({format_size(b.budget_bytes)}); "
            "ask for less or raise KVCACHED_GPU_UTILIZATION / KVCACHED_HOST_MEMORY_BUDGET"
        )
    claimed = _claim_name(name)
    try:
        record_name, tracker = create_record(claimed, ENGINE_TAG, b.device_type, b.device_index, n, n)
    except BaseException:
        with _names_lock:
            _names_held.discard(claimed)
        raise
    if record_name != claimed:  # another user's file holds the name: create_record picked another
        with _names_lock:
            _names_held.discard(claimed)
            _names_held.add(record_name)
    r = Reservation(b, record_name, tracker, priority)
    try:
        tracker.set_device_bytes(b.budget_bytes)
        r.grow(n, timeout, on_short)
    except BaseException:
        r.release()
        raise
    if r.nbytes == 0:
        r.release()  # partial and nothing had: nothing to hold the record for
    return r


@contextlib.contextmanager
def borrow(nbytes: int, device: object = None, **options: Any) -> Iterator[Reservation]:
    """``with borrow(8 << 30, "cuda:0") as r:`` holds the memory for the block
    (``r.nbytes`` bytes; ``options``: ``reserve``'s keywords, ``timeout_s``, ``on_short``,
    ``name``, ``priority``, ``budget``) and gives it back when the block ends, however it ends."""
    r = reserve(nbytes, device, **options)
    try:
        yield r
    finally:
        r.release()
