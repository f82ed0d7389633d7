"""Upstream kvcached's ``MemInfoTracker``: one instance record in /dev/shm, by hand.

Our managers keep their record through ``kvcached.limits.InstanceLimits``
(futex-notified limits, the device budget); this class is for code written
against upstream that publishes usage and polls for a new limit itself. The
record is ours (0600, versioned, ``kvctl list`` shows it), named as upstream's:
``kvcached.utils.DEFAULT_IPC_NAME``, ``_g<group>`` for a group > 0. It is
removed at ``_unlink_segment()`` or interpreter exit; upstream also installed
signal handlers, which we leave to the application (a record whose owner died
is reclaimed by the next owner of the name, or removed by ``kvctl cleanup``).
"""

from __future__ import annotations

import atexit
import os
from typing import Optional

from kvcached import _C, naming, utils
from kvcached.errors import InvalidArgumentError
from kvcached.limits.records import parse_device


class MemInfoTracker:
    """Tracks one pool's memory in its record (upstream's constructor and methods)."""

    def __init__(self, total_mem_size: int, group_id: int = 0) -> None:
        """``total_mem_size``: the initial limit (and capacity), bytes over all layers and buffers."""
        total = int(total_mem_size)
        if total <= 0:
            raise InvalidArgumentError(f"total_mem_size must be > 0 bytes, got {total_mem_size!r}")
        self.ipc_name = naming.group_name(utils._obtain_default_ipc_name(), group_id)
        device = _C.config()["device"] if _C.is_initialized() else "cpu"
        dev_type, dev_index = parse_device(device)
        self._tracker = _C.MemInfoTracker.create(self.ipc_name, "kvcached", dev_type, dev_index, total, total)
        self._pid = os.getpid()
        atexit.register(self._unlink_segment)

    def check_and_get_resize_target(
        self, current_mem_size: int, num_layers: int, num_kv_buffers: int = 2
    ) -> Optional[int]:
        """The record's limit per K/V buffer of one layer, when it differs from
        ``current_mem_size`` (someone changed the limit); else None."""
        per_buffer = int(self._tracker.snapshot().limit) // int(num_layers) // int(num_kv_buffers)
        return per_buffer if per_buffer != int(current_mem_size) else None

    def update_memory_usage(self, used_size: int, prealloc_size: int) -> None:
        """Publishes bytes in use and bytes mapped ahead (``kvctl list``'s USED / PREALLOC)."""
        self._tracker.publish_usage(int(used_size), int(prealloc_size))

    def _unlink_segment(self) -> None:
        """Removes the record (only the creating process does; repeats are no-ops)."""
        if os.getpid() != self._pid:
            return
        try:
            atexit.unregister(self._unlink_segment)
            mine = self._tracker.snapshot()
            cur = _C.MemInfoTracker.open(self.ipc_name).snapshot()
        except _C.KvcachedError:
            return  # already gone
        if (cur.owner_pid, cur.owner_start_time) == (mine.owner_pid, mine.owner_start_time):
            self._tracker.unlink()
