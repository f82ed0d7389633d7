"""Setting an instance's memory limit from Python (what ``kvctl limit`` does).

    from kvcached.control import set_instance_memory_limit
    r = set_instance_memory_limit(8 << 30)                  # this process's instance
    r = set_instance_memory_limit(8 << 30, revision=r.revision, name="kvcached_vllm_4242")
    if r == "applied": ...

The result is a ``LimitResult``: a ``str`` equal to one of the five statuses
below, carrying ``name``, ``revision``, ``limit``, ``mapped`` and ``message``.
"""

from __future__ import annotations

import os
import time
from typing import List, Optional

from kvcached import _C
from kvcached.limits.records import RecordView, list_records, read_record
from kvcached.limits.units import format_size
from kvcached.naming import default_instance_name, env_instance_name, validate_name

APPLIED = "applied"
DEFERRED = "deferred"
STALE = "stale"
CONFLICT = "conflict"
REJECTED = "rejected"

_ENGINES = ("vllm", "sglang")


class LimitResult(str):
    """Outcome of a limit write. Compares equal to its status string.

    Statuses:
      applied   The limit was written (``revision`` is the new revision), the
                owner acknowledged it within ``wait_s`` (its PageAllocator caps
                new mappings at it) and the instance maps no more than it.
      deferred  The limit was written (new ``revision``) but is not fully in
                force yet: the owner has not acknowledged it within ``wait_s``
                (it will when its watcher runs), or the instance still maps
                more than the new limit because pages hold live blocks; they
                are unmapped as the engine frees them and no new page is
                mapped meanwhile (gradual shrink).
      stale     Nothing was written: ``revision`` was given and is older than
                the record's (someone changed the limit since you read it).
                ``revision`` is the current one; re-read and decide again.
      conflict  Nothing was written: ``revision`` was given and was not the
                record's revision at write time, though not older: another
                writer won the compare-and-set at the same revision, or the
                revision belongs to a different incarnation of the record (the
                instance restarted under the same name). Re-read and retry.
      rejected  Nothing was written: the input was invalid (not a positive
                integer, above the device's usable memory), the instance is
                unknown or dead, or the record belongs to another user.
                ``message`` names the fix.
    """

    name: str
    revision: int
    limit: int
    mapped: int
    message: str

    def __new__(
        cls, status: str, *, name: str = "", revision: int = 0, limit: int = 0, mapped: int = 0, message: str = ""
    ) -> LimitResult:
        self = super().__new__(cls, status)
        self.name = name
        self.revision = revision
        self.limit = limit
        self.mapped = mapped
        self.message = message
        return self

    @property
    def status(self) -> str:
        return str.__str__(self)

    @property
    def written(self) -> bool:
        return self.status in (APPLIED, DEFERRED)

    def __repr__(self) -> str:
        return f"LimitResult({self.status!r}, name={self.name!r}, revision={self.revision}, message={self.message!r})"


def resolve_instance_name(name: Optional[str] = None) -> str:
    """The instance a call without an explicit name means.

    Order: ``name``; ``KVCACHED_IPC_NAME``; the single record this process
    owns; the single live ``kvcached_<engine>_<pid>`` record whose pid is this
    process or its process-group leader (a script that started the engine).
    Raises ValueError (saying to pass ``name=``) when none or several fit.
    """
    if name:
        return validate_name(name)
    env = env_instance_name()
    if env:
        return env
    # Imported here: the owner side pulls in threading machinery tools do not need.
    from kvcached.limits.instance import owned_instances

    own: List[str] = [n for n, inst in owned_instances().items() if inst.group_id == 0]
    if len(own) == 1:
        return own[0]
    if len(own) > 1:
        raise ValueError(f"this process owns several instances ({', '.join(sorted(own))}); pass name=")
    candidates = {default_instance_name(e, pid) for e in _ENGINES for pid in {os.getpid(), os.getpgid(0)}}
    found = [r.name for r in list_records() if r.name in candidates and r.alive]
    if len(found) == 1:
        return found[0]
    raise ValueError("cannot tell which instance to limit: pass name= or set KVCACHED_IPC_NAME (see `kvctl list`)")


def validate_limit(limit_bytes: object, rec: RecordView) -> Optional[str]:
    """Why ``limit_bytes`` cannot be the limit of ``rec`` (None if it can)."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int):
        return f"limit must be an integer number of bytes, got {limit_bytes!r}"
    if limit_bytes <= 0:
        return f"limit must be > 0 bytes, got {limit_bytes}; to stop an instance, stop its engine"
    if rec.device_bytes > 0 and limit_bytes > rec.device_bytes:
        return (
            f"limit {format_size(limit_bytes)} exceeds the usable memory of {rec.device} "
            f"({format_size(rec.device_bytes)}); use at most {format_size(rec.device_bytes)}"
        )
    if not rec.alive:
        return f"instance {rec.name!r} is dead (pid {rec.owner_pid}); remove it with `kvctl delete {rec.name}`"
    return None


def set_instance_memory_limit(
    limit_bytes: int,
    revision: Optional[int] = None,
    *,
    name: Optional[str] = None,
    wait_s: float = 0.5,
) -> LimitResult:
    """Sets the KV memory limit (bytes over all layers, K and V) of an instance.

    Args:
        limit_bytes: the new limit, > 0 and at most the device's usable memory.
        revision: if given, write only if the record's revision is still this
            one (read it from ``get_kv_cache_limit(name).revision`` or a
            previous result); None writes unconditionally (last writer wins).
        name: the instance; default see ``resolve_instance_name``.
        wait_s: how long to wait for the owner to acknowledge the write before
            answering ``deferred``. 0 answers at once.

    Returns:
        A LimitResult; see its docstring for the exact meaning of each status.
        Never raises for bad input or an unknown instance (``rejected``).
    """
    try:
        target = resolve_instance_name(name)
    except ValueError as e:
        return LimitResult(REJECTED, name=name or "", message=str(e))
    try:
        tracker = _C.MemInfoTracker.open(target)
    except _C.KvcachedError as e:
        return LimitResult(REJECTED, name=target, message=str(e))
    rec = RecordView.from_snapshot(tracker.snapshot())
    why = validate_limit(limit_bytes, rec)
    if why:
        return LimitResult(
            REJECTED, name=target, revision=rec.revision, limit=rec.limit, mapped=rec.mapped, message=why
        )
    if revision is not None:
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
            return LimitResult(
                REJECTED,
                name=target,
                revision=rec.revision,
                limit=rec.limit,
                mapped=rec.mapped,
                message=f"revision must be a non-negative integer from a previous read, got {revision!r}",
            )
        if revision < rec.revision:
            return LimitResult(
                STALE,
                name=target,
                revision=rec.revision,
                limit=rec.limit,
                mapped=rec.mapped,
                message=f"revision {revision} is older than the record's {rec.revision}; re-read and retry",
            )
    new_rev = int(tracker.set_limit(int(limit_bytes), -1 if revision is None else int(revision)))
    if new_rev < 0:
        cur = RecordView.from_snapshot(tracker.snapshot())
        return LimitResult(
            CONFLICT,
            name=target,
            revision=cur.revision,
            limit=cur.limit,
            mapped=cur.mapped,
            message=f"revision {revision} is not the record's ({cur.revision}); re-read and retry",
        )
    # The owner's watcher acknowledges within milliseconds; waiting briefly lets
    # the answer say whether the limit is in force.
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        snap = tracker.snapshot()
        acked = _acked(snap.applied_revision, new_rev)
        if acked or time.monotonic() >= deadline:
            break
        time.sleep(0.002)
    mapped = int(snap.used + snap.prealloc)
    if not acked:
        return LimitResult(
            DEFERRED,
            name=target,
            revision=new_rev,
            limit=int(limit_bytes),
            mapped=mapped,
            message=f"written; the owner (pid {snap.owner_pid}) has not applied it yet",
        )
    if mapped > int(limit_bytes):
        return LimitResult(
            DEFERRED,
            name=target,
            revision=new_rev,
            limit=int(limit_bytes),
            mapped=mapped,
            message=f"in force for new pages; {format_size(mapped)} still mapped, shrinking as live blocks are freed",
        )
    return LimitResult(APPLIED, name=target, revision=new_rev, limit=int(limit_bytes), mapped=mapped, message="applied")


def _acked(applied: int, written: int) -> bool:
    # Revisions are 32-bit counters: "applied at or after ours", modulo wrap.
    return ((int(applied) - int(written)) & 0xFFFFFFFF) < 0x80000000


def get_instance_memory_limit(name: Optional[str] = None) -> RecordView:
    """The record of an instance (default: as ``set_instance_memory_limit``)."""
    return read_record(resolve_instance_name(name))
