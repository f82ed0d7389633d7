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

Upstream's other names: ``IPC_TIMEOUT_S`` and ``SOCKET_DIR`` (read when read),
``send_msg``/``recv_msg`` (upstream's frame, a 4-byte big-endian length, with a
JSON object instead of a pickle: a socket peer must not be able to run code
here). The ``broadcast_*`` calls default to pipeline stage 0 as upstream's do
(``pp_rank=-1``: every stage of KVCACHED_PP_SIZE).
"""

from __future__ import annotations

import atexit
import json
import socket
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvcached import config, naming
from kvcached.errors import InvalidArgumentError
from kvcached.ipc.coordinator import TPCoordinator
from kvcached.ipc.listener import WorkerListener
from kvcached.ipc.paths import socket_path, socket_root
from kvcached.ipc.protocol import WorkerState

__all__ = [
    "MAX_MSG_BYTES",
    "Message",
    "TPCoordinator",
    "WorkerListener",
    "WorkerState",
    "broadcast_kv_tensors_created",
    "broadcast_map_to_kv_tensors",
    "broadcast_unmap_from_kv_tensors",
    "get_coordinator",
    "get_worker_socket_path",
    "recv_msg",
    "send_msg",
    "socket_root",
    "start_worker_listener_thread",
    "stop_worker_listeners",
]

_lock = threading.Lock()
_listeners: List[WorkerListener] = []
_coordinators: Dict[Tuple[int, int, Optional[str], int], TPCoordinator] = {}


Message = Dict[str, Any]
# A frame larger than this is refused unread (upstream had no bound).
MAX_MSG_BYTES = 16 << 20


def __getattr__(name: str) -> Any:
    if name == "IPC_TIMEOUT_S":
        return config.ipc_timeout_s()  # KVCACHED_IPC_TIMEOUT; <= 0 (upstream: none) is the longest bound
    if name == "SOCKET_DIR":
        return socket_root()  # this instance's socket directory (stage 0)
    raise AttributeError(f"module 'kvcached.tp_ipc_util' has no attribute {name!r}")


def _get_socket_dir_name() -> str:
    """The socket directory's base name of this instance (kvcached.naming, rule 5)."""
    return naming.socket_dir_name(naming.ipc_name())


def send_msg(sock: socket.socket, msg: Message) -> None:
    """Sends one message: a 4-byte big-endian length, then ``msg`` as a JSON object."""
    if not isinstance(msg, dict):
        raise InvalidArgumentError(f"a message is a dict with string keys, got {type(msg).__name__}")
    try:
        data = json.dumps(msg, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"message is not JSON-serializable ({e}); send numbers, strings, lists, dicts"
        ) from None
    if len(data) > MAX_MSG_BYTES:
        raise InvalidArgumentError(f"message of {len(data)} bytes exceeds {MAX_MSG_BYTES}; send less at a time")
    sock.sendall(len(data).to_bytes(4, "big") + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("socket closed in the middle of a message" if buf or n != 4 else "socket closed")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Message:
    """Receives one message of ``send_msg``. Raises ConnectionError when the peer
    closed, InvalidArgumentError (a ValueError) for a frame that is not one."""
    length = int.from_bytes(_recv_exact(sock, 4), "big")
    if not 0 < length <= MAX_MSG_BYTES:
        raise InvalidArgumentError(f"message length {length} is outside 1..{MAX_MSG_BYTES}")
    data = _recv_exact(sock, length)
    try:
        msg = json.loads(data)
    except ValueError:
        raise InvalidArgumentError("message is not JSON (a pickling peer? kvcached never unpickles)") from None
    if not isinstance(msg, dict):
        raise InvalidArgumentError(f"message is a JSON {type(msg).__name__}, not an object")
    return msg


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


def broadcast_map_to_kv_tensors(tp_size: int, offsets: Sequence[int], pp_rank: int = 0, group_id: int = 0) -> None:
    """Maps ``offsets`` on every worker, all or nothing (upstream name)."""
    get_coordinator(tp_size, pp_rank, group_id).map(offsets)


def broadcast_unmap_from_kv_tensors(tp_size: int, offsets: Sequence[int], pp_rank: int = 0, group_id: int = 0) -> None:
    """Unmaps ``offsets`` on every worker in two phases, all or nothing (upstream name)."""
    get_coordinator(tp_size, pp_rank, group_id).unmap(offsets)


def broadcast_kv_tensors_created(tp_size: int, pp_rank: int = 0, group_id: int = 0) -> bool:
    """True when every worker has created the group's KV tensors (upstream name)."""
    return get_coordinator(tp_size, pp_rank, group_id).kv_tensors_created()


def _at_exit() -> None:
    stop_worker_listeners()
    with _lock:
        coords = list(_coordinators.values())
        _coordinators.clear()
    for c in coords:
        c.close()
