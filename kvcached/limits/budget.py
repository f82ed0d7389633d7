"""The device budget: how many bytes all kvcached instances on one device may
map together, and the cross-process bookkeeping that keeps them under it.

Usable bytes of a device:
  GPU   ``KVCACHED_GPU_UTILIZATION`` (default 0.95) x device memory.
  host  ``KVCACHED_HOST_MEMORY_BUDGET`` (bytes, K/M/G suffixes) when set,
        else ``KVCACHED_GPU_UTILIZATION`` x MemTotal.

Every instance record publishes what it maps (used + prealloc) and what it
*holds*: ``granted``, the cap its PageAllocator enforces. An instance counts
``max(granted, used + prealloc)`` against the budget (a dead owner counts 0:
its memory died with it). Grants only grow under the device lock, after
checking the sum, and a PageAllocator never maps past its grant, so

    sum over live instances of mapped bytes <= budget

holds at every moment, not just at check time. Grants shrink without the lock
(lowering what others must leave free is always safe). The numbers read for
the check are a snapshot; a grant that cannot be had is an allocation miss
(OutOfMemoryError), never a crash.

Wants: a grant is never taken from a peer; memory moves between instances
only when its holder frees it. A busy instance frees as its requests finish,
but an idle one whose prefix cache holds pages runs no step that could free
them. So an instance whose load the budget stops (``InstanceLimits.
note_shortage``) publishes the bytes it lacks in its record (renewed while it
keeps missing, withdrawn by ``clear_want`` once it does not), and idle engines
that see a current want (``wanting``) evict their cached pages.

Damage fails closed: a record of this user whose owner lives (its owner
lock is held: ``RecordView.alive``) but whose contents cannot be trusted
(truncated, scribbled) counts as holding the whole budget, on every device,
until its owner exits: what it maps is unknown, and counting it as 0 would let
peers map over it. Each process logs that once per record.

Scope: a budget counts only valid records of its own user (records are 0600;
a record of another uid, even root's view of one, is never trusted: anyone can
plant a file in /dev/shm). ``scope`` narrows a budget to the instances whose
names start with it (separate tenants or test runs on one host).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Set, Tuple

from kvcached import _C, config
from kvcached.errors import InvalidArgumentError, OutOfMemoryError
from kvcached.limits.records import RecordView, device_name, list_records, parse_device
from kvcached.limits.user_lock import UserLock
from kvcached.units import format_size

_LOCK_DIR = "/dev/shm"
# A published want is current this long: a short instance renews it while its
# load keeps missing memory (every scheduling step that cannot place a request).
WANT_TTL_S = 2.0

logger = logging.getLogger(__name__)
_warned_damaged: Set[Tuple[str, str]] = set()


def usable_device_bytes(device: str) -> int:
    """Usable bytes of ``device`` per the environment (see the module docstring;
    kvcached.config reads and checks the variables).

    Asks the backend for the device's memory size unless
    ``KVCACHED_HOST_MEMORY_BUDGET`` answers for the host.
    """
    dev_type, _ = parse_device(device)
    if dev_type == 0:
        n = config.host_memory_budget()
        if n is not None:
            return n
    total = int(_C.backend_info(device)["total_bytes"])
    return int(total * config.gpu_utilization())


@dataclass(frozen=True)
class BudgetSample:
    """The records of one budget and their sum, read under the device lock."""

    records: List[RecordView]
    held: int
    mapped: int
    budget: int


class DeviceBudget:
    """The usable bytes of one device and the instances sharing them.

    Cheap to build; it holds no resources between calls. Thread- and
    process-safe: the lock is a UserLock (flocks on per-user, per-device files
    in /dev/shm), opened anew for each acquisition so threads of one process
    exclude each other too.
    """

    def __init__(self, device: str, budget_bytes: int, *, scope: str = "") -> None:
        self.device_type, self.device_index = parse_device(device)
        self.device = device_name(self.device_type, self.device_index)
        if int(budget_bytes) <= 0:
            raise InvalidArgumentError(f"device budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.scope = scope
        suffix = f"-{hashlib.sha1(scope.encode()).hexdigest()[:12]}" if scope else ""
        self._lock_path = os.path.join(
            _LOCK_DIR, f"kvcached-budget-u{os.geteuid()}-{self.device_type}-{self.device_index}{suffix}.lock"
        )

    @property
    def lock_path(self) -> str:
        """The lock's first file in /dev/shm (one per user, device and scope;
        kvcached.limits.user_lock says why it has fallbacks)."""
        return self._lock_path

    @property
    def lock_paths(self) -> List[str]:
        """Every file the lock may use."""
        return UserLock(self._lock_path).paths

    @classmethod
    def from_env(cls, device: str, *, scope: str = "") -> DeviceBudget:
        """The budget of ``device`` per ``KVCACHED_GPU_UTILIZATION`` / ``KVCACHED_HOST_MEMORY_BUDGET``."""
        return cls(device, usable_device_bytes(device), scope=scope)

    def __repr__(self) -> str:
        return f"DeviceBudget({self.device!r}, {format_size(self.budget_bytes)}, scope={self.scope!r})"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Excludes every other grant change on this device (all processes of this user).

        Bounded: a lock held for ``user_lock.DEFAULT_WAIT_S`` (a stopped
        holder) raises OutOfMemoryError, an allocation miss the caller retries.
        """
        lock = UserLock(self._lock_path)
        try:
            fds = lock.acquire()
        except TimeoutError as e:
            raise OutOfMemoryError(f"device budget of {self.device} not checked: {e}; retry") from None
        try:
            yield
        finally:
            lock.release(fds)

    def members(self, exclude: Optional[str] = None) -> List[RecordView]:
        """Live, valid records of this user on this device within the scope,
        except ``exclude``. Another user's records never count: anyone could
        plant one (budgets are per user, see the module doc)."""
        return self._live(exclude)[0]

    def damaged(self, exclude: Optional[str] = None) -> List[RecordView]:
        """Records of this user within the scope, except ``exclude``, whose owner
        lives but whose contents cannot be trusted (on any device: their device
        field is not trusted either)."""
        return self._live(exclude)[1]

    def _live(self, exclude: Optional[str]) -> Tuple[List[RecordView], List[RecordView]]:
        uid = os.geteuid()
        ours = [
            r
            for r in list_records()
            if r.alive and r.owner_uid == uid and r.name.startswith(self.scope) and r.name != exclude
        ]
        valid = [
            r for r in ours if r.valid and r.device_type == self.device_type and r.device_index == self.device_index
        ]
        return valid, [r for r in ours if r.damaged]

    def held_bytes(self, exclude: Optional[str] = None) -> int:
        """Bytes the members hold (``max(granted, used + prealloc)`` each), plus
        the whole budget for each damaged live record (see the module doc)."""
        valid, damaged = self._live(exclude)
        for r in damaged:
            if (r.name, r.problem) not in _warned_damaged:
                _warned_damaged.add((r.name, r.problem))
                logger.warning(
                    "kvcached: the record of %s is damaged while its owner lives (%s); the device budget counts it "
                    "as holding all %s of %s until that instance is restarted",
                    r.name,
                    r.problem,
                    format_size(self.budget_bytes),
                    self.device,
                )
        return sum(r.held for r in valid) + self.budget_bytes * len(damaged)

    def headroom(self, exclude: Optional[str] = None) -> int:
        """Bytes not held by any member but ``exclude`` (may be < 0 after a budget change)."""
        return self.budget_bytes - self.held_bytes(exclude)

    def wanting(self, exclude: Optional[str] = None, max_age_s: float = WANT_TTL_S) -> List[RecordView]:
        """Members (but ``exclude`` and this process's own records) whose load
        wanted memory the budget could not give within the last ``max_age_s``
        seconds: idle instances should give them their cached pages."""
        now, me = time.time_ns(), os.getpid()
        return [r for r in self.members(exclude) if r.owner_pid != me and r.wants(max_age_s, now)]

    def nudge(self, exclude: Optional[str] = None, everyone: bool = False) -> int:
        """Wakes the watcher of every member that holds more than it maps (with
        ``everyone``: of every member, so idle engines see a new want at once),
        so it gives the difference back. Returns how many were woken."""
        n = 0
        for r in self.members(exclude):
            if everyone or r.granted > r.mapped:
                try:
                    _C.MemInfoTracker.open(r.name).wake()
                    n += 1
                except _C.KvcachedError:
                    continue  # gone meanwhile
        return n

    def sample(self) -> BudgetSample:
        """A consistent view: no grant can grow while it is read."""
        with self.lock():
            recs = self.members()
        return BudgetSample(
            records=recs,
            held=sum(r.held for r in recs),
            mapped=sum(r.mapped for r in recs),
            budget=self.budget_bytes,
        )
