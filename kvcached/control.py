"""Setting an instance's memory limit from Python (what ``kvctl limit`` does).

    from kvcached.control import set_instance_memory_limit
    r = set_instance_memory_limit(8 << 30, revision=3)        # this process's pools (upstream's call)
    r = set_instance_memory_limit(8 << 30, name="kvcached_vllm_4242")   # one instance by name
    if r["status"] == "applied": ...                          # or r == "applied", r.status

Two targets, one result type:

* ``name`` given, or no KV pool lives in this process: the record of that
  instance (default: ``resolve_instance_name``), as ``kvctl limit`` writes it;
  ``revision`` is then a compare-and-set on the record's revision.
* no ``name`` and this process holds KV pools (``kvcached.pool_registry``):
  upstream's call. The limit is split over the pools by virtual capacity (the
  last takes the rest) and each applies its share with
  ``KVCacheManager.set_memory_limit(share, revision=revision)``; ``revision``
  is then the caller's own counter (older: "stale"; the same with another
  limit: "conflict"). None: one above the pools' last.

The result is a ``LimitResult``: upstream's dict (``status``, ``reason``,
``limit_bytes``, ``effective_limit_bytes``, ``revision``, ``mapped_bytes``,
``remaining_bytes``, ``overage_bytes``, ``pools``) plus ``name`` and
``message``; it also reads as before (``r.status``, ``r.revision``,
``r.limit``, ``r.mapped``, ``r.message``, ``r.written``) and compares equal
to, and prints as, its status.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, List, Optional

from kvcached import _C, pool_registry
from kvcached.limits.records import RecordView, list_records, read_record
from kvcached.limits.writer import validate_limit, write_limit
from kvcached.naming import default_instance_name, env_instance_name, validate_name
from kvcached.units import format_size

APPLIED = "applied"
DEFERRED = "deferred"
STALE = "stale"
CONFLICT = "conflict"
REJECTED = "rejected"
UNAVAILABLE = "unavailable"

_ENGINES = ("vllm", "sglang")
_REASONS = {DEFERRED: "inuse_capacity_above_limit", CONFLICT: "revision_reused_with_different_limit"}


class LimitResult(dict):
    """Outcome of a limit write: a dict with upstream's keys plus ``name`` and
    ``message``. Compares equal to (and ``str()`` is) its status.

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
      rejected  Nothing was written: the input was invalid (not an integer
                >= 0, above the device's usable memory), the instance is
                unknown or dead, or the record belongs to another user.
                ``message`` names the fix.
      unavailable  Nothing was written: no name was given, this process holds
                no KV pool and no instance could be told (upstream's status).
    """

    def __init__(
        self,
        status: str,
        *,
        name: str = "",
        revision: int = 0,
        limit: int = 0,
        mapped: int = 0,
        message: str = "",
        effective: Optional[int] = None,
        pools: Optional[List[Dict[str, Any]]] = None,
        reason: Optional[str] = None,
    ) -> None:
        eff = limit if effective is None else effective
        super().__init__(
            status=status,
            reason=_REASONS.get(status, "") if reason is None else reason,
            limit_bytes=limit,
            effective_limit_bytes=eff,
            revision=revision,
            mapped_bytes=mapped,
            remaining_bytes=max(0, eff - mapped),
            overage_bytes=max(0, mapped - eff),
            pools=[] if pools is None else pools,
            name=name,
            message=message,
        )

    status = property(lambda self: self["status"])
    name = property(lambda self: self["name"])
    revision = property(lambda self: self["revision"])
    limit = property(lambda self: self["limit_bytes"])
    mapped = property(lambda self: self["mapped_bytes"])
    message = property(lambda self: self["message"])

    @property
    def written(self) -> bool:
        return self.status in (APPLIED, DEFERRED)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return self["status"] == other
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __str__(self) -> str:
        return self["status"]

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


def set_instance_memory_limit(
    limit_bytes: int,
    revision: Optional[int] = None,
    *,
    name: Optional[str] = None,
    wait_s: float = 0.5,
) -> LimitResult:
    """Sets the KV memory limit (bytes over all layers, K and V) of an instance.

    Args:
        limit_bytes: the new limit, >= 0 and at most the device's usable memory
            (0: nothing new is mapped; pages holding live blocks go as they are freed).
        revision: with ``name`` (or no pool here): if given, write only if the
            record's revision is still this one (read it from
            ``get_instance_memory_limit(name).revision`` or a previous result);
            None writes unconditionally (last writer wins). Without ``name`` in a
            process holding KV pools: upstream's revision (see the module doc).
        name: the instance; default: this process's pools, else see
            ``resolve_instance_name``.
        wait_s: how long to wait for the owner to acknowledge the write before
            answering ``deferred``. 0 answers at once.

    Returns:
        A LimitResult; see its docstring for the exact meaning of each status.
        Never raises for bad input or an unknown instance (``rejected``).
    """
    if name is None:
        pools = [m for m, _ in pool_registry.get_registered_kv_cache_pools()]
        if pools:
            return _split_over_pools(pools, limit_bytes, revision, wait_s)
    try:
        target = resolve_instance_name(name)
    except ValueError as e:
        if name is None:
            return LimitResult(UNAVAILABLE, reason="no_registered_kv_cache_pool", message=str(e))
        return LimitResult(REJECTED, name=name or "", message=str(e))
    return _write_record(target, limit_bytes, revision, wait_s)


def _write_record(target: str, limit_bytes: Any, revision: Optional[int], wait_s: float) -> LimitResult:
    """The limit of one record, as ``kvctl limit`` writes it."""
    try:
        tracker = _C.MemInfoTracker.open(target)
    except _C.KvcachedError as e:
        return LimitResult(REJECTED, name=target, message=str(e))
    rec = RecordView.from_snapshot(tracker.snapshot())

    def now(status: str, message: str, rev: int = rec.revision) -> LimitResult:
        return LimitResult(status, name=target, revision=rev, limit=rec.limit, mapped=rec.mapped, message=message)

    why = validate_limit(limit_bytes, rec, allow_zero=True)
    if why:
        return now(REJECTED, why)
    if revision is not None:
        if isinstance(revision, bool) or not isinstance(revision, int) or not 0 <= revision <= 0xFFFFFFFF:
            return now(REJECTED, f"revision must be an integer in [0, 2**32) from a previous read, got {revision!r}")
        if revision < rec.revision:
            return now(STALE, f"revision {revision} is older than the record's {rec.revision}; re-read and retry")
    try:
        w = write_limit(tracker, int(limit_bytes), expected_revision=revision, wait_s=wait_s)
    except _C.KvcachedError as e:  # a record found invalid or busy while writing: nothing written
        return now(REJECTED, str(e))
    snap = w.snapshot
    if not w.written:
        rec = RecordView.from_snapshot(snap)
        return now(CONFLICT, f"revision {revision} is not the record's ({rec.revision}); re-read and retry")
    new_rev, acked = w.revision, w.acked
    mapped = int(snap.used + snap.prealloc)

    def written(status: str, message: str) -> LimitResult:
        return LimitResult(
            status, name=target, revision=new_rev, limit=int(limit_bytes), mapped=mapped, message=message
        )

    if not acked:
        return written(DEFERRED, f"written; the owner (pid {snap.owner_pid}) has not applied it yet")
    if mapped > int(limit_bytes):
        return written(
            DEFERRED, f"in force for new pages; {format_size(mapped)} still mapped, shrinking as live blocks are freed"
        )
    return written(APPLIED, "applied")


def _split_over_pools(pools: List[Any], limit_bytes: Any, revision: Optional[int], wait_s: float) -> LimitResult:
    """Upstream's call: ``limit_bytes`` split over this process's pools by virtual capacity."""
    names = ",".join(sorted(str(getattr(m, "pool_name", "") or "") for m in pools))
    bad = None
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        bad = f"limit must be an integer >= 0 bytes, got {limit_bytes!r}"
    elif revision is not None and (isinstance(revision, bool) or not isinstance(revision, int) or revision < 0):
        bad = f"revision must be an integer >= 0, got {revision!r}"
    if bad:
        return LimitResult(REJECTED, name=names, message=bad)
    if revision is None:
        revision = 1 + max(int(getattr(m, "_limit_rev", -1)) for m in pools)
    pools.sort(key=lambda m: (str(m.pool_name or ""), int(m.group_id)))
    caps = [max(0, int(m.mem_size) * int(m.num_layers) * int(m.num_kv_buffers)) for m in pools]
    total = sum(caps)
    if total <= 0:
        return LimitResult(REJECTED, name=names, message="the KV pools of this process have no virtual capacity")
    budget = left = min(limit_bytes, total)
    states = []
    for i, (m, cap) in enumerate(zip(pools, caps)):
        share = left if i == len(pools) - 1 else min(left, budget * cap // total)
        kw = {"wait_s": wait_s} if "wait_s" in inspect.signature(m.set_memory_limit).parameters else {}
        states.append(m.set_memory_limit(share, revision=revision, **kw))
        left -= share
    found = {str(st["status"]) for st in states}
    status = next((s for s in (CONFLICT, STALE, DEFERRED) if s in found), APPLIED)
    return LimitResult(
        status,
        name=names,
        revision=revision,
        limit=limit_bytes,
        mapped=sum(int(st["mapped_bytes"]) for st in states),
        effective=sum(int(st["effective_limit_bytes"] or 0) for st in states),
        pools=states,
        message=status if status == APPLIED else f"{status}: see pools",
    )


def get_instance_memory_limit(name: Optional[str] = None) -> RecordView:
    """The record of an instance (default: as ``set_instance_memory_limit``)."""
    return read_record(resolve_instance_name(name))
