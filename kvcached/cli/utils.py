"""Upstream-compatible helpers over instance records (``kvcached.cli.utils``).

``get_kv_cache_limit`` / ``update_kv_cache_limit`` keep upstream's names and
"None when the instance does not exist" convention; the returned view also
carries upstream's field names (``total_size`` is the limit, ``used_size``,
``prealloc_size``). ``init_kv_cache_limit``, ``delete_kv_cache_segment``,
``get_ipc_path``/``get_ipc_name`` and ``get_total_gpu_memory`` are upstream's
too. Upstream's raw 24-byte segment (``MemInfoStruct``, ``RwLockedShm``) is
not: our record is versioned, 0600 and seqlocked (docs/COMPAT.md).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from kvcached import _C
from kvcached.limits.records import RecordView, list_records, read_record
from kvcached.limits.writer import validate_limit, write_limit
from kvcached.units import format_size
from kvcached.utils import SHM_DIR


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
    return RecordView.from_snapshot(write_limit(tracker, int(kv_cache_limit), wait_s=0).snapshot)


def list_kv_cache_instances() -> List[RecordView]:
    """Every instance record this user can read (alive and dead)."""
    return list_records()


def get_ipc_path(ipc_name: str) -> str:
    """The record's file: ``/dev/shm/<name>`` (a path is returned as given)."""
    return ipc_name if ipc_name.startswith("/") else os.path.join(SHM_DIR, ipc_name)


def get_ipc_name(ipc_path: str) -> str:
    """The record's name from its path."""
    return os.path.basename(ipc_path)


# Records made by init_kv_cache_limit stay while this process lives (upstream's persist).
_made: Dict[str, _C.MemInfoTracker] = {}


def init_kv_cache_limit(ipc_name: str, kv_cache_limit: int) -> RecordView:
    """Creates the record ``ipc_name`` owned by this process with ``kv_cache_limit`` bytes
    as limit and capacity (device: this process's data plane, else ``cpu``); returns it.

    A live owner's record of that name is refused (InvalidArgumentError), not overwritten.
    """
    from kvcached.limits.records import parse_device

    name = get_ipc_name(ipc_name)
    limit = int(kv_cache_limit)
    if limit <= 0:
        raise _C.InvalidArgumentError(f"kv_cache_limit must be > 0 bytes, got {kv_cache_limit!r}")
    dev_type, dev_index = parse_device(_C.config()["device"] if _C.is_initialized() else "cpu")
    _made[name] = _C.MemInfoTracker.create(name, "kvcached", dev_type, dev_index, limit, limit)
    return read_record(name)


def delete_kv_cache_segment(ipc_name: str) -> bool:
    """Removes the record; False if there was none. Another live process's record
    is refused (InvalidArgumentError naming ``kvctl delete --force``), where
    upstream removed it under the running engine."""
    name = get_ipc_name(ipc_name)
    mine = _made.pop(name, None)
    if mine is not None:  # made here by init_kv_cache_limit: ours to remove
        mine.unlink()
        return True
    try:
        _C.delete_mem_info_record(name, False)
    except _C.InvalidArgumentError as e:
        if _missing(e):
            return False
        raise
    return True


def get_total_gpu_memory() -> int:
    """Total bytes of CUDA device 0, or 0 without one (upstream's helper; no torch needed)."""
    try:
        return int(_C.backend_info("cuda:0")["total_bytes"])
    except Exception:
        return 0


def _format_size(num_bytes: int) -> str:
    """A size for people (``1.50G``), as kvctl prints it."""
    return format_size(int(num_bytes))
