"""TP/PP map/unmap fan-out over Unix sockets, under the upstream kvcached names.

Worker process (owns KV tensors; one per TP rank and pipeline stage)::

    listener = start_worker_listener_thread(rank, pp_rank)   # after create_kv_tensors
    ...
    listener.stop()        # at shutdown: drains running calls, removes the socket

Scheduler process (owns the page ledger)::

    coord = TPCoordinator(tp_size)                # or get_coordinator(tp_size)
    PageAllocator(..., map_fn=coord.map, unmap_fn=coord.unmap)
    broadcast_kv_tensors_created(tp_size)         # workers ready?

Both sides find each other through KVCACHED_IPC_NAME (one name per engine
instance; processes of one engine inherit it) and, for PP, KVCACHED_PP_SIZE.
Semantics, failure handling and the wire format: ``kvcached.ipc`` (coordinator,
listener, protocol). Nothing here pickles; sockets sit in a 0700 directory and
only peers of the same uid are served.
"""

from __future__ import annotations

import atexit
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from kvcached.ipc.coordinator import TPCoordinator
from kvcached.ipc.listener import WorkerListener
from kvcached.ipc.paths import socket_path, socket_root
from kvcached.ipc.protocol import WorkerState

__all__ = [
    "TPCoordinator",
    "WorkerListener",
    "WorkerState",
    "broadcast_kv_tensors_created",
    "broadcast_map_to_kv_tensors",
    "broadcast_unmap_from_kv_tensors",
    "get_coordinator",
    "get_worker_socket_path",
    "socket_root",
    "start_worker_listener_thread",
    "stop_worker_listeners",
]

_lock = threading.Lock()
_listeners: List[WorkerListener] = []
_coordinators: Dict[Tuple[int, int, Optional[str], int], TPCoordinator] = {}


def get_worker_socket_path(rank: int, pp_rank: int = 0, ipc_name: Optional[str] = None) -> str:
    """Socket path of worker ``rank`` in stage ``pp_rank`` (upstream name)."""
    return socket_path(rank, pp_rank, ipc_name)


def start_worker_listener_thread(rank: int, pp_rank: int = 0, ipc_name: Optional[str] = None) -> WorkerListener:
    """Starts this worker's listener (one per process and rank) and stops it at
    interpreter exit if nobody did before. Returns it, so the caller can stop it."""
    listener = WorkerListener(rank, pp_rank, ipc_name).start()
    with _lock:
        if not _listeners and not _coordinators:
            atexit.register(_at_exit)
        _listeners.append(listener)
    return listener


def stop_worker_listeners(timeout: float = 5.0) -> bool:
    """Stops every listener started here; False if one still had a running call."""
    with _lock:
        listeners = list(_listeners)
    ok = True
    for lst in listeners:
        if lst.stop(timeout):
            with _lock:
                if lst in _listeners:
                    _listeners.remove(lst)
        else:
            ok = False
    return ok


def get_coordinator(
    tp_size: int, pp_rank: int = -1, group_id: int = 0, ipc_name: Optional[str] = None
) -> TPCoordinator:
    """The process-wide coordinator for (tp_size, stages, group, name), created once."""
    key = (int(tp_size), int(pp_rank), ipc_name, int(group_id))
    with _lock:
        c = _coordinators.get(key)
        if c is None:
            if not _listeners and not _coordinators:
                atexit.register(_at_exit)
            c = _coordinators[key] = TPCoordinator(tp_size, pp_rank=pp_rank, ipc_name=ipc_name, group_id=group_id)
        return c


def broadcast_map_to_kv_tensors(tp_size: int, offsets: Sequence[int], pp_rank: int = -1, group_id: int = 0) -> None:
    """Maps ``offsets`` on every worker, all or nothing (upstream name)."""
    get_coordinator(tp_size, pp_rank, group_id).map(offsets)


def broadcast_unmap_from_kv_tensors(tp_size: int, offsets: Sequence[int], pp_rank: int = -1, group_id: int = 0) -> None:
    """Unmaps ``offsets`` on every worker in two phases, all or nothing (upstream name)."""
    get_coordinator(tp_size, pp_rank, group_id).unmap(offsets)


def broadcast_kv_tensors_created(tp_size: int, pp_rank: int = -1, group_id: int = 0) -> bool:
    """True when every worker has created the group's KV tensors (upstream name)."""
    return get_coordinator(tp_size, pp_rank, group_id).kv_tensors_created()


def _at_exit() -> None:
    stop_worker_listeners()
    with _lock:
        coords = list(_coordinators.values())
        _coordinators.clear()
    for c in coords:
        c.close()
