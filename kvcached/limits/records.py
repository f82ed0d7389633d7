"""Read-only views of the instance records in /dev/shm, for tools.

Only the extension's record code is used (no torch, no GPU library), so
``kvctl`` and ``kvtop`` work over ssh on a machine whose GPU stack is broken.
A record's fields are read atomically one by one; limit and revision together
(seqlock), so a view never pairs a limit with another write's revision.
"""

from __future__ import annotations

import operator
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from kvcached import _C
from kvcached.devices import normalize_device

SHM_DIR = "/dev/shm"
DEVICE_HOST, DEVICE_CUDA, DEVICE_HIP = 0, 1, 2
_DEVICE_KINDS = {DEVICE_HOST: "cpu", DEVICE_CUDA: "cuda", DEVICE_HIP: "hip"}


def device_name(device_type: int, device_index: int) -> str:
    """``cpu``, ``cuda:N`` or ``hip:N`` for a record's device fields."""
    if device_type == DEVICE_HOST:
        return "cpu"
    return f"{_DEVICE_KINDS.get(device_type, f'type{device_type}')}:{device_index}"


def parse_device(device: object) -> Tuple[int, int]:
    """(device_type, device_index) of a device for a record's device fields.

    ``hip[:N]`` is the HIP backend's own name; anything else goes through
    kvcached.devices.normalize_device (``cpu``, ``cuda[:N]``, an int, a
    torch.device). Raises ValueError (InvalidArgumentError) for the rest.
    """
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind == "hip":
            if idx and not idx.isdigit():
                raise ValueError(f"device {device!r}: index must be a non-negative integer")
            return DEVICE_HIP, int(idx or 0)
    dev = normalize_device(device)
    if dev == "cpu":
        return DEVICE_HOST, 0
    return DEVICE_CUDA, int(dev.partition(":")[2])


_LAYOUT: Optional[Dict[str, Any]] = None


def stats_layout() -> Dict[str, Any]:
    """The record statistics' names and histogram bounds (the extension's, fixed
    per record version): ``{"counters": [name...], "histograms": [(name,
    [upper bound ns, ...])...]}``."""
    global _LAYOUT
    if _LAYOUT is None:
        _LAYOUT = _C.record_stats_layout()
    return _LAYOUT


@dataclass(frozen=True)
class HistogramView:
    """One fixed-bucket histogram of a record: ``buckets[i]`` observations of at
    most ``bounds_s[i]`` seconds (cumulative, as Prometheus wants them), one
    more entry for +Inf (equal to ``count``); ``sum_s`` their total."""

    bounds_s: List[float]
    buckets: List[int]
    count: int
    sum_s: float


def _stats_of(s: _C.MemInfoSnapshot) -> Tuple[Dict[str, int], Dict[str, HistogramView]]:
    if not s.has_stats:
        return {}, {}
    layout = stats_layout()
    counters = dict(zip(layout["counters"], s.counters))
    hists: Dict[str, HistogramView] = {}
    for (name, bounds), per_bucket, sum_ns in zip(layout["histograms"], s.hist_buckets, s.hist_sum_ns):
        cum, total = [], 0
        for n in per_bucket:
            total += n
            cum.append(total)
        hists[name] = HistogramView([b / 1e9 for b in bounds], cum, total, sum_ns / 1e9)
    return counters, hists


@dataclass(frozen=True)
class RecordView:
    """One record as read at one moment. Bytes everywhere.

    ``limit``: what the instance may map (all layers, K and V);
    ``used``: bytes of pages holding blocks; ``prealloc``: mapped, unused;
    ``total``: virtual capacity; ``granted``: device-budget bytes the owner
    holds (0: takes part in no budget); ``device_bytes``: usable bytes of the
    device (0: unknown); ``revision``: bumped by every limit write;
    ``applied_revision``: the last revision the owner enforces;
    ``wanted``: bytes the owner's load lacks because the device budget (not
    its own limit) stops it, as of ``wanted_ns`` (CLOCK_REALTIME; 0 bytes:
    nothing wanted). A want is current only while it is being renewed.
    ``quarantined``: bytes of the instance's memory that could not be released
    (a failed driver call) and stay allocated until it exits.

    ``problem`` says why the record cannot be trusted ("" when it can): another
    user's file, a wrong size, a field out of range, a name that does not match.
    Such a record is shown as ``invalid`` and counts in no budget. ``busy``: a
    limit write did not finish within the readers' bound (a writer stopped or
    killed between its two updates); limit and revision may not pair up.
    ``owner_uid``: the uid owning the file (-1: unknown).

    Statistics (records of version 2; a version-1 record, made by an older
    kvcached, has none): ``counters`` by name (pages mapped/unmapped, failures,
    refusals, give-backs; ``stats_layout()`` lists them), ``histograms`` by
    name, ``want_since_ns`` (when the current want began; 0: none).
    ``stats_problem`` says why a version-2 block is not trusted (then both are
    empty; the record's other fields are checked on their own).
    """

    name: str
    engine: str
    device: str
    device_type: int
    device_index: int
    owner_pid: int
    alive: bool
    revision: int
    applied_revision: int
    limit: int
    used: int
    prealloc: int
    total: int
    granted: int
    device_bytes: int
    updated_ns: int
    wanted: int = 0
    wanted_ns: int = 0
    quarantined: int = 0
    owner_uid: int = -1
    problem: str = ""
    busy: bool = False
    record_version: int = 0
    stats_problem: str = ""
    want_since_ns: int = 0
    counters: Dict[str, int] = field(default_factory=dict, hash=False)
    histograms: Dict[str, HistogramView] = field(default_factory=dict, hash=False)

    @property
    def valid(self) -> bool:
        """Every check passed: the record may be trusted (budgets count only these)."""
        return not self.problem

    @property
    def damaged(self) -> bool:
        """This user's record whose owner lives (its owner lock is held) but whose
        contents cannot be trusted: budgets count it as holding everything."""
        return bool(self.problem) and self.alive and self.owner_uid == os.geteuid()

    @property
    def mapped(self) -> int:
        """Bytes of physical memory the instance holds now."""
        return self.used + self.prealloc

    @property
    def held(self) -> int:
        """Bytes of the device this instance counts against a budget.

        A dead owner holds nothing: the OS/driver freed its memory with it.
        An invalid record holds nothing either: its numbers are not trusted.
        """
        return max(self.granted, self.mapped) if self.alive and self.valid else 0

    @property
    def pending(self) -> bool:
        """True while a live owner has not yet enforced the latest limit write.

        An owner that never acknowledges (``applied_revision`` 0: a record
        not managed by InstanceLimits) is never shown pending.
        """
        return self.alive and self.valid and self.applied_revision != 0 and self.applied_revision != self.revision

    def wants(self, max_age_s: float, now_ns: Optional[int] = None) -> int:
        """Bytes a live owner wanted within the last ``max_age_s`` seconds (0: none)."""
        if not self.alive or not self.valid or self.wanted <= 0:
            return 0
        now = time.time_ns() if now_ns is None else now_ns
        return self.wanted if now - self.wanted_ns <= max_age_s * 1e9 else 0

    @property
    def state(self) -> str:
        """``damaged`` (see ``problem``; its owner lives, so budgets count it as
        holding everything), ``invalid`` (see ``problem``; no live owner),
        ``busy``, ``dead``, ``pending`` (live, latest limit not yet enforced) or
        ``alive``."""
        if self.problem:
            return "damaged" if self.damaged else "invalid"
        if self.busy:
            return "busy"
        if not self.alive:
            return "dead"
        return "pending" if self.pending else "alive"

    # Upstream (MemInfoStruct) names, for code written against it.
    total_size = property(operator.attrgetter("limit"), doc="Upstream name of the limit.")
    used_size = property(operator.attrgetter("used"), doc="Upstream name of ``used``.")
    prealloc_size = property(operator.attrgetter("prealloc"), doc="Upstream name of ``prealloc``.")

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(mapped=self.mapped, held=self.held, state=self.state)
        return d

    @classmethod
    def from_snapshot(cls, s: _C.MemInfoSnapshot) -> RecordView:
        counters, hists = _stats_of(s)
        return cls(
            name=s.name,
            engine=s.engine,
            device=device_name(s.device_type, s.device_index),
            device_type=s.device_type,
            device_index=s.device_index,
            owner_pid=s.owner_pid,
            alive=s.owner_alive,
            revision=s.revision,
            applied_revision=s.applied_revision,
            limit=s.limit,
            used=s.used,
            prealloc=s.prealloc,
            total=s.total,
            granted=s.granted,
            device_bytes=s.device_bytes,
            updated_ns=s.updated_ns,
            wanted=s.wanted,
            wanted_ns=s.wanted_ns,
            quarantined=s.quarantined,
            owner_uid=s.owner_uid,
            problem=s.problem,
            busy=s.busy,
            record_version=s.record_version,
            stats_problem=s.stats_problem,
            want_since_ns=s.want_since_ns,
            counters=counters,
            histograms=hists,
        )

    @classmethod
    def unreadable(cls, name: str, problem: str, owner_uid: int = -1) -> RecordView:
        """A file that looks like a record but cannot be opened as one (alive
        while a process holds its owner lock: a live owner's damaged record)."""
        return cls(
            name=name, engine="", device="?", device_type=-1, device_index=0, owner_pid=0,
            alive=_C.record_owner_locked(name),
            revision=0, applied_revision=0, limit=0, used=0, prealloc=0, total=0, granted=0, device_bytes=0,
            updated_ns=0, owner_uid=owner_uid, problem=problem,
        )  # fmt: skip


def read_record(name: str) -> RecordView:
    """The record named ``name``.

    Raises:
        InvalidArgumentError: no such instance, another user's record, or not
            a kvcached record (the message says which and what to do).
    """
    return RecordView.from_snapshot(_C.MemInfoTracker.open(name).snapshot())


# The names found by the last scan of /dev/shm: (the folder's mtime before it, when it
# started, names). See record_names.
_scan: Tuple[int, int, List[str]] = (0, 0, [])
_SETTLED_NS = 1_000_000_000  # a scan trusted again only if the folder had not changed for 1 s before it
_RESCAN_NS = 2_000_000_000  # and at least every 2 s anyway (a wall clock stepped back, a forgotten case)


def record_names() -> List[str]:
    """The names of the records in /dev/shm (``_C.list_mem_info_records``), scanned
    again only when the folder changed.

    The scan opens every file there (a busy host has thousands: ~4 ms); the budget
    asks on every grant. A record is made (and removed) by creating (removing) its
    file, which moves the folder's mtime. The last scan's names are reused while the
    mtime is the one read before that scan, if the folder had not changed for
    ``_SETTLED_NS`` before the scan started: a file created after the scan began then
    moves the mtime past it (the coarse clock the kernel stamps with is far finer than
    1 s), and a record half made at the scan (file created, magic not yet written) is
    not one within that second. Names only: each record is still read, and checked, as
    it is used.
    """
    global _scan
    mtime, started, names = _scan
    try:
        now_mtime = os.stat(SHM_DIR).st_mtime_ns
    except OSError:
        now_mtime = -1
    now = time.time_ns()
    if now_mtime == mtime > 0 and started - mtime > _SETTLED_NS and 0 <= now - started < _RESCAN_NS:
        return names
    names = _C.list_mem_info_records()
    _scan = (now_mtime, now, names)
    return names


def list_records() -> List[RecordView]:
    """Every record this user can read, sorted by device then name.

    A record removed between listing and reading is skipped, not an error; one
    that cannot be opened as a record is listed as invalid, with the reason.
    """
    out: List[RecordView] = []
    for name in record_names():
        try:
            out.append(read_record(name))
        except _C.KvcachedError as e:
            try:
                uid = os.lstat(os.path.join(SHM_DIR, name)).st_uid
            except OSError:
                continue  # removed meanwhile
            out.append(RecordView.unreadable(name, str(e), uid))
    out.sort(key=lambda r: (r.device_type, r.device_index, r.name))
    return out
