"""Upstream-compatible helpers over instance records (``kvcached.cli.utils``).

``get_kv_cache_limit`` / ``update_kv_cache_limit`` keep upstream's names and
"None when the instance does not exist" convention; the returned view also
carries upstream's field names (``total_size`` is the limit, ``used_size``,
``prealloc_size``).
"""

from __future__ import annotations

from typing import List, Optional

from kvcached import _C
from kvcached.control import validate_limit
from kvcached.limits.records import RecordView, list_records, read_record


def _missing(e: Exception) -> bool:
    return "no kvcached instance named" in str(e)


def get_kv_cache_limit(ipc_name: str) -> Optional[RecordView]:
    """The record of ``ipc_name``, or None if no such instance exists.

    Raises InvalidArgumentError if it exists but this user may not read it.
    """
    try:
        return read_record(ipc_name)
    except _C.InvalidArgumentError as e:
        if _missing(e):
            return None
        raise


def update_kv_cache_limit(ipc_name: str, kv_cache_limit: int) -> Optional[RecordView]:
    """Sets the limit of ``ipc_name`` to ``kv_cache_limit`` bytes (last writer
    wins); returns the record after the write, or None if no such instance.

    Does not wait for the owner to apply it (see
    ``kvcached.control.set_instance_memory_limit`` for that).

    Raises:
        ValueError: the limit is not a positive integer, exceeds the device's
            usable memory, or the instance is dead; nothing was written.
    """
    try:
        tracker = _C.MemInfoTracker.open(ipc_name)
    except _C.InvalidArgumentError as e:
        if _missing(e):
            return None
        raise
    why = validate_limit(kv_cache_limit, RecordView.from_snapshot(tracker.snapshot()))
    if why:
        raise ValueError(why)
    tracker.set_limit(int(kv_cache_limit))
    return RecordView.from_snapshot(tracker.snapshot())


def list_kv_cache_instances() -> List[RecordView]:
    """Every instance record this user can read (alive and dead)."""
    return list_records()
